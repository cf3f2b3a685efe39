"""Batched autoregressive sampling with a KV cache, returning ragged responses.

Prompts are left-padded into one batch, prefilled in a single forward, then decoded one
token per step for the whole batch. A row stops after it samples ``eos_id`` (the EOS is
part of its response); the loop ends when every row has stopped or after
``max_new_tokens`` steps. The recorded log-probability of each sampled token is
``log_softmax(logits / temperature)`` in float32, the same quantity
:func:`flowrl.rl.grpo.token_logprobs` recomputes with the same ``temperature``.

Partial rollouts. ``prefixes`` resumes interrupted requests: each row's prefix (tokens an
earlier, preempted sampler generated) is fed after its prompt in the prefill and counts
against ``max_new_tokens``; the result holds the new tokens only, and a row whose prefix
already ends with EOS or is ``max_new_tokens`` long generates nothing. ``on_chunk`` is
called every ``chunk_steps`` decoding steps while any row is still generating, with the
tokens sampled since its previous call, so the caller can store them (``hub.append``); it
is not called for the last tokens, which the caller has in the result. Neither changes
what is sampled: without prefixes the random stream and the result are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import torch
from torch import Tensor

from flowrl.models.causal import CausalLM

__all__ = ["ChunkCallback", "GenerationResult", "generate", "left_pad", "nucleus_logprobs"]

#: ``on_chunk(token_ids, logprobs, counts)``: packed new tokens of every row since the
#: previous call (int64 and float32, row-major) and how many each row got, int64 ``(B,)``.
ChunkCallback = Callable[[Tensor, Tensor, Tensor], None]


@final
@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Sampled responses of one batch, packed: row ``i`` is ``[cu_seqlens[i], cu_seqlens[i+1])``.

    ``token_ids`` int64 and ``logprobs`` float32 are flat ``(total_tokens,)``;
    ``cu_seqlens`` int64 ``(B + 1,)``; ``lengths`` int64 ``(B,)``; ``finished`` bool
    ``(B,)`` is ``True`` where the response (after its prefix, if any) ends with EOS.
    """

    token_ids: Tensor
    logprobs: Tensor
    cu_seqlens: Tensor
    lengths: Tensor
    finished: Tensor

    def responses(self) -> list[Tensor]:
        """Response token ids, one 1-D tensor per row."""
        return list(torch.split(self.token_ids, self.lengths.tolist()))

    def response_logprobs(self) -> list[Tensor]:
        """Sampler log-probabilities, one 1-D tensor per row."""
        return list(torch.split(self.logprobs, self.lengths.tolist()))


def nucleus_logprobs(logits: Tensor, top_p: float) -> Tensor:
    """Float32 log-probs of ``logits`` (last dim) renormalised over each row's nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches
    ``top_p`` (a token is in it when the tokens more likely than it hold less than
    ``top_p``; the most likely one always is); tokens outside get ``-inf``. This is the
    distribution a top-p sampler draws from, so the value at the sampled token is its
    behaviour log-prob (what vLLM reports under ``processed_logprobs``). ``top_p >= 1``:
    plain ``log_softmax``. Differentiable (no gradient reaches the tokens outside).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    outside = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p  # mass of the more likely ones
    outside = torch.zeros_like(outside).scatter(-1, order, outside)
    return torch.log_softmax(logp.masked_fill(outside, float("-inf")), dim=-1)


def left_pad(
    prompts: Sequence[Sequence[int] | Tensor] | Tensor,
    prompt_lengths: Tensor | None = None,
    *,
    pad_id: int = 0,
) -> tuple[Tensor, Tensor]:
    """Left-pad prompts into ``(ids, mask)`` of shape ``(B, max_len)``.

    ``prompts`` is a list of token-id lists, or a right-padded ``(B, T)`` tensor whose
    row ``i`` holds a prompt of ``prompt_lengths[i]`` tokens at its start.
    """
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompt_lengths is None:
            raise ValueError(
                f"a prompt tensor must be 2-D (B, T) with prompt_lengths, got shape "
                f"{tuple(prompts.shape)} and prompt_lengths={prompt_lengths!r}"
            )
        rows = [prompts[i, : int(n)] for i, n in enumerate(prompt_lengths.tolist())]
    else:
        rows = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("generate expects a non-empty batch of non-empty prompts")
    width = max(r.numel() for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :] = r
        mask[i, width - r.numel() :] = True
    return ids, mask


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]] | Tensor,
    max_new_tokens: int,
    *,
    prompt_lengths: Tensor | None = None,
    temperature: float = 1.0,
    eos_id: int,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
    on_chunk: ChunkCallback | None = None,
    chunk_steps: int = 1,
) -> GenerationResult:
    """Sample up to ``max_new_tokens`` tokens after each prompt (and its prefix).

    ``temperature == 0`` decodes greedily (logprobs are then those of the unscaled
    logits). ``generator`` makes sampling reproducible. ``prefixes``, ``on_chunk`` and
    ``chunk_steps``: partial rollouts (module docstring).
    """
    if max_new_tokens < 1:
        raise ValueError(f"generate expects max_new_tokens >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"generate expects temperature >= 0, got {temperature}")
    if not isinstance(chunk_steps, int) or chunk_steps < 1:
        raise ValueError(f"generate expects chunk_steps >= 1, got {chunk_steps!r}")
    ids, mask, budget, finished = _prefill_inputs(
        prompts, prompt_lengths, prefixes, max_new_tokens, eos_id, pad_id
    )
    done = finished | (budget <= 0)
    batch = ids.shape[0]
    device = ids.device
    steps = int(budget[~done].max()) if not bool(done.all()) else 0
    tokens = torch.full((batch, max(steps, 1)), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, max(steps, 1), dtype=torch.float32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    if steps:
        cache = model.new_cache(batch, ids.shape[1] + steps, device=device)
        logits = model(ids, attention_mask=mask, cache=cache)[:, -1]
    scale = temperature if temperature > 0 else 1.0
    sent = 0  # decoding steps already handed to on_chunk
    for step in range(steps):
        logp = torch.log_softmax(logits.float() / scale, dim=-1)
        if temperature > 0:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        else:
            tok = logp.argmax(dim=-1)
        active = ~done
        tokens[:, step] = torch.where(active, tok, pad_id)
        logprobs[:, step] = torch.where(active, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        lengths += active.long()
        finished |= active & (tok == eos_id)
        done |= finished | (lengths >= budget)
        if bool(done.all()) or step == steps - 1:
            break
        if on_chunk is not None and step + 1 - sent >= chunk_steps:
            on_chunk(*_packed(tokens, logprobs, lengths, sent, step + 1))
            sent = step + 1
        logits = model(tok[:, None], cache=cache)[:, 0]

    keep = torch.arange(tokens.shape[1], device=device)[None, :] < lengths[:, None]
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.long, device=device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    return GenerationResult(
        token_ids=tokens[keep],
        logprobs=logprobs[keep],
        cu_seqlens=cu_seqlens,
        lengths=lengths,
        finished=finished,
    )


def _prefill_inputs(
    prompts: Sequence[Sequence[int]] | Tensor,
    prompt_lengths: Tensor | None,
    prefixes: Sequence[Sequence[int]] | None,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(ids, mask)`` of prompt + prefix, each row's budget of new tokens, and which rows'
    prefixes already end with EOS."""
    ids, mask = left_pad(prompts, prompt_lengths, pad_id=pad_id)
    if prefixes is None:
        budget = torch.full((ids.shape[0],), max_new_tokens, dtype=torch.long, device=ids.device)
        return ids, mask, budget, torch.zeros_like(budget, dtype=torch.bool)
    rows = [ids[i][mask[i]] for i in range(ids.shape[0])]
    if len(prefixes) != len(rows):
        raise ValueError(
            f"generate got {len(prefixes)} prefixes for {len(rows)} prompts; pass one "
            "(possibly empty) prefix per prompt"
        )
    pre = [torch.as_tensor(p, dtype=torch.long, device=ids.device).reshape(-1) for p in prefixes]
    n_pre = torch.tensor([p.numel() for p in pre], dtype=torch.long, device=ids.device)
    ids, mask = left_pad([torch.cat([r, p]) for r, p in zip(rows, pre, strict=True)], pad_id=pad_id)
    ended = torch.tensor(
        [p.numel() > 0 and int(p[-1]) == eos_id for p in pre], dtype=torch.bool, device=ids.device
    )
    return ids, mask, max_new_tokens - n_pre, ended


def _packed(
    tokens: Tensor, logprobs: Tensor, lengths: Tensor, start: int, end: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's tokens of decoding steps ``[start, end)``, packed row after row."""
    if tokens.device.type != "cpu":
        steps = torch.arange(start, end, device=tokens.device)[None, :]
        valid_t = steps < lengths[:, None]
        return tokens[:, start:end][valid_t], logprobs[:, start:end][valid_t], valid_t.sum(1)
    # numpy is several times faster than torch on these few-element arrays
    valid = np.arange(start, end)[None, :] < lengths.numpy()[:, None]
    return (
        torch.from_numpy(tokens[:, start:end].numpy()[valid]),
        torch.from_numpy(logprobs[:, start:end].numpy()[valid]),
        torch.from_numpy(valid.sum(axis=1)),
    )

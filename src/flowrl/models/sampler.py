"""Batched autoregressive sampling with a KV cache, returning ragged responses.

Prompts are left-padded into one batch, prefilled in a single forward, then decoded one
token per step for the whole batch. A row stops after it samples ``eos_id`` (the EOS is
part of its response); the loop ends when every row has stopped or after
``max_new_tokens`` steps. The recorded log-probability of each sampled token is
``log_softmax(logits / temperature)`` in float32, the same quantity
:func:`flowrl.rl.grpo.token_logprobs` recomputes with the same ``temperature``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch
from torch import Tensor

from flowrl.models.transformer import TinyLM

__all__ = ["GenerationResult", "generate", "left_pad"]


@final
@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Sampled responses of one batch, packed: row ``i`` is ``[cu_seqlens[i], cu_seqlens[i+1])``.

    ``token_ids`` int64 and ``logprobs`` float32 are flat ``(total_tokens,)``;
    ``cu_seqlens`` int64 ``(B + 1,)``; ``lengths`` int64 ``(B,)``; ``finished`` bool
    ``(B,)`` is ``True`` where the response ends with EOS.
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


def left_pad(
    prompts: Sequence[Sequence[int]] | Tensor,
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
    model: TinyLM,
    prompts: Sequence[Sequence[int]] | Tensor,
    max_new_tokens: int,
    *,
    prompt_lengths: Tensor | None = None,
    temperature: float = 1.0,
    eos_id: int,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Sample up to ``max_new_tokens`` tokens after each prompt.

    ``temperature == 0`` decodes greedily (logprobs are then those of the unscaled
    logits). ``generator`` makes sampling reproducible.
    """
    if max_new_tokens < 1:
        raise ValueError(f"generate expects max_new_tokens >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"generate expects temperature >= 0, got {temperature}")
    ids, mask = left_pad(prompts, prompt_lengths, pad_id=pad_id)
    batch = ids.shape[0]
    device = ids.device
    cache = model.new_cache(batch, ids.shape[1] + max_new_tokens, device=device)
    logits = model(ids, attention_mask=mask, cache=cache)[:, -1]

    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    scale = temperature if temperature > 0 else 1.0
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / scale, dim=-1)
        if temperature > 0:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        else:
            tok = logp.argmax(dim=-1)
        active = ~done
        tokens[:, step] = torch.where(active, tok, pad_id)
        logprobs[:, step] = torch.where(active, logp.gather(1, tok[:, None]).squeeze(1), 0.0)
        lengths += active.long()
        done |= tok == eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(tok[:, None], cache=cache)[:, 0]

    keep = torch.arange(max_new_tokens, device=device)[None, :] < lengths[:, None]
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.long, device=device)
    torch.cumsum(lengths, dim=0, out=cu_seqlens[1:])
    return GenerationResult(
        token_ids=tokens[keep],
        logprobs=logprobs[keep],
        cu_seqlens=cu_seqlens,
        lengths=lengths,
        finished=done,
    )

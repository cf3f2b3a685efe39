"""Durable rollouts: generate a claimed micro-batch token by token through the hub.

:func:`generate_resumable` is what a rollout stage calls with the batch it claimed. It

1. reads each sample's stored prefix (``hub.partial``): tokens that an earlier worker
   generated and appended before it was preempted (its lease expired, the sample came
   back to the hub and to this worker);
2. decodes, feeding each prompt *and its prefix* to the model, so an interrupted request
   resumes where it stopped instead of starting over (starting over would bias training
   towards short responses);
3. every ``append_every`` decoding steps appends the tokens sampled since the last append
   and their sampler log-probs, tagged with the policy ``version`` generating them, in one
   ``hub.append`` (one request per storage unit, which takes both or neither);
4. returns each sample's whole response (prefix + new tokens), log-probs, and the policy
   version of every token, for the stage to ``put``: that put completes the columns and
   drops the prefixes.

Invariants. A sample's stored log-prob prefix is never longer than its token prefix. It
can be shorter only where tokens were appended alone, or where a persistent storage unit
died between logging the two columns: the resuming worker then fills the gap with
log-probs recomputed under its own weights (and appends them, tagged with its version, so
the two prefixes line up again). A returned response always starts with the prefix that
was stored, with that prefix's versions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, final

import numpy as np
import torch

from flowrl._schema.ragged import RaggedArray
from flowrl.models.sampler import generate
from flowrl.rl.grpo import build_batch, token_logprobs

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl._client.future import PutFuture
    from flowrl._controller.meta import BatchMeta
    from flowrl.models.causal import CausalLM

__all__ = [
    "APPEND_EVERY",
    "Appends",
    "PolicyFn",
    "ResumableGeneration",
    "StoredPrefixes",
    "generate_resumable",
    "read_prefixes",
]

#: Default decoding steps between two appends: a few appends per typical LLM response,
#: each one small next to the decoding work it protects.
APPEND_EVERY = 16
_NO_LOGPROBS = np.empty(0, dtype=np.float32)


@final
class Appends:
    """A generator's appends, sent with ``append_async`` (answered while it decodes on) and
    all answered when its ``with`` block ends: the stage's put, which completes the
    columns, comes after them. A refused append raises there; if the block raises, the
    appends are waited for quietly (that exception is what the caller hears)."""

    def __init__(self, hub: HubClient) -> None:
        self._hub = hub
        self._sent: list[PutFuture] = []

    def send(self, meta: BatchMeta, columns: dict[str, Any], version: int) -> None:
        self._sent.append(self._hub.append_async(meta, columns, version=version))

    def __enter__(self) -> Appends:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        sent, self._sent = self._sent, []
        for fut in sent:
            if kind is None:
                fut.result()
            else:
                with contextlib.suppress(Exception):
                    fut.result()


class ResumableGeneration(NamedTuple):
    """Whole responses of a micro-batch, one row per sample, packed.

    ``responses`` int64 token ids (stored prefix first), ``logprobs`` float32 sampler
    log-probs, ``versions`` int64 policy version of each token; ``resumed``: how many
    samples continued from a stored prefix.
    """

    responses: RaggedArray
    logprobs: RaggedArray
    versions: RaggedArray
    resumed: int

    def sample_versions(self, default: int) -> np.ndarray:
        """Each sample's oldest token version (``default`` for a sample without tokens):
        the ``version=`` to put it with, so every sample-level lag bounds its tokens'."""
        cu = self.versions.cu_seqlens
        out = np.full(cu.size - 1, default, dtype=np.int64)
        filled = cu[1:] > cu[:-1]
        if filled.any():
            out[filled] = np.minimum.reduceat(self.versions.values, cu[:-1][filled])
        return out


def generate_resumable(
    model: CausalLM,
    hub: HubClient,
    meta: BatchMeta,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    version: int,
    eos_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    append_every: int = APPEND_EVERY,
    response: str = "response",
    logprobs: str = "sample_logprobs",
) -> ResumableGeneration:
    """Generate the responses of the claimed samples ``meta``, durably (module docstring).

    ``prompts``: one per sample of ``meta``, in order. ``max_new_tokens`` bounds a whole
    response, prefix included. ``version``: the policy version of ``model``'s weights.
    ``append_every``: decoding steps between appends (0: off, neither appends nor reads
    prefixes — plain generation, not resumable). ``response`` and ``logprobs``: the
    ragged columns (int64, float32) the stage writes.
    """
    if not isinstance(append_every, int) or isinstance(append_every, bool) or append_every < 0:
        raise ValueError(f"append_every must be an int >= 0 (0: off), got {append_every!r}")
    if len(prompts) != len(meta):
        raise ValueError(
            f"generate_resumable got {len(prompts)} prompts for {len(meta)} claimed samples; "
            "pass one prompt per sample of the claim, in its order"
        )
    stored = (
        read_prefixes(
            hub,
            meta,
            prompts,
            lambda: (model, version),
            temperature=temperature,
            response=response,
            logprobs=logprobs,
        )
        if append_every
        else None
    )
    resumed = 0 if stored is None else stored.resumed

    def on_chunk(tokens: torch.Tensor, lps: torch.Tensor, counts: torch.Tensor) -> None:
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts.cpu().numpy(), out=cu[1:])
        chunk = {
            response: RaggedArray(tokens.cpu().numpy(), cu),
            logprobs: RaggedArray(lps.cpu().numpy(), cu),
        }
        appends.send(meta, chunk, version)

    prefixes = [t.tolist() for t in stored.tokens] if stored is not None and resumed else None
    appends = Appends(hub)
    with appends:
        out = generate(
            model,
            prompts,
            max_new_tokens,
            temperature=temperature,
            eos_id=eos_id,
            generator=generator,
            prefixes=prefixes,
            on_chunk=on_chunk if append_every else None,
            chunk_steps=max(append_every, 1),
        )
    tokens = out.token_ids.cpu().numpy()
    lps = out.logprobs.cpu().numpy()
    cu = out.cu_seqlens.cpu().numpy()
    if stored is None or not resumed:
        versions = np.full(tokens.size, version, dtype=np.int64)
        return ResumableGeneration(
            RaggedArray(tokens, cu),
            RaggedArray(lps, cu.copy()),
            RaggedArray(versions, cu.copy()),
            0,
        )
    rows = range(len(meta))
    new = [slice(cu[i], cu[i + 1]) for i in rows]
    return ResumableGeneration(
        RaggedArray.from_list([np.concatenate([stored.tokens[i], tokens[new[i]]]) for i in rows]),
        RaggedArray.from_list([np.concatenate([stored.logprobs[i], lps[new[i]]]) for i in rows]),
        RaggedArray.from_list(
            [
                np.concatenate(
                    [stored.versions[i], np.full(new[i].stop - new[i].start, version, np.int64)]
                )
                for i in rows
            ]
        ),
        resumed,
    )


#: ``policy() -> (model, version)``: the model to recompute missing log-probs with and
#: its policy version; called only when some are missing.
PolicyFn = Callable[[], "tuple[CausalLM, int]"]


@final
class StoredPrefixes(NamedTuple):
    """What earlier workers appended for each sample of a claim (empty rows: nothing):
    ``tokens`` (int64), their sampler ``logprobs`` (float32, as many) and ``versions``
    (int64); ``resumed``: how many samples have a prefix."""

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    resumed: int


def read_prefixes(
    hub: HubClient,
    meta: BatchMeta,
    prompts: Sequence[Sequence[int]],
    policy: PolicyFn,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    response: str = "response",
    logprobs: str = "sample_logprobs",
) -> StoredPrefixes:
    """Each claimed sample's stored prefix, its log-probs as long as its tokens.

    Where fewer log-probs than tokens were stored (tokens appended alone, or a persistent
    unit that died between logging the two columns), the missing ones are recomputed with
    ``policy()``'s model (``temperature``, ``top_p`` as sampled) and appended, tagged with
    its version, so the two stored prefixes line up again.
    """
    stored = hub.partial(meta, response)
    n = len(meta)
    tokens = [stored.values[i] for i in range(n)]
    versions = [stored.versions[i] for i in range(n)]
    resumed = int(np.count_nonzero(stored.values.lengths))
    if not resumed:
        return StoredPrefixes(tokens, [_NO_LOGPROBS] * n, versions, 0)
    lps = hub.partial(meta, logprobs).values
    have = lps.lengths
    want = stored.values.lengths
    if np.any(have > want):
        bad = int(np.argmax(have > want))
        raise ValueError(
            f"sample {int(meta.indices[bad])} has {int(have[bad])} stored {logprobs!r} values "
            f"but only {int(want[bad])} stored tokens; generate_resumable appends both "
            f"together, so another writer appended to {logprobs!r}: let one stage write both"
        )
    short = np.flatnonzero(have < want).tolist()
    if not short:
        return StoredPrefixes(tokens, [lps[i] for i in range(n)], versions, resumed)
    model, version = policy()
    ids, mask, starts, cu = build_batch(
        [torch.as_tensor(prompts[i], dtype=torch.long) for i in short],
        [torch.from_numpy(tokens[i].astype(np.int64)) for i in short],
    )
    with torch.no_grad():
        scale = temperature if temperature > 0 else 1.0  # as the sampler's log-probs
        p = top_p if temperature > 0 else 1.0  # greedy sampling ignores top_p
        full = token_logprobs(model, ids, mask, starts, cu, temperature=scale, top_p=p)
    full_np = full.cpu().numpy()
    fills = [_NO_LOGPROBS for _ in range(n)]
    for j, i in enumerate(short):
        fills[i] = full_np[int(cu[j]) + int(have[i]) : int(cu[j + 1])]
    hub.append(meta, logprobs, fills, version=version)
    filled = [np.concatenate([lps[i], fills[i]]) for i in range(n)]
    return StoredPrefixes(tokens, filled, versions, resumed)

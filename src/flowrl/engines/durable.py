"""Durable generation on a rollout engine: stream tokens into the hub, resume from them.

:func:`generate_durable` is what a rollout stage calls with a claimed micro-batch when it
samples with a :class:`~flowrl.engines.RolloutEngine` (the built-in sampler's counterpart
is :func:`flowrl.rl.generate_resumable`). It

1. reads each sample's stored prefix (``hub.partial``, :func:`flowrl.rl.read_prefixes`):
   the tokens, sampler log-probs and per-token versions that an earlier worker appended
   before it died or lost its lease, and adds each sample as a request that continues
   from it (:class:`~flowrl.engines.GenerationRequest` ``prefix``), so an interrupted
   response resumes where it stopped instead of being sampled again;
2. steps the engine until every request is returned, loading a newer policy version
   before adding the requests and between steps when ``poll_weights`` offers one
   (``update_weights``: running requests resume from their prefixes under it, their next
   tokens tagged with it);
3. every ``append_every`` engine steps while any request runs, and before every weight
   update, appends what each request generated since the last append
   (:meth:`~flowrl.engines.RolloutEngine.partial` for those still running, the whole
   response for those that finished) to the hub's ``response`` and ``logprobs`` columns
   in one ``hub.append_async`` (answered while the engine steps on; all are answered
   before it returns), tagged with the version that sampled those tokens (one version:
   an append comes before every update);
4. returns each sample's whole response (stored prefix + new tokens), log-probs and the
   version of every token, for the stage to ``put``: the put completes the columns.

Invariants. What is stored for a sample is always a prefix of what the engine returns for
it, with the same log-probs and versions. A worker killed at any point leaves its
samples' stored prefixes valid: the next worker to claim them continues from there, and
nothing is generated twice for a sample past its last append. If anything raises, the
micro-batch's requests are aborted, so the engine can take the samples again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch

from flowrl._schema.ragged import RaggedArray
from flowrl.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from flowrl.errors import ConfigError
from flowrl.rl.rollout import (
    Appends,
    PolicyFn,
    ResumableGeneration,
    StoredPrefixes,
    read_prefixes,
)

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl._controller.meta import BatchMeta

__all__ = ["WeightsFn", "generate_durable"]

#: ``poll_weights(have) -> (version, named tensors) | None``: a policy version newer than
#: ``have`` to load between engine steps, or ``None`` (``flowrl.WeightStore.newer``).
WeightsFn = Callable[[int], "tuple[int, Iterable[tuple[str, torch.Tensor]]] | None"]


def generate_durable(
    engine: RolloutEngine,
    hub: HubClient,
    meta: BatchMeta,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    ids: Sequence[int],
    append_every: int,
    policy: PolicyFn | None = None,
    poll_weights: WeightsFn | None = None,
    response: str = "response",
    logprobs: str = "sample_logprobs",
) -> ResumableGeneration:
    """Generate the claimed samples ``meta`` on ``engine``, durably (module docstring).

    ``prompts``: one per sample of ``meta``, in order; ``ids``: their request ids (unique
    among the engine's pending requests; a sample's id also seeds its random stream).
    ``append_every``: engine steps between appends (0: off, neither appends nor reads
    prefixes). ``policy``: a torch model and its version, to recompute stored log-probs
    that are missing (:func:`flowrl.rl.read_prefixes`; ``None``: such a sample fails with
    an error). ``response`` and ``logprobs``: the ragged columns (int64, float32).
    """
    if not isinstance(append_every, int) or isinstance(append_every, bool) or append_every < 0:
        raise ConfigError(f"append_every expects an int >= 0 (0: off), got {append_every!r}")
    if not len(prompts) == len(ids) == len(meta):
        raise ConfigError(
            f"generate_durable got {len(prompts)} prompts and {len(ids)} ids for "
            f"{len(meta)} claimed samples; pass one of each per sample of the claim, in order"
        )
    stored = (
        read_prefixes(
            hub,
            meta,
            prompts,
            policy or _no_policy(meta),
            temperature=params.temperature,
            top_p=params.top_p,
            response=response,
            logprobs=logprobs,
        )
        if append_every
        else None
    )
    stream = _Stream(engine, hub, meta, ids, stored, (response, logprobs))

    def load_newer() -> None:
        newer = None if poll_weights is None else poll_weights(engine.version)
        if newer is not None:
            if append_every:
                stream.append()  # what the old version sampled, tagged with it
            engine.update_weights(newer[1], newer[0])

    load_newer()  # first: requests added after it start under the newest weights
    engine.add(_requests(ids, prompts, stored), params)
    try:
        with stream.appends:
            steps = 0
            while engine.pending:
                load_newer()
                stream.done.update((c.id, c) for c in engine.step())
                steps += 1
                if append_every and steps % append_every == 0 and engine.pending:
                    stream.append()  # (not once all are done: the put follows at once)
    except BaseException:
        engine.abort(ids)
        raise
    rows = [stream.done[i] for i in ids]
    return ResumableGeneration(
        RaggedArray.from_list([c.tokens for c in rows]),
        RaggedArray.from_list([c.logprobs for c in rows]),
        RaggedArray.from_list([c.versions for c in rows]),
        0 if stored is None else stored.resumed,
    )


def _requests(
    ids: Sequence[int], prompts: Sequence[Sequence[int]], stored: StoredPrefixes | None
) -> list[GenerationRequest]:
    out = []
    for k, (i, p) in enumerate(zip(ids, prompts, strict=True)):
        prompt = np.asarray(p, dtype=np.int64)
        if stored is None:
            out.append(GenerationRequest(i, prompt))
        else:
            out.append(
                GenerationRequest(
                    i,
                    prompt,
                    stored.tokens[k].astype(np.int64, copy=False),
                    stored.logprobs[k].astype(np.float32, copy=False),
                    stored.versions[k].astype(np.int64, copy=False),
                )
            )
    return out


class _Stream:
    """The micro-batch's completions and how much of each response the hub holds."""

    def __init__(
        self,
        engine: RolloutEngine,
        hub: HubClient,
        meta: BatchMeta,
        ids: Sequence[int],
        stored: StoredPrefixes | None,
        columns: tuple[str, str],
    ) -> None:
        self.engine = engine
        self.hub = hub
        self.meta = meta
        self.ids = list(ids)
        self.columns = columns
        self.done: dict[int, Completion] = {}
        self.appends = Appends(hub)
        n = len(self.ids)
        self.stored = (
            np.zeros(n, np.int64)
            if stored is None
            else np.array([len(t) for t in stored.tokens], np.int64)
        )

    def append(self) -> None:
        """Append every sample's tokens since the last append. They were all sampled under
        one version: appends happen before every weight update."""
        now = {c.id: c for c in self.engine.partial(self.ids)}
        now.update(self.done)
        new = [
            self._since_append(now.get(i), int(s))
            for i, s in zip(self.ids, self.stored, strict=True)
        ]
        if not any(len(tokens) for tokens, _, _ in new):
            return
        versions = np.unique(np.concatenate([v for _, _, v in new]))
        if len(versions) != 1:
            raise RuntimeError(
                f"tokens of versions {versions.tolist()} since the last append: "
                "generate_durable appends before every weight update"
            )
        tokens, lps = [t for t, _, _ in new], [lp for _, lp, _ in new]
        columns = {self.columns[0]: tokens, self.columns[1]: lps}
        self.appends.send(self.meta, columns, int(versions[0]))
        self.stored += np.array([len(t) for t in tokens], np.int64)

    @staticmethod
    def _since_append(
        c: Completion | None, start: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens, log-probs and versions past ``start`` (``None``: not started, none)."""
        if c is None:
            return _EMPTY, _NO_LOGPROBS, _EMPTY
        return c.tokens[start:], c.logprobs[start:], c.versions[start:]


_EMPTY = np.empty(0, np.int64)
_NO_LOGPROBS = np.empty(0, np.float32)


def _no_policy(meta: BatchMeta) -> PolicyFn:
    def missing() -> NoReturn:
        raise ConfigError(
            f"some of samples {meta.indices[:8].tolist()} have fewer stored log-probs than "
            "tokens and generate_durable has no policy to recompute them with; pass "
            "policy=lambda: (torch_model, version)"
        )

    return missing

"""A TransferQueue sampler (``controller.sampler`` of ``tq.init``) choosing what
``get_meta`` hands out, on a flowrl hub.

The hub knows which samples are ready for a task and not consumed by it; the sampler
chooses among them. :class:`SamplerRunner` leases all of them (a claim that waits for
nothing), calls the sampler with their indexes, acks those it marks consumed and releases
the rest, first in line again. It lives in the process that called ``tq.init``, as
TransferQueue's sampler lives in its controller: other processes reach it through the key
directory's server, so a sampler's state (a rank-aware sampler's cache) is one for all.

``SequentialSampler`` (the default) does not come here: a plain claim of the oldest
samples is what it would choose.
"""

from __future__ import annotations

import threading
from typing import Any

from flowrl._client.base import HubClient
from flowrl.compat.transfer_queue.sampler import BaseSampler, SequentialSampler
from flowrl.errors import ConfigError, NothingReady

__all__ = ["SamplerRunner", "resolve_sampler"]

_LEASE_ALL = 1 << 20  # ready samples one sampling round sees at most


def resolve_sampler(spec: Any) -> Any:
    """``controller.sampler`` as a sampler object, or None for the default (sequential).

    TransferQueue takes a name of one of its samplers, a sampler class or an instance; so
    does this (a sampler of TransferQueue's own package too: anything with ``sample`` and
    ``has_cached_result``).
    """
    from flowrl.compat.transfer_queue import sampler as samplers

    if spec is None or spec == "SequentialSampler" or spec is SequentialSampler:
        return None
    if isinstance(spec, str):
        found = getattr(samplers, spec, None)
        if not (isinstance(found, type) and issubclass(found, BaseSampler)):
            raise ConfigError(
                f"tq.init(): controller.sampler {spec!r} names no sampler; the names are "
                f"{sorted(samplers.__all__)}, or pass a sampler class or instance"
            )
        spec = found
    if isinstance(spec, type):
        spec = spec()
    if not (callable(getattr(spec, "sample", None)) and hasattr(spec, "has_cached_result")):
        raise ConfigError(
            f"tq.init(): controller.sampler must be a sampler (a BaseSampler subclass, "
            f"instance or name), got {spec!r}"
        )
    return None if type(spec) is SequentialSampler else spec


class SamplerRunner:
    """Runs one sampler for every client of a hub, one sampling round at a time."""

    def __init__(self, hub: HubClient, sampler: Any) -> None:
        self.hub = hub
        self.sampler = sampler
        self._lock = threading.Lock()

    def sample(
        self,
        task: str,
        task_name: str,
        partition: str,
        batch_size: int,
        sampling_config: dict[str, Any],
    ) -> list[int]:
        """The global indexes the sampler hands out for this ``get_meta`` ([] for "not
        enough yet"), those it marks consumed acked for the hub ``task``."""
        config = {"task_name": task_name, "partition_id": partition, **sampling_config}
        with self._lock:
            try:
                leased = self.hub.claim(task, _LEASE_ALL, min_n=1, timeout=0.0)
            except NothingReady:
                leased = None
            ready = [] if leased is None else leased.indices.tolist()
            sampled: list[int] = []
            consumed: list[int] = []
            try:
                if len(ready) >= batch_size or self.sampler.has_cached_result(
                    partition, task_name, config
                ):
                    sampled, consumed = self.sampler(ready, batch_size, **config)
            finally:  # a sampler that raised consumed nothing
                if leased is not None:
                    self._settle(leased, set(consumed))
            return [int(i) for i in sampled]

    def _settle(self, leased: Any, consumed: set[int]) -> None:
        """Ack the leased samples the sampler consumed; the others become ready again."""
        taken = [i for i in leased.indices.tolist() if i in consumed]
        if len(taken) == len(leased):
            self.hub.ack(leased)
            return
        if taken:
            self.hub.ack(leased, taken)
        self.hub.release(leased)

    def clear_cache(self, partition: str) -> None:
        with self._lock:
            self.sampler.clear_cache(partition)

    def name(self) -> str:
        return type(self.sampler).__name__

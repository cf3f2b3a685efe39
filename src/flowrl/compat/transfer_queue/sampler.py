"""TransferQueue's samplers (``transfer_queue.sampler``): which ready samples ``get_meta``
hands out, and which of them count as consumed.

A sampler is called as TransferQueue's controller calls it:
``sampler(ready_indexes, batch_size, **sampling_config)``, where ``ready_indexes`` are the
global indexes whose requested fields are produced and that the task has not consumed
(oldest first) and ``sampling_config`` is what ``get_meta`` was given, with ``task_name``
and ``partition_id`` filled in. It returns ``(sampled, consumed)``; an empty ``sampled``
means "not enough yet". Pass one to ``tq.init`` as ``controller.sampler`` (a name, a class
or an instance). It runs in the process that called ``init`` (the hub's, as TransferQueue
runs it in its controller), so its state is shared by every process of the hub.

``_states[partition_id][task_name][dp_rank][batch_index]`` is the cache samplers keep for
ranks that must see the same batch; ``clear_partition`` drops a partition's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["BaseSampler", "GRPOGroupNSampler", "RankAwareSampler", "SequentialSampler"]


class BaseSampler(ABC):
    """Subclass and implement :meth:`sample`; return ``(sampled, consumed)`` index lists."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``batch_size`` of ``ready_indexes`` (or ``[], []``), and those to mark consumed."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        """Whether a batch for this ``dp_rank`` and ``batch_index`` was sampled already."""
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        ranks = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in ranks and config.get("batch_index") in ranks[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self._states = state["_states"]

    def _cached(self, partition_id: str, task_name: str, dp_rank: Any) -> dict[Any, Any]:
        """The per-batch cache of one rank (created empty)."""
        tasks = self._states.setdefault(partition_id, {})
        return tasks.setdefault(task_name, {}).setdefault(dp_rank, {})


class SequentialSampler(BaseSampler):
    """The oldest ``batch_size`` ready samples (all of them when fewer are ready)."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        taken = list(ready_indexes[:batch_size])
        return taken, taken


class RankAwareSampler(BaseSampler):
    """Every rank of one data-parallel group (same ``dp_rank``) gets the same batch.

    The first rank of a group to ask for batch ``batch_index`` takes the oldest
    ``batch_size`` ready samples (none if fewer are ready) and caches them; the others get
    the cached batch. Groups with other ``dp_rank`` values take other samples.
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int,
        batch_index: int,
        task_name: str,
        partition_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise ValueError(f"RankAwareSampler: dp_rank must be >= 0, got {dp_rank}")
        batches = self._cached(partition_id, task_name, dp_rank)
        if batch_index not in batches:
            if len(ready_indexes) < batch_size:
                return [], []
            batches[batch_index] = list(ready_indexes[:batch_size])
        taken = batches[batch_index]
        return taken, taken


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of ``n_samples_per_prompt`` consecutive global indexes (a prompt's
    responses put one after the other), ``batch_size / n`` groups or none."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(
                f"GRPOGroupNSampler: n_samples_per_prompt must be positive, got "
                f"{n_samples_per_prompt}"
            )
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        batches = self._states.get(partition_id, {}).get(task_name, {}).get(dp_rank, {})
        if batch_index in batches:
            return batches[batch_index]
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise ValueError(
                f"GRPOGroupNSampler: batch_size ({batch_size}) must be a multiple of "
                f"n_samples_per_prompt ({n})"
            )
        groups = _consecutive_runs(sorted(ready_indexes), n, batch_size // n)
        if len(groups) < batch_size // n:
            return [], []
        taken = [i for group in groups for i in group]
        result = (taken, list(taken))
        if dp_rank is not None:
            self._cached(partition_id, task_name, dp_rank).setdefault(batch_index, result)
        return result


def _consecutive_runs(indexes: list[int], n: int, wanted: int) -> list[list[int]]:
    """Up to ``wanted`` runs of ``n`` consecutive values of sorted ``indexes``, scanning
    from the start and skipping one value past a broken run (TransferQueue's scan)."""
    runs: list[list[int]] = []
    i = 0
    while i <= len(indexes) - n and len(runs) < wanted:
        run = indexes[i : i + n]
        if run[-1] - run[0] == n - 1:
            runs.append(run)
            i += n
        else:
            i += 1
    return runs

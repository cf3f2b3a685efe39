"""Balanced data-parallel rounds: one global batch claimed at once, one part per rank.

A claim with a ``BalancedSampler`` takes ``dp_size`` micro-batches' worth of samples and
splits them so that every rank gets about as many tokens (``sched``'s balancing); each part
is a lease. The claiming rank's part is handed out at once; the others wait, leased but not
``taken``, until their rank claims: a rank first takes its part of the oldest round that
still holds one for it. A part that expires or is released goes back to the task's queue
like any lease, and a round is dropped once no part of it waits any more.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from flowrl._controller.leases import Lease, Leases
from flowrl._controller.tasks import TaskState

__all__ = ["Round", "Rounds"]


class Round:
    """One balanced global batch: the part with ``dp_rank == r`` is reserved for rank r."""

    __slots__ = ("by_rank",)

    def __init__(self, parts: list[Lease], dp_size: int) -> None:
        self.by_rank: list[Lease | None] = [None] * dp_size
        for lease in parts:
            self.by_rank[lease.dp_rank] = lease


class Rounds:
    """Per task, the rounds with parts waiting for their rank, oldest first."""

    def __init__(self, leases: Leases) -> None:
        self.by_task: dict[str, list[Round]] = {}
        self._leases = leases

    def deal(
        self,
        state: TaskState,
        chosen: np.ndarray,
        parts: Iterable[np.ndarray],
        deadline: float,
        consumer: str,
        dp_rank: int,
        dp_size: int,
    ) -> Lease | None:
        """Lease ``chosen[part]`` for each rank's part, keep those of the other ranks
        waiting, and return the part of ``dp_rank`` (None: it got no sample)."""
        mine: Lease | None = None
        leased: list[Lease] = []
        round_id = self._leases.next_id  # the id the round's first part gets
        for rank, part in enumerate(parts):
            if part.size == 0:  # only at end of stream, with fewer samples than ranks
                continue
            lease = self._leases.open(
                state,
                chosen[part],
                deadline,
                consumer,
                dp_rank=rank,
                round_id=round_id,
                reserved=rank != dp_rank,
            )
            leased.append(lease)
            if rank == dp_rank:
                mine = lease
        if len(leased) > (mine is not None):
            self.add(state.name, leased, dp_size)
        return mine

    def add(self, task: str, parts: list[Lease], dp_size: int) -> None:
        self.by_task.setdefault(task, []).append(Round(parts, dp_size))

    def take(self, task: str, rank: int, ttl: float) -> Lease | None:
        """Hand ``rank`` its waiting part of the oldest round holding one, due in ``ttl``
        seconds (None: no round holds one)."""
        rounds = self.by_task.get(task)
        if not rounds:
            return None
        for rnd in rounds:
            lease = rnd.by_rank[rank] if rank < len(rnd.by_rank) else None
            if lease is not None and self._waits(lease):
                self._leases.take(lease, time.time() + ttl)
                self.prune(task)
                return lease
        return None

    def prune(self, task: str) -> None:
        """Drop the task's rounds of which no part waits any more."""
        rounds = self.by_task.get(task)
        if rounds is not None:
            self.by_task[task] = [r for r in rounds if self._open(r)]

    def open_ids(self) -> dict[str, list[list[int]]]:
        """Per task, the rounds with a part still waiting, as lease ids by rank (0: no
        part): what a snapshot keeps."""
        return {
            task: [[0 if p is None else p.id for p in r.by_rank] for r in rounds if self._open(r)]
            for task, rounds in self.by_task.items()
        }

    def _open(self, rnd: Round) -> bool:
        return any(p is not None and self._waits(p) for p in rnd.by_rank)

    def _waits(self, lease: Lease) -> bool:
        return not lease.taken and lease.id in self._leases.live

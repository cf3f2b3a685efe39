"""Leases: which samples a claim holds for its task, until when, and how they come back.

A claim leases the samples it returns: their status for the task becomes LEASED and the
lease gets a deadline. An ack consumes them (the controller's part: it may evict); a
release or an expiry gives them back to the task's ready queue, first in line. Deadlines
wait in a heap; an entry whose lease was settled, or renewed by a later entry, is skipped
when it comes up.

A balanced data-parallel claim leases a whole global batch at once, one lease per rank;
the parts for other ranks wait, not ``taken``, until their rank claims them
(``flowrl._controller.rounds``).

Invariant: a sample is in at most one live lease per task (the table's property tests).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping

import numpy as np

from flowrl._controller.tasks import LEASED, READY, TaskState
from flowrl.errors import LeaseError
from flowrl.events import Claimed, LeaseExpired, LeaseTaken, Released

__all__ = ["Emit", "Lease", "Leases", "check_ackable"]

#: Appends one event to the controller's log: ``emit(EventClass, **fields)``.
Emit = Callable[..., None]


class Lease:
    """Samples of one task held by one claim until ``deadline`` (wall-clock seconds)."""

    __slots__ = (
        "consumer",
        "deadline",
        "dp_rank",
        "id",
        "indices",
        "listed",
        "slots",
        "taken",
        "task",
    )

    def __init__(
        self, lid: int, task: str, indices: np.ndarray, deadline: float, consumer: str = ""
    ) -> None:
        self.id = lid
        self.task = task
        self.indices = indices
        self.deadline = deadline
        self.consumer = consumer
        self.dp_rank = 0
        self.taken = True  # False while a balanced part waits for its rank
        # ``indices``' slots and the tuple of them its events carry, where known
        self.slots: np.ndarray | None = None
        self.listed: tuple[int, ...] | None = None


def check_ackable(lease: Lease, indices: np.ndarray) -> bool:
    """LeaseError unless ``indices`` are distinct samples of ``lease``; True when they are
    all of them, in the lease's order."""
    held = lease.indices
    if indices is held or (  # the whole claim, the usual case (bytes compare: a memcmp)
        indices.dtype == held.dtype and indices.tobytes() == held.tobytes()
    ):
        return True
    if not np.isin(indices, lease.indices).all() or np.unique(indices).size != indices.size:
        raise LeaseError(
            f"ack of lease {lease.id} names indices that are not in it (or repeats one)"
        )
    return False


class Leases:
    """The live leases of every task, by id, and their deadlines.

    ``tasks``: the controller's task states (the same dict, kept up to date by it);
    ``emit``: appends the lease events (Claimed, LeaseTaken, Released, LeaseExpired).
    """

    def __init__(self, tasks: Mapping[str, TaskState], capacity: int, emit: Emit) -> None:
        self.live: dict[int, Lease] = {}
        self.next_id = 1
        self._deadlines: list[tuple[float, int]] = []
        self.due = math.inf  # the earliest deadline in the heap (maybe a stale entry's)
        self._tasks = tasks
        self._capacity = capacity
        self._emit = emit

    def __len__(self) -> int:
        return len(self.live)

    def open(
        self,
        state: TaskState,
        indices: np.ndarray,
        deadline: float,
        consumer: str,
        *,
        dp_rank: int = 0,
        round_id: int = 0,
        reserved: bool = False,
        slots: np.ndarray | None = None,
    ) -> Lease:
        """Lease ``indices`` (taken off the task's queue already) to a claim of its task;
        ``reserved``: a balanced part that waits for rank ``dp_rank``."""
        if slots is None:
            slots = indices % self._capacity
        state.status[slots] = LEASED
        lid = self.next_id
        self.next_id += 1
        lease = Lease(lid, state.name, indices, deadline, consumer)
        lease.slots = slots
        lease.listed = listed = tuple(indices.tolist())
        lease.dp_rank = dp_rank
        lease.taken = not reserved
        self.add(lease)
        self._emit(
            Claimed,
            task=state.name,
            lease=lid,
            indices=listed,
            consumer=consumer,
            deadline=deadline,
            dp_rank=dp_rank,
            round=round_id,
            reserved=reserved,
        )
        return lease

    def add(self, lease: Lease) -> None:
        """Hold ``lease`` as live, due at its deadline (a snapshot restores them so)."""
        self.live[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))
        self.due = self._deadlines[0][0]

    def take(self, lease: Lease, deadline: float) -> None:
        """Hand a waiting balanced part to its rank, due at ``deadline`` from now on."""
        lease.taken = True
        lease.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, lease.id))
        self.due = self._deadlines[0][0]
        self._emit(LeaseTaken, task=lease.task, lease=lease.id, deadline=deadline)

    def get(self, task: str, lease_id: int, what: str) -> Lease:
        """The live lease ``lease_id`` of ``task``; LeaseError naming ``what`` otherwise."""
        if not isinstance(lease_id, int) or isinstance(lease_id, bool):
            raise LeaseError(f"{what}() expects an int lease id, got {lease_id!r}")
        lease = self.live.get(lease_id)
        if lease is None or lease.task != task:
            raise LeaseError(
                f"{what}(): lease {lease_id} of task {task!r} is unknown, already settled or "
                "expired; its samples were (or will be) delivered again"
            )
        return lease

    def consume(self, lease: Lease, done: np.ndarray, whole: bool) -> None:
        """Settle acked samples ``done`` of ``lease`` (``whole``: all of them); the lease
        ends with its last sample."""
        if not whole:
            lease.indices = lease.indices[~np.isin(lease.indices, done)]
            lease.slots = lease.listed = None
        if whole or lease.indices.size == 0:
            del self.live[lease.id]

    def release(self, lease: Lease) -> None:
        """End ``lease``, its samples first in its task's queue again."""
        self._give_back(lease)
        self._emit(Released, task=lease.task, lease=lease.id, indices=tuple(lease.indices.tolist()))

    def expire(self, lease: Lease) -> None:
        """End ``lease`` at its deadline, its samples first in its task's queue again."""
        self._give_back(lease)
        self._emit(
            LeaseExpired, task=lease.task, lease=lease.id, indices=tuple(lease.indices.tolist())
        )

    def _give_back(self, lease: Lease) -> None:
        del self.live[lease.id]
        state = self._tasks[lease.task]
        state.status[lease.indices % self._capacity] = READY
        state.queue.push_front(lease.indices)

    def pop_due(self, now: float) -> Lease | None:
        """The next live lease whose deadline is ``now`` or earlier (None: none is), off
        the heap; the caller expires it."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, lid = heapq.heappop(deadlines)
            self.due = deadlines[0][0] if deadlines else math.inf
            lease = self.live.get(lid)
            if lease is not None and lease.deadline == deadline:
                return lease
            # else settled, or renewed (a newer heap entry exists)
        return None

    def next_deadline(self) -> float | None:
        """When the next live lease is due (None: no lease is live)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self.live:
            heapq.heappop(deadlines)
        self.due = deadlines[0][0] if deadlines else math.inf
        return deadlines[0][0] if deadlines else None

    def held_by_others(self, task: str, consumer: str = "") -> bool:
        """Whether leases of ``task`` could still return samples to it.

        Leases held by the claiming ``consumer`` itself do not count: a consumer that keeps
        batches leased (e.g. until a checkpoint) must still learn that the stream ended.
        """
        return any(
            lease.task == task and not (consumer and lease.consumer == consumer)
            for lease in self.live.values()
        )

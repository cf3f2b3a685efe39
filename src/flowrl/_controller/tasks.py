"""Per-task consumption state and the ready queue a claim takes samples from.

For each registered task the controller keeps, per slot, how many of the task's input
columns are still missing and a status (pending → ready → leased → consumed). Samples
enter the task's ready queue the moment their last missing column is put, so a claim
reads the head of a queue instead of scanning the table: claim cost is independent of the
number of live samples.
"""

from __future__ import annotations

import numpy as np

from flowrl._controller.table import all_zero

__all__ = ["CONSUMED", "LEASED", "PENDING", "READY", "ReadyQueue", "TaskState"]

PENDING, READY, LEASED, CONSUMED = 0, 1, 2, 3


class ReadyQueue:
    """FIFO of sample indices backed by one numpy buffer, with room to push in front.

    It holds exactly the task's READY samples: a FIFO claim drops the head, any other
    claim rewrites the queue without the chosen entries (that sampler already looked at
    the whole queue). Returned (released/expired) samples are pushed at the front so they
    are delivered first.
    """

    def __init__(self) -> None:
        self._buf = np.empty(1024, dtype=np.int64)
        self._head = 512  # room to push returned samples in front
        self._tail = 512

    def __len__(self) -> int:
        return self._tail - self._head

    def push_back(self, indices: np.ndarray) -> None:
        n = indices.size
        if self._tail + n > self._buf.size:
            self._regrow(extra_back=n, extra_front=0)
        self._buf[self._tail : self._tail + n] = indices
        self._tail += n

    def push_front(self, indices: np.ndarray) -> None:
        n = indices.size
        if self._head < n:
            self._regrow(extra_back=0, extra_front=n)
        self._buf[self._head - n : self._head] = indices
        self._head -= n

    def view(self, limit: int | None = None) -> np.ndarray:
        end = self._tail if limit is None else min(self._tail, self._head + limit)
        return self._buf[self._head : end]

    def drop_front(self, n: int) -> None:
        self._head += n

    def take_front(self, k: int) -> np.ndarray:
        """Remove the first ``k`` entries; returns them."""
        indices = self.view(k).copy()
        self.drop_front(k)
        return indices

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Remove the entries at sorted distinct ``positions``; returns them."""
        k = positions.size
        if positions[-1] == k - 1:  # sorted distinct positions ending at k-1: the head
            indices = self.take_front(k)
        else:
            full = self.view()
            indices = full[positions]
            self.replace(np.delete(full, positions))
        return indices

    def replace(self, indices: np.ndarray) -> None:
        """Keep only ``indices`` (in their order): compaction after holes accumulate."""
        self._place(indices, 512, 512)

    def _regrow(self, extra_back: int, extra_front: int) -> None:
        self._place(self._buf[self._head : self._tail], 512 + extra_front, extra_back + 512)

    def _place(self, entries: np.ndarray, front: int, back: int) -> None:
        """Lay ``entries`` out from ``front`` with at least ``back`` free behind them. The
        buffer is reused while it is at most four times what they need (fresh memory is
        slow; numpy copies overlapping ranges safely), else reallocated at twice that, so
        a queue that streams through keeps a buffer proportional to what it holds."""
        n = entries.size
        need = front + n + back
        if not need <= self._buf.size <= 4 * max(need, 1024):
            buf = np.empty(max(2 * need, 1024), dtype=np.int64)
            buf[front : front + n] = entries
            self._buf = buf
        else:
            self._buf[front : front + n] = entries
        self._head, self._tail = front, front + n


class TaskState:
    """Consumption state of one consuming task over every slot of the table.

    A task scoped to a partition (``partition``: its name, ``partition_id``: the table's id
    of it) reads that partition's samples only: the others are CONSUMED for it from their
    commit on, so it neither delivers them nor keeps them from being evicted.
    """

    def __init__(
        self,
        name: str,
        columns: tuple[str, ...],
        capacity: int,
        partition: str | None = None,
        partition_id: int = -1,
    ) -> None:
        self.name = name
        self.columns = columns
        self.capacity = capacity
        self.partition = partition
        self.partition_id = partition_id
        self.missing = np.zeros(capacity, dtype=np.int16)
        self.status = np.zeros(capacity, dtype=np.int8)
        self.queue = ReadyQueue()
        self.consumed_total = 0

    def became_ready(
        self, slots: np.ndarray, fresh: dict[str, np.ndarray], new: bool
    ) -> np.ndarray:
        """Of a commit's ``slots``, those whose last missing column for this task arrived
        (``fresh``: per column put, the slots where it was not ready before; ``new``: a
        new put's, where every cell is fresh)."""
        mine = [fresh[c] for c in self.columns if c in fresh]
        if not mine:
            return slots[:0]
        if new:  # every cell of a new sample is fresh, and all its columns were missing
            left = len(self.columns) - len(mine)
            self.missing[slots] = left
            return slots if left == 0 else slots[:0]
        for part in mine:
            self.missing[part] -= 1
        touched = np.unique(np.concatenate(mine)) if len(mine) > 1 else mine[0]
        # (the usual answers, all of them done and pending, read off the bytes: PENDING
        # and no column missing are zeros)
        left = self.missing[touched]
        done = touched if all_zero(left) else touched[left == 0]
        status = self.status[done]
        return done if all_zero(status) else done[status == PENDING]

    def discard(self, slots: np.ndarray) -> None:
        """Consume, without delivering them, those of ``slots`` not leased or consumed
        yet (another task's ``ack(drop=True)``)."""
        status = self.status[slots]
        ready = slots[status == READY]
        gone = slots[(status == READY) | (status == PENDING)]
        self.status[gone] = CONSUMED
        self.consumed_total += int(gone.size)
        if ready.size:
            queued = self.queue.view()
            self.queue.replace(queued[~np.isin(queued % self.capacity, ready)])

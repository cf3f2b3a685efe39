"""Reservations: indices allocated to puts whose data has not been committed yet.

A put reserves its indices before its bytes move and commits them after; a producer may
also reserve indices *ahead* for its next puts (a remote producer saves a round trip per
put). Until committed, reserved indices hold room in the table, and hold up the end of the
stream. A producer that dies between reserve and commit must not hold them for ever:
reservations expire like leases. Those reserved ahead are given back at once when room
runs short or the stream ends (nobody is writing them yet); a producer that puts one of
them later is refused and reserves afresh.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from flowrl._controller.table import SampleTable

__all__ = ["RESERVATION_MIN_S", "Reservations"]

#: Shortest time an uncommitted reservation is held before its producer is presumed dead.
RESERVATION_MIN_S = 10.0


class Reservations:
    """The table's reserved, uncommitted indices and when each reservation expires."""

    def __init__(self, table: SampleTable) -> None:
        self._table = table
        self.count = 0  # indices placed and not committed (those reserved ahead included)
        self.ahead = 0  # of which reserved ahead
        self._is_ahead = np.zeros(table.capacity, dtype=bool)  # by slot
        # (deadline, indices, pooled): pooled ones were reserved ahead
        self._held: collections.deque[tuple[float, np.ndarray, bool]] = collections.deque()
        self.due = math.inf  # the first reservation's deadline

    def hold(self, indices: np.ndarray, n: int, deadline: float) -> None:
        """Count a put's first ``n`` of ``indices`` and the rest, reserved ahead, as
        reserved until committed, or until ``deadline``."""
        self.count += int(indices.size)
        if n:  # (none for a pooled reservation: all of it is ahead)
            self._held.append((deadline, indices[:n], False))
        if indices.size > n:
            ahead = indices[n:]
            self._is_ahead[ahead % self._table.capacity] = True
            self.ahead += int(ahead.size)
            self._held.append((deadline, ahead, True))
        self.due = self._held[0][0] if self._held else math.inf

    def placed(self, n: int) -> None:
        """Count ``n`` indices a journal's replay placed, to be committed at once."""
        self.count += n

    def committed(self, slots: np.ndarray) -> None:
        """Reserved ``slots`` were committed: they hold nothing any more."""
        self.count -= int(slots.size)
        if self.ahead:
            self._settle_ahead(slots)

    def release(self, indices: np.ndarray) -> int:
        """Free those of ``indices`` still reserved and uncommitted; returns how many."""
        table = self._table
        indices = indices[indices >= 0]  # a free slot's owner is -1: never match it
        slots = indices % table.capacity
        mine = slots[(table.owner[slots] == indices) & ~table.committed[slots]]
        table.free(mine)
        self.count -= int(mine.size)
        if self.ahead:
            self._settle_ahead(mine)
        return int(mine.size)

    def reclaim_ahead(self) -> int:
        """Free the indices reserved ahead and not put yet; returns how many."""
        if not self.ahead:
            return 0
        return sum(self.release(indices) for _, indices, pooled in self._held if pooled)

    def expire(self, now: float) -> int:
        """Free the reservations due by ``now``; returns how many freed any index."""
        held = self._held
        count = 0
        while held and held[0][0] <= now:
            count += self.release(held.popleft()[1]) > 0
        self.due = held[0][0] if held else math.inf
        return count

    def next_deadline(self) -> float | None:
        """When the next reservation expires (None: nothing is reserved)."""
        if not self.count:
            self._held.clear()  # every reservation was committed or aborted
            self.due = math.inf
        return self._held[0][0] if self._held else None

    def _settle_ahead(self, slots: np.ndarray) -> None:
        """Slots reserved ahead that were put or freed no longer count as ahead."""
        self.ahead -= int(np.count_nonzero(self._is_ahead[slots]))  # (.sum(): 5x slower)
        self._is_ahead[slots] = False

"""Indices a client's threads reserve ahead for their next puts.

A small put reserves ``RESERVE_AHEAD`` more indices with its own, in the same round trip,
and the thread's next puts take them: a small put then costs the write's round trip
alone. A batched put's commit reserves the next put's indices (``next_cap``): in a steady
stream of puts each costs one round trip, not two; a batched ``put_async`` (whose answer
is read later) reserves for its next ``STREAM_AHEAD`` puts with its own, and each of
its commits tops that up as it is answered, so a steady stream never waits for a
reserve. Reservations expire, so a pool is used only within half a reservation's life.
"""

from __future__ import annotations

import functools
import itertools
import threading

import numpy as np

from flowrl._transport.thread_sockets import on_thread_end

__all__ = ["RESERVE_AHEAD", "STREAM_AHEAD", "Pool", "Pools", "ahead_cap", "next_cap"]

#: Indices a thread reserves ahead for its next small puts (capped at capacity / 64).
RESERVE_AHEAD = 32
#: Puts a batched ``put_async`` reserves indices for beyond its own (capped likewise).
STREAM_AHEAD = 7


def ahead_cap(capacity: int) -> int:
    """The most indices a put may reserve ahead on a hub of ``capacity``: a pool never
    holds more than 1/64 of it, so other producers barely notice it."""
    return min(RESERVE_AHEAD, capacity // 64)


def next_cap(capacity: int) -> int:
    """The most indices a put's commit may reserve for the producer's next put (a batched
    producer's steady state: one round trip a put): 1/64 of ``capacity``, as a pool's, so
    that on a small hub no reservation holds room (or indices) another put needs."""
    return capacity // 64


class Pool:
    """Indices a thread reserved ahead for its next puts, and their storage units: one
    unit for them all (a commit reserved them: taken in order, a cursor keeps the place),
    or one per index."""

    __slots__ = ("first", "free", "indices", "unit", "units", "until")

    def __init__(self, indices: np.ndarray, units: np.ndarray | int, until: float) -> None:
        self.indices = indices
        self.first = 0  # every index before it is taken (takes go mostly in order)
        self.until = until
        if not isinstance(units, int) and units.size and (units == units[0]).all():
            units = int(units[0])  # (the usual case: one unit, taken with a cursor)
        self.unit = units if isinstance(units, int) else -1
        self.units: np.ndarray | None = None if isinstance(units, int) else units
        self.free = None if self.units is None else np.ones(indices.size, dtype=bool)

    def take(self, n: int) -> tuple[np.ndarray, int] | None:
        """``n`` indices on one unit (that of the oldest left), or None if there are not."""
        units, free, first = self.units, self.free, self.first
        if units is None or free is None:  # one unit: the next n in order
            if first + n > self.indices.size:
                return None
            self.first = first + n
            return self.indices[first : first + n], self.unit
        while first < free.size and not free[first]:
            first += 1
        self.first = first
        if first == free.size:
            return None
        if n == 1:  # the usual case: a single-sample put, the oldest index left
            free[first] = False
            return self.indices[first : first + 1], int(units[first])
        pos = first + np.flatnonzero(free[first:])
        pos = pos[units[pos] == units[first]][:n]
        if pos.size < n:
            return None
        free[pos] = False
        return self.indices[pos], int(units[first])

    def left(self) -> int:
        """How many indices are left."""
        if self.free is None:
            return int(self.indices.size - self.first)
        return int(self.free.sum())

    def extended(self, indices: np.ndarray, unit: int) -> Pool:
        """A pool of the indices left here, then ``indices`` on ``unit``, expiring when
        this one does (this one is empty afterwards)."""
        if self.units is None and self.unit == unit:
            return Pool(np.concatenate([self.rest(), indices]), unit, self.until)
        if self.units is None or self.free is None:
            units = np.full(self.left(), self.unit, dtype=np.int16)
        else:
            units = self.units[self.free]
        units = np.concatenate([units, np.full(indices.size, unit, dtype=np.int16)])
        return Pool(np.concatenate([self.rest(), indices]), units, self.until)

    def rest(self) -> np.ndarray:
        """Every index left (the pool is empty afterwards)."""
        if self.free is None:
            left = self.indices[self.first :]
            self.first = self.indices.size
            return left
        left = self.indices[self.free]
        self.free[:] = False
        return left


class Pools:
    """The pool of every thread of a client. A thread's pool is given back when the
    thread ends (its thread-local key is collected: the indices left wait in ``ended``
    for the next reserve of any thread to give them back) or when the client closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, Pool] = {}  # by thread key
        self._ended: list[np.ndarray] = []
        self._keys = itertools.count()

    def hold(self, local: threading.local, pool: Pool) -> None:
        """Make ``pool`` the current one of the thread whose ``local`` this is."""
        key: int | None = getattr(local, "pool_key", None)
        if key is None:
            key = local.pool_key = next(self._keys)
            on_thread_end(local, functools.partial(self._thread_ended, key))
        with self._lock:
            self._live[key] = pool

    def _thread_ended(self, key: int) -> None:
        with self._lock:
            pool = self._live.pop(key, None)
            if pool is not None:
                self._ended.append(pool.rest())

    def retire(self, pool: Pool) -> None:
        """A thread's pool that a newer one replaced: what it has left is given back with
        the next reserve (``take_ended``)."""
        left = pool.rest()
        if left.size:
            with self._lock:
                self._ended.append(left)

    def take_ended(self) -> list[np.ndarray]:
        """The indices left by threads that ended since the last call."""
        with self._lock:
            ended, self._ended = self._ended, []
        return [i for i in ended if i.size]

    def take_all(self) -> list[np.ndarray]:
        """Every index left, of every pool (the client closes)."""
        with self._lock:
            left = self._ended + [pool.rest() for pool in self._live.values()]
            self._ended, self._live = [], {}
        return [i for i in left if i.size]

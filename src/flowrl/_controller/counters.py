"""Counters: what a controller's event log adds up to, kept as it is written.

Per column, samples and bytes put; per task, samples claimed, acked, released and expired,
the seconds it had at least one lease open (the union of its leases: its busy time), and
the staleness of every acked sample (policy versions behind the newest, in the buckets of
``STALENESS_BUCKETS``). ``hub.statistics()`` returns them, with the readiness of the
newest live samples, so an exporter (the live page, ``/metrics``) polls one snapshot at its
own pace instead of following every event: watching a hub costs the hub a statistics
call per look, however fast the hub goes.

:class:`Counters` is a synchronous sink of the log (called as each event is appended,
under the controller's lock, never while a journal is replayed). It counts with a few
integer adds and C-speed sums per event, no Python step per sample; an ack's staleness
takes one table lookup and one step per distinct version among its samples (usually one).

Invariant (tests/unit/test_counters.py, over random operation sequences): the counters
equal a fold of the event log from the controller's start, and ``busy_s`` equals the
union of each task's lease intervals (claim to its last ack, release or expiry).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from flowrl._config import (
    STALENESS_BUCKETS,
    ColumnCounters,
    HubCounters,
    Readiness,
    TaskCounters,
)
from flowrl._controller.table import SampleTable
from flowrl.events import Acked, Claimed, Event, LeaseExpired, Put, Released, TaskUnregistered

__all__ = ["READINESS_SAMPLES", "Counters", "newest_readiness"]

READINESS_SAMPLES = 256  # the newest live samples ``HubStats.readiness`` shows


class Source(Protocol):
    """What the counters read of their controller: its table and newest version."""

    table: SampleTable
    version: int


class _Task:
    """One task's counts (the mutable form of ``TaskStats``'s counters)."""

    __slots__ = (
        "acked",
        "busy",
        "claimed",
        "expired",
        "lag_sum",
        "open",
        "released",
        "since",
        "staleness",
    )

    def __init__(self) -> None:
        self.claimed = self.acked = self.released = self.expired = 0
        self.open = 0  # leases open now
        self.since = 0.0  # when the task last went from no lease open to one
        self.busy = 0.0  # seconds with a lease open, up to ``since`` if one is open
        self.staleness = [0] * (len(STALENESS_BUCKETS) + 1)  # acked samples per bucket
        self.lag_sum = 0

    def opened(self, t: float) -> None:
        if not self.open:
            self.since = t
        self.open += 1

    def closed(self, t: float) -> None:
        self.open -= 1
        if not self.open:
            self.busy += max(0.0, t - self.since)

    def frozen(self) -> TaskCounters:
        return TaskCounters(
            claimed=self.claimed,
            acked=self.acked,
            released=self.released,
            expired=self.expired,
            busy_s=self.busy,
            busy_since=self.since if self.open else 0.0,
            staleness=tuple(self.staleness),
            staleness_sum=self.lag_sum,
        )


class _Lease:
    """An open lease: whose, and how many of its samples are not settled yet."""

    __slots__ = ("left", "task")

    def __init__(self, task: _Task, left: int) -> None:
        self.task, self.left = task, left


class Counters:
    """A sink of the controller's event log (``log.sinks``) counting what it says."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self.columns: dict[str, list[int]] = {}  # column -> [samples, bytes]
        self.tasks: dict[str, _Task] = {}
        self._leases: dict[int, _Lease] = {}  # the open ones
        self._handlers: dict[type, Callable[[Any], None]] = {
            Put: self._put,
            Claimed: self._claimed,
            Acked: self._acked,
            Released: self._released,
            LeaseExpired: self._expired,
            TaskUnregistered: self._forget,
        }

    def __call__(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def snapshot(self, tasks: Iterable[str]) -> HubCounters:
        """The counts of ``tasks`` (the registered ones) and of every column put, and the
        newest samples' readiness."""
        none = TaskCounters()
        return HubCounters(
            tasks={
                name: self.tasks[name].frozen() if name in self.tasks else none for name in tasks
            },
            columns={name: ColumnCounters(n, b) for name, (n, b) in self.columns.items()},
            readiness=newest_readiness(self._source.table),
        )

    def _task(self, name: str) -> _Task:
        counts = self.tasks.get(name)
        if counts is None:
            counts = self.tasks[name] = _Task()
        return counts

    def _forget(self, event: TaskUnregistered) -> None:
        self.tasks.pop(event.task, None)  # (it holds no lease: nothing of it is open)

    def _put(self, event: Put) -> None:
        n = len(event.indices)
        nbytes = event.nbytes
        for k, name in enumerate(event.columns):
            counts = self.columns.get(name)
            if counts is None:
                counts = self.columns[name] = [0, 0]
            counts[0] += n
            counts[1] += sum(nbytes[k * n : (k + 1) * n])

    def _claimed(self, event: Claimed) -> None:
        counts = self._task(event.task)
        n = len(event.indices)
        counts.claimed += n
        self._leases[event.lease] = _Lease(counts, n)
        counts.opened(event.t)

    def _acked(self, event: Acked) -> None:
        counts = self._task(event.task)
        counts.acked += len(event.indices)
        self._stale(counts, event.indices)
        self._settled(event.lease, len(event.indices), event.t)

    def _released(self, event: Released) -> None:
        self._task(event.task).released += len(event.indices)
        self._settled(event.lease, None, event.t)

    def _expired(self, event: LeaseExpired) -> None:
        self._task(event.task).expired += len(event.indices)
        self._settled(event.lease, None, event.t)

    def _settled(self, lease: int, n: int | None, t: float) -> None:
        """``n`` samples of ``lease`` settled (None: all it had left)."""
        held = self._leases.get(lease)
        if held is None:  # opened before this controller started (a journal's lease)
            return
        held.left -= held.left if n is None else n
        if held.left <= 0:
            del self._leases[lease]
            held.task.closed(t)

    def _stale(self, counts: _Task, indices: tuple[int, ...]) -> None:
        """Bucket the lag of the acked ``indices`` (still in the table at the ack)."""
        table, now = self._source.table, self._source.version
        n, cap = len(indices), table.capacity
        if not n:
            return
        lo = min(indices)
        start = lo % cap
        if max(indices) - lo == n - 1 and start + n <= cap:  # (distinct) a run of slots
            versions = table.version[start : start + n].tolist()
        else:
            slots = np.fromiter(indices, np.int64, n) % cap
            versions = table.version[slots].tolist()
        first = versions[0]
        if versions.count(first) == len(versions):  # the usual case: one version
            groups: Counter[int] | dict[int, int] = {first: len(versions)}
        else:
            groups = Counter(versions)
        staleness = counts.staleness
        for version, n in groups.items():
            lag = max(0, now - version)
            staleness[bisect_left(STALENESS_BUCKETS, lag)] += n
            counts.lag_sum += lag * n


def newest_readiness(table: SampleTable, most: int = READINESS_SAMPLES) -> Readiness:
    """Which columns the newest ``most`` committed live samples have ready.

    Indices grow, so the newest samples sit just below ``next_index``: look back over a
    window that doubles until it holds ``most`` of them or spans the table (the usual
    cost is a few hundred slots, not the table's capacity).
    """
    cap, end = table.capacity, table.next_index
    span = min(cap, end, 4 * most)
    while True:
        indices = np.arange(end - span, end, dtype=np.int64)
        slots = indices % cap
        live = (table.owner[slots] == indices) & table.committed[slots]
        if live.sum() >= most or span >= min(cap, end):
            break
        span = min(cap, end, 2 * span)
    slots = slots[live][-most:]
    return Readiness(
        indices=tuple(table.owner[slots].tolist()),
        ready={name: tuple(bits[slots].tolist()) for name, bits in table.ready.items()},
    )

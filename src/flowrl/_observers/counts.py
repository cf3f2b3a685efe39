"""EventCounts: what a hub's event stream adds up to, for the exporters that show it.

Samples put (and their bytes) per column; claimed, acked, released and expired per task;
seconds each task had a lease open (the union of its leases: its busy time); the
staleness of every acked sample (policy versions behind the newest, in buckets); and
which columns each live sample has ready. ``serve_metrics`` and the dashboard read it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from itertools import repeat
from typing import Any, Protocol

from flowrl._config import HubStats
from flowrl.errors import ConfigError
from flowrl.events import (
    Acked,
    Claimed,
    ColumnsDeclared,
    Event,
    Evicted,
    LeaseExpired,
    Put,
    Released,
    VersionPublished,
)
from flowrl.hooks import Observer

__all__ = ["STALENESS_BUCKETS", "EventCounts", "HubLike", "LoaderLike", "check_port"]

# policy versions behind the newest, at ack
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


class Subscription(Protocol):
    def cancel(self) -> None: ...


class HubLike(Protocol):
    """What the exporters need of a hub: an embedded ``Hub`` or a ``RemoteHub``."""

    def statistics(self) -> HubStats: ...
    def subscribe(
        self, observer: Callable[[Event], Any], *, strict: bool = False
    ) -> Subscription: ...


class LoaderLike(Protocol):
    """What the exporters read of a ``Loader``."""

    task: str

    def statistics(self) -> Any: ...


class EventCounts(Observer):
    """What the event stream adds up to, per task and column; read it under ``lock``."""

    def __init__(self, *, readiness: bool = False) -> None:
        self.lock = threading.Lock()
        self.columns: list[str] = []  # in the order they were declared (or first put)
        # live sample -> its ready columns; kept only when asked
        self.ready: dict[int, frozenset[str]] | None = {} if readiness else None
        self.version = 0  # the newest published
        self.put: dict[str, int] = {}
        self.put_bytes: dict[str, int] = {}
        self.claimed: dict[str, int] = {}
        self.settled: dict[tuple[str, str], int] = {}  # (task, acked|released|expired)
        self.staleness: dict[str, list[int]] = {}  # task -> per-bucket counts (+inf last)
        self.staleness_sum: dict[str, int] = {}
        self._versions: dict[int, int] = {}  # live sample -> its policy version
        self._open: dict[str, int] = {}  # leases open per task
        self._busy: dict[str, float] = {}
        self._since: dict[str, float] = {}
        self._leases: dict[int, str] = {}

    def __call__(self, event: Event) -> None:
        with self.lock:
            super().__call__(event)

    def on_columns(self, event: ColumnsDeclared) -> None:
        self.columns += [c.name for c in event.columns if c.name not in self.columns]

    def on_put(self, event: Put) -> None:
        n = len(event.indices)
        self.columns += [c for c in event.columns if c not in self.columns]
        if self.ready is not None:
            columns = frozenset(event.columns)
            if event.new:  # the common case, at C speed: every sample has these columns
                self.ready.update(dict.fromkeys(event.indices, columns))
            else:
                ready, none = self.ready, frozenset[str]()
                self.ready.update({i: ready.get(i, none) | columns for i in event.indices})
        for k, column in enumerate(event.columns):
            self.put[column] = self.put.get(column, 0) + n
            nbytes = sum(event.nbytes[k * n : (k + 1) * n])
            self.put_bytes[column] = self.put_bytes.get(column, 0) + nbytes
        if event.versions:
            self._versions.update(zip(event.indices, event.versions, strict=True))
        elif event.version >= 0:
            self._versions.update(dict.fromkeys(event.indices, event.version))

    def on_claim(self, event: Claimed) -> None:
        self.claimed[event.task] = self.claimed.get(event.task, 0) + len(event.indices)
        self._leases[event.lease] = event.task
        self._lease_opens(event.task, event.t, +1)

    def on_ack(self, event: Acked) -> None:
        self._settle(event.task, "acked", event)
        buckets = self.staleness.setdefault(event.task, [0] * (len(STALENESS_BUCKETS) + 1))
        now = self.version
        # a batch's samples share a few versions: count them at C speed, bucket the few
        versions = Counter(map(self._versions.get, event.indices, repeat(now)))
        total = self.staleness_sum.get(event.task, 0)
        for version, count in versions.items():
            lag = max(0, now - version)
            buckets[_bucket(lag)] += count
            total += lag * count
        self.staleness_sum[event.task] = total

    def on_release(self, event: Released) -> None:
        self._settle(event.task, "released", event)

    def on_lease_expired(self, event: LeaseExpired) -> None:
        self._settle(event.task, "expired", event)

    def on_evict(self, event: Evicted) -> None:
        deque(map(self._versions.pop, event.indices, repeat(None)), maxlen=0)  # C-speed loop
        if self.ready is not None:
            deque(map(self.ready.pop, event.indices, repeat(None)), maxlen=0)

    def on_version(self, event: VersionPublished) -> None:
        self.version = max(self.version, event.version)

    def busy_seconds(self, now: float) -> dict[str, float]:
        """Per task, seconds with at least one lease open, up to ``now``."""
        busy = dict(self._busy)
        for task, opened in self._open.items():
            if opened:
                busy[task] = busy.get(task, 0.0) + max(0.0, now - self._since[task])
        return busy

    def _settle(self, task: str, how: str, event: Acked | Released | LeaseExpired) -> None:
        key = (task, how)
        self.settled[key] = self.settled.get(key, 0) + len(event.indices)
        if self._leases.pop(event.lease, None) is not None:
            self._lease_opens(task, event.t, -1)

    def _lease_opens(self, task: str, t: float, delta: int) -> None:
        opened = self._open.get(task, 0)
        if opened:  # the task was busy up to now
            self._busy[task] = self._busy.get(task, 0.0) + max(0.0, t - self._since[task])
        self._open[task] = opened + delta
        self._since[task] = t


def _bucket(lag: int) -> int:
    for k, bound in enumerate(STALENESS_BUCKETS):
        if lag <= bound:
            return k
    return len(STALENESS_BUCKETS)


def check_port(port: Any, where: str) -> int:
    """A TCP port to listen on (0: any free one), or a ConfigError naming ``where``."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}(port={port!r}): expected an int in [0, 65535]")
    return port

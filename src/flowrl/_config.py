"""Typed configuration and statistics records of the hub."""

from __future__ import annotations

from typing import Literal, final

import msgspec

from flowrl._validate import int_in
from flowrl.errors import ConfigError

__all__ = [
    "STALENESS_BUCKETS",
    "ColumnCounters",
    "HubConfig",
    "HubCounters",
    "HubStats",
    "JournalConfig",
    "Readiness",
    "TaskCounters",
    "TaskStats",
    "UnitStats",
]

#: Upper bounds of the staleness histogram's buckets: policy versions an acked sample was
#: behind the newest (``TaskCounters.staleness`` has one more bucket, for beyond the last).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


@final
class JournalConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Durability: the controller's event journal and the storage units' data on disk.

    ``path``: a directory (created if missing). A hub started on a directory that already
    holds a journal recovers the exact state it describes: samples, readiness, leases and
    what each task consumed.
    ``sync``: ``"write"`` (default) hands every event to the operating system before the
    call that caused it returns, so any process crash loses nothing, and fsyncs every
    ``fsync_interval`` seconds (a power loss loses at most that much); ``"fsync"`` fsyncs
    every event (survives power loss, much slower).
    ``persist_data``: storage units also append their Arrow chunks to Arrow IPC files under
    ``path``, so sample bytes survive a restart too (without it only metadata does).
    ``compact_bytes``: once the event log holds this many bytes (and an eighth of the last
    snapshot's), the controller's state is written as a snapshot and the log starts
    afresh: recovery time and disk use follow the live state, not the run's length. The
    default, 256 KiB, keeps a restart under a second (replay runs at about 1 MiB/s).
    """

    path: str
    sync: Literal["write", "fsync"] = "write"
    fsync_interval: float = 1.0
    persist_data: bool = True
    compact_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"JournalConfig.path must be a non-empty str, got {self.path!r}")
        if self.sync not in ("write", "fsync"):
            raise ConfigError(f"JournalConfig.sync must be 'write' or 'fsync', got {self.sync!r}")
        if (
            isinstance(self.fsync_interval, bool)
            or not isinstance(self.fsync_interval, int | float)
            or not self.fsync_interval > 0
        ):
            raise ConfigError(
                "JournalConfig.fsync_interval must be a positive number of seconds, got "
                f"{self.fsync_interval!r}"
            )
        if not isinstance(self.persist_data, bool):
            raise ConfigError(
                f"JournalConfig.persist_data must be a bool, got {self.persist_data!r}"
            )
        if (
            isinstance(self.compact_bytes, bool)
            or not isinstance(self.compact_bytes, int)
            or self.compact_bytes < 1
        ):
            raise ConfigError(
                "JournalConfig.compact_bytes must be a positive int (bytes of event log "
                f"between snapshots), got {self.compact_bytes!r}"
            )


@final
class HubConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How big the hub is and how long leases last. Validated at construction.

    ``capacity``: live samples at most (puts block, or ``put_nowait`` raises, beyond it).
    ``n_units``: storage units samples are sharded across.
    ``lease_timeout``: seconds a claim may stay un-acked before its samples return.
    ``infer_columns``: declare unknown columns from their first write (default: only when
    the hub was created without declared columns).
    ``journal``: make the hub durable and recoverable (see :class:`JournalConfig`).
    """

    capacity: int = 65536
    n_units: int = 1
    lease_timeout: float = 300.0
    infer_columns: bool | None = None
    journal: JournalConfig | None = None

    def __post_init__(self) -> None:
        # numpy integers (from arrays, configs) are taken and stored as ints
        capacity = int_in(self.capacity, 1, "HubConfig.capacity must be a positive int")
        msgspec.structs.force_setattr(self, "capacity", capacity)
        n_units = int_in(
            self.n_units, 1, "HubConfig.n_units must be an int in [1, 1024]", high=1024
        )
        msgspec.structs.force_setattr(self, "n_units", n_units)
        if (
            isinstance(self.lease_timeout, bool)
            or not isinstance(self.lease_timeout, int | float)
            or not self.lease_timeout > 0
        ):
            raise ConfigError(
                f"HubConfig.lease_timeout must be a positive number of seconds, got "
                f"{self.lease_timeout!r}"
            )
        if self.infer_columns is not None and not isinstance(self.infer_columns, bool):
            raise ConfigError(
                f"HubConfig.infer_columns must be True, False or None, got {self.infer_columns!r}"
            )
        if self.journal is not None and not isinstance(self.journal, JournalConfig):
            raise ConfigError(
                f"HubConfig.journal must be a JournalConfig or None, got {self.journal!r}"
            )


class TaskStats(msgspec.Struct, frozen=True):
    ready: int
    leased: int
    consumed: int
    partition: str | None = None  # the one partition the task reads (None: every one)


class TaskCounters(msgspec.Struct, frozen=True, kw_only=True):
    """What one task did since the controller started: samples ``claimed``, ``acked``,
    ``released`` and whose lease ``expired``; ``busy_s``, seconds it had at least one
    lease open, up to ``busy_since`` when one is open now (else 0; :meth:`busy_until`
    adds the open stretch); ``staleness``, acked samples per bucket of
    :data:`STALENESS_BUCKETS` (policy versions behind the newest at the ack; the last
    bucket: beyond them), and ``staleness_sum``, those lags added up."""

    claimed: int = 0
    acked: int = 0
    released: int = 0
    expired: int = 0
    busy_s: float = 0.0
    busy_since: float = 0.0
    staleness: tuple[int, ...] = (0,) * (len(STALENESS_BUCKETS) + 1)
    staleness_sum: int = 0

    def busy_until(self, now: float) -> float:
        """Seconds with a lease open up to ``now`` (``time.time()``)."""
        return self.busy_s + (max(0.0, now - self.busy_since) if self.busy_since else 0.0)


class ColumnCounters(msgspec.Struct, frozen=True):
    """Samples and bytes put to one column since the controller started."""

    samples: int
    nbytes: int


class Readiness(msgspec.Struct, frozen=True):
    """The newest live samples (``indices``, oldest first) and, per column, which of
    them have it ready: the live page's heat strip."""

    indices: tuple[int, ...] = ()
    ready: dict[str, tuple[bool, ...]] = msgspec.field(default_factory=dict)


class HubCounters(msgspec.Struct, frozen=True):
    """What the controller's event log adds up to (``HubStats.counters``): per task and
    per column since the controller started, and the newest samples' readiness."""

    tasks: dict[str, TaskCounters] = msgspec.field(default_factory=dict)
    columns: dict[str, ColumnCounters] = msgspec.field(default_factory=dict)
    readiness: Readiness = msgspec.field(default_factory=Readiness)


class UnitStats(msgspec.Struct, frozen=True):
    unit: int
    samples: int
    chunks: int
    nbytes: int
    # peers without the hub's key that the unit's TCP sockets refused (docs/durability.md)
    refused_peers: int = 0


@final
class HubStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the hub's counters (``hub.statistics()``)."""

    capacity: int
    live: int  # samples put or being put
    reserved: int  # of those, being put (reserved, not committed yet)
    tasks: dict[str, TaskStats]
    leases: int
    version: int
    ended: bool
    events: int
    units: list[UnitStats]
    # indices reserved by remote producers for their next small puts: they hold capacity
    # but are in neither ``live`` nor ``reserved``
    reserved_ahead: int = 0
    # re-sent idempotent puts (a producer's seq the hub held) dropped since the controller
    # started
    duplicate_puts: int = 0
    # peers without the hub's key that the controller's TCP sockets refused (each unit
    # counts its own in ``units``)
    refused_peers: int = 0
    counters: HubCounters = msgspec.field(default_factory=HubCounters)
    # samples put (committed) and not evicted, per partition that holds any
    partitions: dict[str, int] = msgspec.field(default_factory=dict)

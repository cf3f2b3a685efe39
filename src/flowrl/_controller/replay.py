"""Journal replay: rebuild, on a fresh controller, the state its events describe.

Each event is applied through the same code that made it, with emission switched off
(``replaying``); ``Evicted`` events are the consequence of the ``Acked`` before them and
are applied by it. Lease deadlines are wall-clock times, so recovered leases expire on
schedule. Balanced rounds are rebuilt at the end from their parts' ``Claimed`` events,
keeping those with a part still waiting for its rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np

from flowrl._controller.eventlog import EventLog
from flowrl._controller.leases import Lease, Leases
from flowrl._controller.rounds import Rounds
from flowrl._controller.table import SampleTable
from flowrl._controller.tasks import TaskState
from flowrl._protocol.commands import Cell, Commit
from flowrl._schema.columns import Column
from flowrl.events import (
    Acked,
    Claimed,
    ColumnsDeclared,
    Event,
    IndexWatermark,
    LeaseExpired,
    LeaseTaken,
    Put,
    Released,
    StreamEnded,
    TaskRegistered,
    TaskUnregistered,
    VersionPublished,
)

__all__ = ["Replayable", "recover"]


class Replayable(Protocol):
    """What replay needs of a controller (``flowrl._controller.controller.Controller``)."""

    table: SampleTable
    log: EventLog
    leases: Leases
    rounds: Rounds
    cond: threading.Condition
    on_evict: Callable[[np.ndarray, np.ndarray], None] | None
    version: int
    watermark: int
    replaying: bool

    def task(self, name: str) -> TaskState: ...

    def place(self, indices: np.ndarray, unit: int) -> None: ...

    def commit(self, cmd: Commit) -> None: ...

    def ack(
        self, task: str, lease_id: int, indices: np.ndarray | None = None, *, drop: bool = False
    ) -> np.ndarray: ...

    def release(self, task: str, lease_id: int) -> None: ...

    def expire_lease(self, lease: Lease) -> None: ...

    def end_stream(self, columns: tuple[str, ...] = ()) -> None: ...

    def register_task(
        self, task: str, columns: tuple[str, ...], partition: str | None = None
    ) -> None: ...

    def unregister_task(self, task: str) -> np.ndarray: ...

    def add_columns(self, columns: tuple[Column, ...]) -> None: ...


def recover(ctl: Replayable, events: Iterable[Event]) -> int:
    """Apply ``events`` (a journal's, in order) to ``ctl``; returns how many were applied."""
    rounds: dict[int, list[Lease]] = {}  # round id -> its parts
    on_evict, ctl.on_evict = ctl.on_evict, None
    count = 0
    ctl.replaying = True
    try:
        with ctl.cond:
            for event in events:
                _apply(ctl, event, rounds)
                ctl.log.seq = event.seq
                count += 1
    finally:
        ctl.replaying = False
        ctl.on_evict = on_evict
    ctl.table.next_index = max(ctl.table.next_index, ctl.watermark)
    for parts in rounds.values():
        if any(not p.taken and p.id in ctl.leases.live for p in parts):
            ctl.rounds.add(parts[0].task, parts, max(p.dp_rank for p in parts) + 1)
    return count


def _apply(ctl: Replayable, event: Event, rounds: dict[int, list[Lease]]) -> None:
    if isinstance(event, Put):
        _apply_put(ctl, event)
    elif isinstance(event, Claimed):
        state = ctl.task(event.task)
        idx = np.array(event.indices, dtype=np.int64)
        queued = state.queue.view()
        state.queue.replace(queued[~np.isin(queued, idx)])
        ctl.leases.next_id = event.lease
        lease = ctl.leases.open(
            state,
            idx,
            event.deadline,
            event.consumer,
            dp_rank=event.dp_rank,
            round_id=event.round,
            reserved=event.reserved,
        )
        if event.round:
            rounds.setdefault(event.round, []).append(lease)
    elif isinstance(event, LeaseTaken):
        ctl.leases.take(ctl.leases.live[event.lease], event.deadline)
    elif isinstance(event, Acked):
        idx = np.array(event.indices, dtype=np.int64)
        ctl.ack(event.task, event.lease, idx, drop=event.dropped)
    elif isinstance(event, Released):
        ctl.release(event.task, event.lease)
    elif isinstance(event, LeaseExpired):
        ctl.expire_lease(ctl.leases.live[event.lease])
    elif isinstance(event, VersionPublished):
        ctl.version = event.version
    elif isinstance(event, StreamEnded):
        ctl.end_stream(event.columns)
    elif isinstance(event, TaskRegistered):
        ctl.register_task(event.task, event.columns, event.partition)
    elif isinstance(event, TaskUnregistered):
        ctl.unregister_task(event.task)
    elif isinstance(event, ColumnsDeclared):
        ctl.add_columns(event.columns)
    elif isinstance(event, IndexWatermark):
        ctl.watermark = event.next


def _apply_put(ctl: Replayable, event: Put) -> None:
    idx = np.array(event.indices, dtype=np.int64)
    if event.new:
        ctl.place(idx, event.unit)
    shape = (len(event.columns), idx.size)
    nbytes = np.array(event.nbytes or np.zeros(shape), dtype=np.int64).reshape(shape)
    ctl.commit(
        Commit(
            indices=idx,
            cells={c: Cell(nbytes[i]) for i, c in enumerate(event.columns)},
            new=event.new,
            partition=event.partition,
            groups=np.array(event.groups, dtype=np.int64) if event.groups else None,
            version=None if event.versions or event.version < 0 else event.version,
            versions=np.array(event.versions, dtype=np.int64) if event.versions else None,
            tokens=np.array(event.tokens, dtype=np.int64),
            producer=event.producer,
            seq=None if event.producer_seq < 0 else event.producer_seq,
        )
    )

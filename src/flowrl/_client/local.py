"""The in-process ports: the controller and storage units in this process, no copies.

Every controller call runs under one condition variable's lock; blocked claims and puts
wait on it (releasing the lock), and every state change notifies them, so readiness is
pushed to waiters rather than polled. Storage units have their own locks: payload bytes
move outside the controller's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import final

import numpy as np
import pyarrow as pa

from flowrl._client.future import PutFuture
from flowrl._client.ports import ControlPort, DataPort, Reservation
from flowrl._config import HubStats, UnitStats
from flowrl._controller.controller import Controller
from flowrl._controller.eventlog import EventLog
from flowrl._controller.journal import Journal
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import Sampler
from flowrl._protocol.commands import (
    Ack,
    CheckUpdate,
    Claim,
    Commit,
    EndStream,
    MetaOf,
    PublishVersion,
    RegisterTask,
    Release,
    UnregisterTask,
)
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded
from flowrl._schema.schema import Schema
from flowrl._store.unit import StorageUnit
from flowrl.errors import HubClosed, HubFull, NothingReady, Timeout

__all__ = ["LocalControl", "LocalData"]


@final
class LocalControl(ControlPort):
    """Commands run on the controller of this process, under its lock."""

    def __init__(
        self,
        controller: Controller,
        schema: Schema,
        units: Sequence[StorageUnit],
        journal: Journal | None,
    ) -> None:
        self.controller = controller
        self.schema = schema
        self.units = units  # (a commit settles what a put to existing samples staged)
        self.journal = journal

    def check_open(self) -> None:
        """Every call on a closed hub raises (its journal and units' files are closed)."""
        if self.controller.closed:
            raise HubClosed(
                "this hub was closed; calls on it are refused (open a new Hub on the same "
                "config to go on from its journal)"
            )

    def _begin(self) -> None:
        """Start a call, under the controller's lock: refuse a closed hub; compact the
        journal when due (here, between two operations, the state is whole)."""
        self.check_open()
        if self.journal is not None and self.journal.compaction_due:
            self.journal.compact(self.controller)

    def declare(self, columns: tuple[Column, ...]) -> None:
        with self.controller.cond:
            self._begin()
            self.schema.declare(*columns)
            self.controller.add_columns(columns)

    def register_task(self, cmd: RegisterTask) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.register_task(cmd.task, cmd.columns, cmd.partition)

    def unregister_task(self, cmd: UnregisterTask) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.unregister_task(cmd.task)

    def reserve(self, n: int, timeout: float | None, streaming: bool = False) -> Reservation:
        ctl = self.controller
        if n > ctl.table.capacity:
            raise HubFull(
                f"put() of {n} samples can never fit a hub of capacity {ctl.table.capacity}; "
                "split it or raise HubConfig.capacity"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with ctl.cond:
            self._begin()
            while True:
                if ctl.table.free_slots() >= n or timeout == 0 or ctl.closed or ctl.ended:
                    return Reservation(*ctl.reserve(n))  # raises HubFull/HubClosed/EndOfStream
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Timeout(
                        f"put() waited {timeout}s for room for {n} samples; the hub is full "
                        f"({ctl.table.live}/{ctl.table.capacity} live) — are consumers acking?"
                    )
                ctl.cond.wait(_wait_time(remaining, ctl.next_deadline()))
                ctl.expire()

    def abort(self, indices: np.ndarray) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.abort(indices)

    def check_update(self, cmd: CheckUpdate) -> np.ndarray:
        with self.controller.cond:
            self._begin()
            return self.controller.check_update(cmd.indices, cmd.columns, cmd.ack)

    def commit(self, cmd: Commit) -> None:
        put_id = cmd.put_id
        with self.controller.cond:
            self._begin()
            try:
                self.controller.commit(cmd)
            except BaseException:
                if put_id:
                    for unit in self.units:
                        unit.settle(put_id, False)
                raise
            if put_id:  # under the controller's lock: no claim sees the commit before
                for unit in self.units:  # the bytes it made ready are readable
                    unit.settle(put_id, True)

    def claim(self, cmd: Claim, sampler: Sampler) -> list[BatchMeta]:
        ctl = self.controller
        timeout = cmd.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with ctl.cond:
            self._begin()
            while True:
                metas = ctl.try_claim_batches(cmd, sampler)
                if metas is not None:
                    return metas
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if timeout == 0:
                        raise NothingReady(f"no {cmd.n} samples are ready for task {cmd.task!r}")
                    raise Timeout(
                        f"claim() by task {cmd.task!r} found no {cmd.n} ready samples in {timeout}s"
                    )
                # woken only by changes that may serve this task (or at the next deadline)
                ctl.claim_cond(cmd.task).wait(_wait_time(remaining, ctl.next_deadline()))

    def meta(self, cmd: MetaOf) -> BatchMeta:
        with self.controller.cond:
            self._begin()
            return self.controller.meta(cmd.indices, cmd.columns)

    def ack(self, cmd: Ack) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.ack(cmd.task, cmd.lease, cmd.indices, drop=cmd.drop)

    def release(self, cmd: Release) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.release(cmd.task, cmd.lease)

    def publish_version(self, cmd: PublishVersion) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.publish_version(cmd.version)

    def version(self) -> int:
        self.check_open()
        return self.controller.version

    def end_stream(self, cmd: EndStream) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.end_stream(cmd.columns)

    def events(self) -> EventLog:
        self.check_open()
        return self.controller.log

    def flush_events(self, timeout: float | None) -> bool:
        self.check_open()
        return self.controller.log.flush(timeout)

    def raise_policy_error(self) -> None:
        self.controller.log.check()

    def statistics(self) -> HubStats:
        with self.controller.cond:
            self._begin()
            return self.controller.statistics()

    def close(self) -> None:
        with self.controller.cond:
            if self.controller.closed:
                return
            self.controller.close()
        self.controller.log.close()
        if self.journal is not None:
            self.journal.close()


@final
class LocalData(DataPort):
    """Bytes go to and from the storage units of this process, without copies."""

    def __init__(
        self,
        units: Sequence[StorageUnit],
        check_open: Callable[[], None],
        commit: Callable[[Commit], None],
    ) -> None:
        self.units = units
        self.n_units = len(units)
        self._check_open = check_open
        self._commit = commit

    def write(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        put_id: int = 0,
    ) -> None:
        self._check_open()
        arrays = {k: e.array for k, e in encoded.items()}
        if put_id:
            self.units[unit].stage(put_id, indices, arrays, types)
        else:
            self.units[unit].write(indices, arrays, types)

    def write_commit(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        commit: Commit,
        wait: bool,
        again: Callable[[dict[str, Encoded]], np.ndarray] | None,
    ) -> PutFuture | None:
        self.write(unit, indices, encoded, types, commit.put_id)
        self._commit(commit)
        return None

    def forget_staged(self, put_id: int, units: Iterable[int]) -> None:
        if put_id:
            for unit in units:
                self.units[unit].settle(put_id, False)

    def discard(self, unit: int, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        self.units[unit].discard(indices, columns)

    def read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> list[dict[str, pa.Array]]:
        self._check_open()
        return [self.units[unit].read(idx, columns) for unit, idx in parts]

    def append(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]:
        self._check_open()
        return self.units[unit].append(indices, values, version)

    def read_partial(
        self, unit: int, indices: np.ndarray, column: Column
    ) -> tuple[pa.Array, pa.Array]:
        self._check_open()
        return self.units[unit].read_partial(indices, column)

    def statistics(self) -> list[UnitStats]:
        return [u.statistics() for u in self.units]

    def close(self) -> None:
        for unit in self.units:
            unit.close()


def _wait_time(remaining: float | None, lease_deadline: float | None) -> float | None:
    """Sleep until the caller's deadline or the next lease expiry, whichever is first."""
    waits = [w for w in (remaining,) if w is not None]
    if lease_deadline is not None:
        waits.append(max(lease_deadline - time.time(), 0.0) + 1e-3)
    # Condition.wait refuses longer waits (inf included); the caller's loop waits again.
    return min(*waits, threading.TIMEOUT_MAX) if waits else None

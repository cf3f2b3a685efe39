"""The embedded hub: controller and storage units in this process, no servers, no copies.

Every controller call runs under one condition variable's lock; blocked claims and puts
wait on it (releasing the lock), and every state change notifies them, so readiness is
pushed to waiters rather than polled. Storage units have their own locks: payload bytes
move outside the controller's lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import final

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._client.base import HubClient, _split_by_unit
from flowrl._client.config import HubConfig, HubStats
from flowrl._controller.controller import Controller
from flowrl._controller.eventlog import EventLog
from flowrl._controller.journal import attach_journal, lock_journal
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import Sampler
from flowrl._protocol.commands import Claim, Commit, LeaseRef
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded
from flowrl._schema.schema import Schema
from flowrl._store.unit import StorageUnit
from flowrl.errors import ConfigError, HubClosed, HubFull, NothingReady, Timeout

__all__ = ["Hub"]


@final
class Hub(HubClient):
    """The in-process data hub (the default placement).

    >>> hub = Hub(columns=[Column.ragged("ids", "int64"), Column.scalar("reward", "float32")])
    >>> hub.register_task("train", ["ids", "reward"])
    """

    def __init__(
        self,
        columns: Iterable[Column] = (),
        *,
        tasks: Mapping[str, Sequence[str]] | None = None,
        config: HubConfig | None = None,
    ) -> None:
        config = config or HubConfig()
        if not isinstance(config, HubConfig):
            raise ConfigError(f"config must be a HubConfig, got {type(config).__name__}")
        columns = tuple(columns)
        infer = config.infer_columns if config.infer_columns is not None else not columns
        self.config = config
        self.schema = Schema(columns, infer=infer)
        self.controller = Controller(config.capacity, config.n_units, config.lease_timeout)
        # The journal folder is taken before anything in it (the units' files) is read.
        lock = None if config.journal is None else lock_journal(config.journal)
        try:
            self.units = [
                StorageUnit.open(u, config.capacity, config.journal) for u in range(config.n_units)
            ]
            self._journal = None if lock is None else attach_journal(self.controller, config, lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self.schema.declare(*self.controller.declared.values())
        if self._journal is not None:
            live = self.controller.live_indices()
            for unit in self.units:
                unit.retain(live, self.controller.table.next_index)
            # The holders of recovered leases died with the process that embedded the hub.
            with self.controller.cond:
                self.controller.expire(now=math.inf)
        self.controller.on_evict = self._evict
        self.controller.add_columns(self.schema.columns())
        for task, cols in (tasks or {}).items():
            self.register_task(task, cols)

    # -- primitives -------------------------------------------------------------------------
    def _declare_columns(self, columns: tuple[Column, ...]) -> None:
        with self.controller.cond:
            self._begin()
            self.schema.declare(*columns)
            self.controller.add_columns(columns)

    def _register_task(self, task: str, columns: tuple[str, ...]) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.register_task(task, columns)

    def _reserve(self, n: int, timeout: float | None) -> tuple[np.ndarray, int]:
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
                    return ctl.reserve(n)  # raises HubFull / HubClosed / EndOfStream
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise Timeout(
                        f"put() waited {timeout}s for room for {n} samples; the hub is full "
                        f"({ctl.table.live}/{ctl.table.capacity} live) — are consumers acking?"
                    )
                ctl.cond.wait(_wait_time(remaining, ctl.next_deadline()))
                ctl.expire()

    def _abort(self, indices: np.ndarray) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.abort(indices)

    def _check_update(
        self, indices: np.ndarray, columns: tuple[str, ...], ack: LeaseRef | None
    ) -> np.ndarray:
        with self.controller.cond:
            self._begin()
            return self.controller.check_update(indices, columns, ack)

    def _write(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: dict[str, Column],
        put_id: int = 0,
    ) -> None:
        self._check_open()
        arrays = {k: e.array for k, e in encoded.items()}
        if put_id:
            self.units[unit].stage(put_id, indices, arrays, types)
        else:
            self.units[unit].write(indices, arrays, types)

    def _discard(self, unit: int, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        self.units[unit].discard(indices, columns)

    def _commit(self, cmd: Commit) -> None:
        put_id = cmd.put_id
        with self.controller.cond:
            self._begin()
            try:
                self.controller.commit(cmd)
            except BaseException:
                self._forget_staged(put_id, range(len(self.units)))
                raise
            if put_id:  # under the controller's lock: no claim sees the commit before
                for unit in self.units:  # the bytes it made ready are readable
                    unit.settle(put_id, True)

    def _forget_staged(self, put_id: int, units: Iterable[int]) -> None:
        if put_id:
            for unit in units:
                self.units[unit].settle(put_id, False)

    def _claim(self, cmd: Claim, sampler: Sampler) -> BatchMeta:
        ctl = self.controller
        timeout = cmd.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with ctl.cond:
            self._begin()
            while True:
                meta = ctl.try_claim(cmd, sampler)
                if meta is not None:
                    return meta
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if timeout == 0:
                        raise NothingReady(f"no {cmd.n} samples are ready for task {cmd.task!r}")
                    raise Timeout(
                        f"claim() by task {cmd.task!r} found no {cmd.n} ready samples in {timeout}s"
                    )
                # woken only by changes that may serve this task (or at the next deadline)
                ctl.claim_cond(cmd.task).wait(_wait_time(remaining, ctl.next_deadline()))

    def _read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> list[dict[str, pa.Array]]:
        self._check_open()
        return [self.units[unit].read(idx, columns) for unit, idx in parts]

    def _meta(self, indices: np.ndarray, columns: tuple[str, ...]) -> BatchMeta:
        with self.controller.cond:
            self._begin()
            return self.controller.meta(indices, columns)

    def _append(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]:
        self._check_open()
        return self.units[unit].append(indices, values, version)

    def _read_partial(
        self, unit: int, indices: np.ndarray, column: Column
    ) -> tuple[pa.Array, pa.Array]:
        self._check_open()
        return self.units[unit].read_partial(indices, column)

    def _ack(self, task: str, lease: int, indices: np.ndarray | None, drop: bool) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.ack(task, lease, indices, drop=drop)

    def _release(self, task: str, lease: int) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.release(task, lease)

    def _evict(self, indices: np.ndarray, units: np.ndarray) -> None:
        for unit, pos in _split_by_unit(units):
            self.units[unit].evict(indices if pos is None else indices[pos])

    def _raise_policy_error(self) -> None:
        self.controller.log.check()

    def _begin(self) -> None:
        """Start a call, under the controller's lock: refuse a closed hub; compact the
        journal when due (here, between two operations, the state is whole)."""
        self._check_open()
        if self._journal is not None and self._journal.compaction_due:
            self._journal.compact(self.controller)

    def _check_open(self) -> None:
        """Every call on a closed hub raises (its journal and units' files are closed)."""
        if self.controller.closed:
            raise HubClosed(
                "this hub was closed; calls on it are refused (open a new Hub on the same "
                "config to go on from its journal)"
            )

    # -- the rest of the API ----------------------------------------------------------------
    def _publish_version(self, version: int) -> None:
        with self.controller.cond:
            self._begin()
            self.controller.publish_version(version)

    @property
    def version(self) -> int:
        self._check_open()
        return self.controller.version

    def end_stream(self, columns: Sequence[str] = ()) -> None:
        cols = self.schema.check_names(columns, "end_stream()")
        with self.controller.cond:
            self._begin()
            self.controller.end_stream(cols)

    def _event_log(self) -> EventLog:
        self._check_open()
        return self.controller.log

    def flush_events(self, timeout: float | None = 5.0) -> bool:
        """Wait until subscribers have received every event so far."""
        self._check_open()
        return self.controller.log.flush(timeout)

    def statistics(self) -> HubStats:
        with self.controller.cond:
            self._begin()
            stats = self.controller.statistics()
        return msgspec.structs.replace(stats, units=[u.statistics() for u in self.units])

    def close(self) -> None:
        with self.controller.cond:
            if self.controller.closed:
                return
            self.controller.close()
        self.controller.log.close()
        if self._journal is not None:
            self._journal.close()
        for unit in self.units:
            unit.close()

    def _abandon(self) -> None:
        """Let go of the hub as its process would by dying (``flowrl.testing.abandon``)."""
        with self.controller.cond:
            self.controller.close()
        if self._journal is not None:
            self._journal.abandon()
        for unit in self.units:
            unit.abandon()


def _wait_time(remaining: float | None, lease_deadline: float | None) -> float | None:
    """Sleep until the caller's deadline or the next lease expiry, whichever is first."""
    waits = [w for w in (remaining,) if w is not None]
    if lease_deadline is not None:
        waits.append(max(lease_deadline - time.time(), 0.0) + 1e-3)
    # Condition.wait refuses longer waits (inf included); the caller's loop waits again.
    return min(*waits, threading.TIMEOUT_MAX) if waits else None

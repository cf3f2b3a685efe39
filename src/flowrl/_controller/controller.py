"""The control plane's table core: allocation, readiness, claims, acks, eviction, events.

The controller never sees payload bytes, only per-cell sizes and token counts. It is not
thread-safe by itself: the in-process hub calls it under ``Controller.cond``'s lock and the
zmq server calls it from its single event-loop thread. It composes one object per concern,
each in its own module, none of which imports this one:

* ``leases`` (``Leases``): live leases, their deadlines, release and expiry;
* ``rounds`` (``Rounds``): balanced data-parallel batches whose parts wait for their rank;
* ``reservations`` (``Reservations``): indices reserved for puts not committed yet;
* ``producers`` (``Producers``): each producer's recent puts, for idempotent puts;
* ``counters`` (``Counters``): what the event log adds up to, for ``statistics()``;
* ``waiters`` (``Waiters``): the lock, the conditions waiting calls sleep on, whom to wake;
* ``flowrl._controller.replay``: rebuilding the state from a journal (:meth:`recover`).

Invariants (tests/unit/test_table_properties.py drives random operation sequences):

* a task never receives a sample it has acked (exactly-once per task after ack);
* a sample is in at most one live lease per task;
* released or expired samples become claimable again, first in line;
* a sample is evicted only once every registered task acked it, and then exactly once (a
  task scoped to another partition counts as having acked it; a task unregistered no
  longer counts);
* every mutation appends exactly one event, with increasing ``seq``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from flowrl._config import HubStats, TaskStats
from flowrl._controller import replay
from flowrl._controller.counters import Counters
from flowrl._controller.eventlog import EventLog
from flowrl._controller.leases import Lease, Leases, check_ackable
from flowrl._controller.meta import BatchMeta
from flowrl._controller.producers import Producers
from flowrl._controller.reservations import RESERVATION_MIN_S, Reservations
from flowrl._controller.rounds import Rounds
from flowrl._controller.samplers import BalancedSampler, CandidateView, FifoSampler, Sampler
from flowrl._controller.table import SampleTable, all_set, any_set
from flowrl._controller.tasks import CONSUMED, LEASED, PENDING, READY, TaskState
from flowrl._controller.wake import Wake
from flowrl._controller.waking import Waiters
from flowrl._protocol.commands import Claim, Commit, LeaseRef
from flowrl._schema.columns import Column
from flowrl.errors import (
    ConfigError,
    EndOfStream,
    HubClosed,
    LeaseError,
    SchemaError,
    UnknownColumnError,
    UnknownTaskError,
)
from flowrl.events import (
    Acked,
    ColumnsDeclared,
    Event,
    Evicted,
    IndexWatermark,
    Put,
    StreamEnded,
    TaskRegistered,
    TaskUnregistered,
    VersionPublished,
)

__all__ = ["Controller"]

_CONSUMED_BYTE = bytes([CONSUMED])
_NO_POSITIONS = np.empty(0, dtype=np.int64)


class Controller:
    """One hub's metadata table and the commands that change it (see the module doc)."""

    def __init__(self, capacity: int, n_units: int = 1, lease_timeout: float = 60.0) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be a positive int, got {capacity!r}")
        if not isinstance(n_units, int) or n_units < 1:
            raise ConfigError(f"n_units must be a positive int, got {n_units!r}")
        self.table = SampleTable(capacity)
        self.n_units = n_units
        self.lease_timeout = lease_timeout
        self.log = EventLog()
        self.counters = Counters(self)
        self.log.sinks.append(self.counters)
        self.tasks: dict[str, TaskState] = {}
        self.unregistered: set[str] = set()  # tasks unregistered and not registered since
        self.waiters = Waiters(self.log, self.tasks)
        self.cond = self.waiters.cond
        self.leases = Leases(self.tasks, capacity, self._emit)
        self.rounds = Rounds(self.leases)
        self.reservations = Reservations(self.table)
        self.producers = Producers()
        self.version = 0
        self.ended = False
        self.closed = False
        self.closed_columns: set[str] = set()
        self.on_evict: Callable[[np.ndarray, np.ndarray], None] | None = None
        self.partitions: dict[str, int] = {"": 0}  # the names in use, and their ids
        self.partition_names: dict[int, str] = {0: ""}  # the same, by id
        self.next_partition = 1  # the id the next new partition name gets
        self.watermark = 0  # indices below it may have been handed out (IndexWatermark)
        self.replaying = False  # recover(): apply journaled events without re-emitting them
        self.declared: dict[str, Column] = {}
        self._next_unit = 0

    # -- columns and tasks ------------------------------------------------------------------
    def add_columns(self, columns: tuple[Column, ...]) -> None:
        """Add columns to the table (the caller's schema validated them); logs the new ones."""
        new = tuple(c for c in columns if c.name not in self.declared)
        for col in new:
            self.declared[col.name] = col
            self.table.add_column(col.name)
        if new:
            self._emit(ColumnsDeclared, columns=new)

    def register_task(
        self, task: str, columns: tuple[str, ...], partition: str | None = None
    ) -> None:
        """Register a consuming task; ``partition``: it reads that partition's samples
        only (None: every sample). Registering it again the same way changes nothing."""
        if not isinstance(task, str) or not task:
            raise ConfigError(f"task name must be a non-empty str, got {task!r}")
        if not columns:
            raise ConfigError(f"task {task!r} must consume at least one column")
        if partition is not None and not isinstance(partition, str):
            raise ConfigError(f"task {task!r}: partition must be a str or None, got {partition!r}")
        for c in columns:
            if c not in self.table.ready:
                raise UnknownColumnError(
                    f"task {task!r} needs column {c!r}, which is not declared; declared "
                    f"columns: {', '.join(sorted(self.table.ready)) or 'none'}"
                )
        existing = self.tasks.get(task)
        if existing is not None:
            if existing.columns != columns or existing.partition != partition:
                raise ConfigError(
                    f"task {task!r} is already registered with columns {list(existing.columns)}"
                    f"{_scope(existing.partition)}, cannot re-register it with {list(columns)}"
                    f"{_scope(partition)}; unregister_task({task!r}) first"
                )
            return
        pid = -1 if partition is None else self._partition_id(partition)
        state = TaskState(task, columns, self.table.capacity, partition, pid)
        t = self.table
        live = np.flatnonzero(t.owner >= 0)
        if pid >= 0:  # committed samples of other partitions are not for it
            other = t.committed[live] & (t.partition[live] != pid)
            state.status[live[other]] = CONSUMED
            live = live[~other]
        state.missing[:] = len(columns)
        for c in columns:
            state.missing[live] -= t.ready[c][live]
        ready = live[(state.missing[live] == 0) & t.committed[live]]
        if ready.size:
            state.status[ready] = READY
            state.queue.push_back(np.sort(t.owner[ready]))
        self.tasks[task] = state
        self.unregistered.discard(task)
        self._emit(TaskRegistered, task=task, columns=columns, partition=partition)

    def register_opening_tasks(self, tasks: Mapping[str, Sequence[str]]) -> None:
        """Register the tasks a hub is opened with, but not those its journal shows were
        unregistered since (registered again, such a task would see every live sample as
        new, its own consumed ones too)."""
        for task, columns in tasks.items():
            if task not in self.unregistered:
                self.register_task(task, tuple(columns))

    def unregister_task(self, task: str) -> np.ndarray:
        """Forget a task; returns the indices evicted as a result (the samples every other
        task had consumed: only this one still held them). Refused (LeaseError, nothing
        changed) while it holds leases: its claims must be acked or released first, so no
        sample is lost or delivered twice."""
        state = self.task(task)
        self.expire()
        held = [lease for lease in self.leases.live.values() if lease.task == task]
        if held:
            n = sum(int(lease.indices.size) for lease in held)
            raise LeaseError(
                f"unregister_task({task!r}): the task holds {len(held)} leases of {n} "
                "samples; ack or release them first (or let them expire)"
            )
        del self.tasks[task]
        self.unregistered.add(task)
        self.rounds.by_task.pop(task, None)
        self._emit(TaskUnregistered, task=task)
        t = self.table
        # (with no task left, nothing was consumed by everyone: keep every sample)
        waiting = np.flatnonzero((t.owner >= 0) & t.committed & (state.status != CONSUMED))
        evicted = self._evict_if_done(waiting) if self.tasks else waiting[:0]
        self._forget_partition(state)
        self.waiters.forget(task, self.ended)
        return evicted

    def task(self, name: str) -> TaskState:
        state = self.tasks.get(name)
        if state is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise UnknownTaskError(
                f"task {name!r} is not registered (registered: {known}); call "
                f"hub.register_task({name!r}, columns=[...]) before claiming"
            )
        return state

    # -- producers --------------------------------------------------------------------------
    def reserve(
        self,
        n: int,
        *,
        units: Sequence[int] | None = None,
        ahead: int = 0,
        pooled: bool = False,
    ) -> tuple[np.ndarray, int]:
        """Allocate ``n`` fresh indices on one storage unit; invisible until :meth:`commit`.

        Puts take turns over ``units`` (a producer's own node's units; None: all of them).
        ``ahead``: up to that many more indices, as room allows (never waiting for it),
        which the producer keeps for its next puts (a remote producer saves a round trip
        per put); each goes to the unit whose turn it would have been (``table.unit``).
        ``pooled``: all ``n`` are for a later put (the next one of a producer, reserved
        with its commit): taken back like those ``ahead`` when the hub runs out of room.
        """
        self._check_open()
        if self.ended:
            raise EndOfStream("end_stream() was called; no new samples may be put")
        allowed = None if units is None else np.asarray(units, dtype=np.int64)
        if allowed is not None and (
            allowed.ndim != 1
            or not allowed.size
            or allowed.min() < 0
            or allowed.max() >= self.n_units
        ):
            raise ConfigError(f"storage units {units!r} do not all exist (have {self.n_units})")
        ahead = max(0, min(ahead, self.table.free_slots() - n))
        indices = self.table.allocate(n + ahead)
        turn = self._next_unit
        self._next_unit += 1 + ahead
        span = self.n_units if allowed is None else allowed.size
        unit = turn % span if allowed is None else int(allowed[turn % span])
        run = self.table.run_slots  # (allocations are increasing)
        self._init_slots(run(indices[:n] if ahead else indices), unit)
        if ahead:  # each index reserved ahead goes where its put's turn would have gone
            turns = (turn + 1 + np.arange(ahead)) % span
            self._init_slots(run(indices[n:]), turns if allowed is None else allowed[turns])
        if self.table.next_index > self.watermark:
            self.watermark = self.table.next_index + self.table.capacity
            self._emit(IndexWatermark, next=self.watermark)
        # Not sooner than RESERVATION_MIN_S: a large put may outlast a short lease timeout.
        deadline = time.time() + max(self.lease_timeout, RESERVATION_MIN_S)
        self.reservations.hold(indices, 0 if pooled else n, deadline)
        return indices, unit

    def place(self, indices: np.ndarray, unit: int) -> None:
        """Occupy the slots of given fresh indices on ``unit``, as reserve() would have
        (a journal's replay)."""
        self.table.place(indices)
        self._init_slots(indices % self.table.capacity, unit)
        self.reservations.placed(int(indices.size))

    def _init_slots(self, slots: slice | np.ndarray, unit: int | np.ndarray) -> None:
        """Make the slots of fresh indices pending for every task, on ``unit``."""
        self.table.unit[slots] = unit
        for state in self.tasks.values():
            state.missing[slots] = len(state.columns)
            state.status[slots] = PENDING

    def abort(self, indices: np.ndarray) -> None:
        """Give back a reservation whose data never arrived (already expired ones: no-op)."""
        self.reservations.release(np.asarray(indices, dtype=np.int64))
        self.waiters.notify(self.ended, everyone=True)  # room freed without an event

    def reclaim_ahead(self) -> int:
        """Free the indices producers reserved ahead and did not put yet, before a put
        waits for room (a producer's pool may be idle, its thread gone); returns how many.
        A producer that puts one of them later is refused and reserves afresh."""
        freed = self.reservations.reclaim_ahead()
        if freed:
            self.waiters.notify(self.ended, everyone=True)  # room freed without an event
        return freed

    def check_update(
        self, indices: np.ndarray, columns: tuple[str, ...], ack: LeaseRef | None = None
    ) -> np.ndarray:
        """Validate a put to existing samples before any byte moves; returns their units.

        ``ack``: (task, lease) of the claim the put acks, checked first: a straggler whose
        lease expired learns that (its samples may have been finished and evicted since).
        """
        self._check_open()
        if ack is not None:
            self.expire()
            self.leases.get(ack.task, ack.lease, "put(ack=...)")  # (the commit checks the rest)
        slots = self.table.slots_of(indices)
        self._check_writable(slots, columns)
        return self.table.unit[slots]

    def _check_writable(self, slots: np.ndarray, columns: Iterable[str]) -> None:
        """A put to existing samples names each once and no column end_stream() closed."""
        if not _distinct(slots):
            raise SchemaError("put() to existing samples names an index twice")
        for name in columns:
            if name in self.closed_columns:
                raise SchemaError(f"column {name!r} was closed by end_stream(); cannot put it")

    def commit(self, cmd: Commit) -> None:
        """Mark columns ready on samples (after their bytes were stored).

        The version: one for the put or one per sample (validated by the client); none
        gives new samples the current version and leaves updated ones as they are.

        ``ack``: a claim holding these samples, acked in the same step, so they are never
        written without being consumed (a worker that dies between a put and its ack would
        have them delivered, and processed, again). ``put_id`` is the caller's business.

        ``seq``: a put of ``producer`` committed before is refused with ``DuplicatePut``
        (first: a re-sent put that acked its claim learns of its first landing, not of
        the lease it consumed then).
        """
        if cmd.seq is not None:
            self.producers.check(cmd.producer, cmd.seq)
        indices, cells, new = cmd.indices, cmd.cells, cmd.new
        groups, tokens, version, ack = cmd.groups, cmd.tokens, cmd.policy_version(), cmd.ack
        # (the lease first: a straggler learns that its lease expired, whatever else
        # happened to its samples since: finished, evicted, their column closed)
        lease = None if ack is None else self._ackable_lease(ack, indices)
        t = self.table
        slots = t.slots_of(indices, committed=not new)
        if not new:  # (a remote client writes to a claim's samples without check_update)
            self._check_writable(slots, cells)
        if new and any_set(t.committed[slots]):
            raise SchemaError(
                f"sample {int(indices[np.argmax(t.committed[slots])])} is already committed; a "
                "new put commits reserved indices once (put columns to existing samples "
                "with indices=)"
            )
        for name in cells:
            if name not in t.ready:
                raise UnknownColumnError(f"unknown column {name!r} in commit")
        if new:
            t.committed[slots] = True
            t.partition[slots] = self._partition_id(cmd.partition)
            t.version[slots] = self.version if version is None else version
            t.group[slots] = -1 if groups is None else groups
            self.reservations.committed(slots)
        elif version is not None:
            t.version[slots] = version
        if groups is not None and not new:
            t.group[slots] = groups
        fresh: dict[str, np.ndarray] = {}
        for name, cell in cells.items():
            ready = t.ready[name]
            fresh[name] = slots if new or not any_set(ready[slots]) else slots[~ready[slots]]
            ready[slots] = True
            t.nbytes[name][slots] = cell.nbytes
            if cell.lengths is not None and tokens is None:
                t.tokens[slots] = np.maximum(t.tokens[slots], cell.lengths)
        if tokens is not None:
            t.tokens[slots] = tokens
        owners = indices.astype(np.int64, copy=False)
        pid = int(t.partition[slots[0]]) if new and slots.size else -1
        for state in self.tasks.values():
            if new and state.partition_id >= 0 and state.partition_id != pid:
                state.status[slots] = CONSUMED  # another partition's: not for this task
                continue
            done = state.became_ready(slots, fresh, new)
            if done.size:
                state.status[done] = READY
                # a new put's slots come in index order (and are all done: they are its
                # indices, checked by slots_of); an update's may not (ring wrap)
                queued = owners if new else t.owner[done]
                state.queue.push_back(queued if new or done.size == 1 else np.sort(queued))
        listed = tuple(indices.tolist())
        self._append(
            Put(
                seq=self.log.seq + 1,
                t=time.time(),
                indices=listed,
                columns=tuple(cells),
                new=new,
                partition=cmd.partition,
                version=_put_version(self.version, version, t.version, slots, new),
                versions=tuple(version.tolist()) if isinstance(version, np.ndarray) else (),
                tokens=tuple(t.tokens[slots].tolist()),
                unit=int(t.unit[slots[0]]),
                producer=cmd.producer,
                groups=() if groups is None else tuple(t.group[slots].tolist()),
                nbytes=tuple(chain.from_iterable(c.nbytes.tolist() for c in cells.values())),
                producer_seq=-1 if cmd.seq is None else cmd.seq,
            )
        )
        if cmd.seq is not None:
            self.producers.record(cmd.producer, cmd.seq, indices)
        if lease is not None:
            # (ackable: distinct indices of the lease; as many as it holds: all of them)
            whole = indices.size == lease.indices.size
            state = self.tasks[lease.task]
            self._consume(
                state, lease, indices, drop=False, whole=whole, slots=slots, listed=listed
            )
        self.waiters.notify(self.ended)

    def _partition_id(self, name: str) -> int:
        pid = self.partitions.get(name)
        if pid is None:
            pid = self.partitions[name] = self.next_partition
            self.partition_names[pid] = name
            self.next_partition += 1
        return pid

    def _forget_partition(self, state: TaskState) -> None:
        """Forget the name of an unregistered task's partition once no task is scoped to
        it and no sample is in it (a new sample or task in it gets a new id)."""
        name, pid = state.partition, state.partition_id
        if name is None or pid == 0 or any(st.partition_id == pid for st in self.tasks.values()):
            return  # (the default partition "" keeps id 0)
        t = self.table
        if not (t.committed & (t.owner >= 0) & (t.partition == pid)).any():
            del self.partitions[name], self.partition_names[pid]

    # -- consumers --------------------------------------------------------------------------
    def try_claim_batches(self, cmd: Claim, sampler: Sampler) -> list[BatchMeta] | None:
        """``try_claim``, then up to ``cmd.more`` further micro-batches ready now, each its
        own lease: what that many claims in a row that do not wait would take."""
        first = self.try_claim(cmd, sampler)
        if first is None:
            return None
        metas = [first]
        for _ in range(cmd.more):
            try:
                meta = self.try_claim(cmd, sampler)
            except EndOfStream:  # (the next claim raises it)
                break
            if meta is None:
                break
            metas.append(meta)
        return metas

    def try_claim(self, cmd: Claim, sampler: Sampler) -> BatchMeta | None:
        """Lease up to ``n`` samples, or return None when fewer than ``min_n`` are ready.

        ``sampler``: the Sampler ``cmd`` names (in-process, the caller's own object).
        Raises EndOfStream once the stream ended and nothing more can become ready.
        """
        task, n, columns, min_n = cmd.task, cmd.n, cmd.columns, cmd.min_n
        consumer, lease_timeout, dp_rank = cmd.consumer, cmd.lease_timeout, cmd.dp_rank
        self._check_open()
        state = self.task(task)
        cols = state.columns if columns is None else columns
        for c in () if columns is None else columns:  # (the task's own were checked)
            if c not in self.table.ready:
                raise UnknownColumnError(f"unknown column {c!r} in claim() by task {task!r}")
            if c not in state.columns:
                raise SchemaError(
                    f"task {task!r} was registered with columns {list(state.columns)}; "
                    f"it cannot claim column {c!r}"
                )
        # (the sampler classes are final: a type check costs less than an ABC's isinstance)
        balanced = sampler if type(sampler) is BalancedSampler else None
        fanout = 1 if balanced is None else balanced.dp_size
        _check_claim_size(cmd, sampler, fanout, self.table.capacity)
        want = n if min_n is None else min_n
        ttl = self.lease_timeout if lease_timeout is None else lease_timeout
        self.expire()
        if balanced is not None:
            lease = self.rounds.take(task, dp_rank, ttl)
            if lease is not None:
                return self._meta(lease, cols)
        final = self._nothing_more(state)
        # (the queue holds exactly the task's READY samples, oldest first)
        view = CandidateView(state.queue.view(sampler.window(n)), self.table, self.version)
        need = min(want, sampler.quota(n)) * fanout
        if len(view) < need and not final:
            return None
        fifo = type(sampler) is FifoSampler  # the queue's head: no positions to build or check
        positions = (
            _NO_POSITIONS
            if fifo
            else _checked_positions(sampler, sampler.select(view, n), n * fanout, len(view))
        )
        count = min(n, len(view)) if fifo else positions.size
        if count == 0 or (count < need and not final):
            if final and not self.leases.held_by_others(task, consumer):
                raise EndOfStream(_end_message(task, len(view)))
            return None
        if balanced is None:
            queue = state.queue
            chosen = queue.take_front(count) if fifo else queue.take(positions)
            slots = chosen % self.table.capacity
            lease = self.leases.open(state, chosen, time.time() + ttl, consumer, slots=slots)
            return self._meta(lease, cols, slots)
        tokens = view.tokens[positions]  # the split balances them across the ranks
        groups = view.group[positions]
        chosen = state.queue.take(positions)
        parts = balanced.split(tokens, groups)
        mine = self.rounds.deal(state, chosen, parts, time.time() + ttl, consumer, dp_rank, fanout)
        if mine is None:
            raise EndOfStream(_end_message(task, 0))
        return self._meta(mine, cols)

    def _meta(
        self, lease: Lease, columns: tuple[str, ...], slots: np.ndarray | None = None
    ) -> BatchMeta:
        """The lease's handle (``slots``: its indices' slots, if known)."""
        t = self.table
        if slots is None:
            slots = lease.indices % t.capacity if lease.slots is None else lease.slots
        # (a Python sum of a micro-batch's few values costs less than numpy's .sum())
        nbytes, cells = 0, t.nbytes
        for c in columns:
            nbytes += sum(cells[c][slots].tolist())
        return BatchMeta(
            task=lease.task,
            lease=lease.id,
            columns=columns,
            indices=lease.indices,
            units=t.unit[slots],
            tokens=t.tokens[slots],
            versions=t.version[slots],
            groups=t.group[slots],
            nbytes=nbytes,
            deadline=lease.deadline,
            dp_rank=lease.dp_rank,
        )

    def meta(self, indices: np.ndarray, columns: tuple[str, ...]) -> BatchMeta:
        """An unleased handle to read given samples (e.g. for debugging or re-reads)."""
        t = self.table
        for c in columns:
            if c not in t.ready:
                raise UnknownColumnError(f"unknown column {c!r} in meta()")
        idx = np.asarray(indices, dtype=np.int64)
        slots = t.slots_of(idx)
        for c in columns:
            missing = ~t.ready[c][slots]
            if missing.any():
                raise SchemaError(
                    f"column {c!r} is not ready on sample {int(idx[np.argmax(missing)])}"
                )
        lease = Lease(0, "", idx, float("inf"))
        return self._meta(lease, columns)

    def ack(
        self, task: str, lease_id: int, indices: np.ndarray | None = None, *, drop: bool = False
    ) -> np.ndarray:
        """Consume a lease (or part of it); returns the indices evicted as a result.

        ``drop`` also consumes the samples for every other task that has not leased them
        (a filter discarding samples): nothing downstream sees them and they are evicted.
        """
        state = self.task(task)
        self.expire()
        lease = self.leases.get(task, lease_id, "ack")
        done = None if indices is None else np.asarray(indices, dtype=np.int64)
        if done is None or check_ackable(lease, done):  # the whole claim, named or not
            held, slots, listed = lease.indices, lease.slots, lease.listed
            return self._consume(state, lease, held, drop, whole=True, slots=slots, listed=listed)
        return self._consume(state, lease, done, drop)

    def _consume(
        self,
        state: TaskState,
        lease: Lease,
        done: np.ndarray,
        drop: bool,
        whole: bool = False,
        *,
        slots: np.ndarray | None = None,
        listed: tuple[int, ...] | None = None,
    ) -> np.ndarray:
        """Ack ``done`` (samples of ``lease``; ``whole``: all of them); returns the indices
        evicted as a result. ``slots`` and ``listed``: ``done``'s slots and its indices as
        a tuple, where the caller has them."""
        if done.size == 0:
            return done  # acking nothing changes nothing (and logs nothing)
        task, lease_id = lease.task, lease.id
        if slots is None:
            slots = done % self.table.capacity
        state.status[slots] = CONSUMED
        state.consumed_total += int(done.size)
        self.leases.consume(lease, done, whole)
        if listed is None:
            listed = tuple(done.tolist())
        seq, now = self.log.seq + 1, time.time()
        self._append(Acked(seq=seq, t=now, task=task, lease=lease_id, indices=listed, dropped=drop))
        if drop:
            for name, other in self.tasks.items():
                if name != task:
                    other.discard(slots)
        evicted = self._evict_if_done(slots, listed)
        self.waiters.notify(self.ended)
        return evicted

    def release(self, task: str, lease_id: int) -> None:
        """Give a lease back: its samples become claimable again, first in line."""
        self.task(task)
        self.expire()
        self.leases.release(self.leases.get(task, lease_id, "release"))
        self.rounds.prune(task)
        self.waiters.notify(self.ended)

    def expire(self, now: float | None = None) -> int:
        """Return the samples of every lease past its deadline, and free the reservations
        past theirs; returns how many expired."""
        if self.replaying:
            return 0  # a journal replays expiries as the events they were
        now = time.time() if now is None else now
        if now < self.leases.due and now < self.reservations.due:
            return 0  # nothing is due: the usual case on every claim and ack, kept cheap
        count = 0
        lease = self.leases.pop_due(now)
        while lease is not None:
            self.expire_lease(lease)
            count += 1
            lease = self.leases.pop_due(now)
        count += self.reservations.expire(now)
        if count:  # (expired reservations free room without an event)
            self.waiters.notify(self.ended, everyone=True)
        return count

    def expire_lease(self, lease: Lease) -> None:
        """End a live lease at its deadline: its samples are claimable again, first."""
        self.leases.expire(lease)
        self.rounds.prune(lease.task)

    def next_deadline(self) -> float | None:
        """When the next lease or uncommitted reservation expires (None: nothing pending)."""
        lease, reservation = self.leases.next_deadline(), self.reservations.next_deadline()
        if lease is None or reservation is None:
            return reservation if lease is None else lease
        return min(lease, reservation)

    def _ackable_lease(self, ack: LeaseRef, indices: np.ndarray) -> Lease:
        """The live lease a put acks, holding every sample put; LeaseError otherwise."""
        self.expire()
        lease = self.leases.get(ack.task, ack.lease, "put(ack=...)")
        check_ackable(lease, indices)
        return lease

    def _evict_if_done(
        self, slots: np.ndarray, listed: tuple[int, ...] | None = None
    ) -> np.ndarray:
        """Evict those of ``slots`` every task consumed; returns their indices
        (``listed``: the indices in ``slots`` as a tuple, where the caller has it)."""
        gone = _consumed_by_all(slots, self.tasks.values())
        if gone.size == 0:
            return np.empty(0, dtype=np.int64)
        indices = self.table.owner[gone]  # (fancy indexing copies)
        units = self.table.unit[gone]
        self.table.free(gone)
        if listed is None or gone is not slots:
            listed = tuple(indices.tolist())
        self._append(Evicted(seq=self.log.seq + 1, t=time.time(), indices=listed))
        if self.on_evict is not None:
            self.on_evict(indices, units)
        return indices

    # -- end of stream ----------------------------------------------------------------------
    def end_stream(self, columns: tuple[str, ...] = ()) -> None:
        for c in columns:
            if c not in self.table.ready:
                raise UnknownColumnError(f"unknown column {c!r} in end_stream()")
        self.ended = True
        self.closed_columns.update(columns)
        self.reservations.reclaim_ahead()
        self._emit(StreamEnded, columns=tuple(columns))
        self.waiters.notify(self.ended)

    def _nothing_more(self, state: TaskState) -> bool:
        """True when no sample that is not READY now can ever become READY for the task."""
        if not self.ended or self.reservations.count:
            return False
        t = self.table
        pending = np.flatnonzero((state.status == PENDING) & (t.owner >= 0) & t.committed)
        if pending.size == 0:
            return True
        # A pending sample can still become ready only if none of its missing columns is
        # closed; one missing closed column blocks it for good.
        blocked = np.zeros(pending.size, dtype=bool)
        for c in state.columns:
            if c in self.closed_columns:
                blocked |= ~t.ready[c][pending]
        return bool(blocked.all())

    # -- recovery ---------------------------------------------------------------------------
    def live_indices(self) -> np.ndarray:
        return self.table.owner[self.table.owner >= 0]

    def recover(self, events: Iterable[Event]) -> int:
        """Rebuild, on a fresh controller, the state a journal of its events describes
        (``flowrl._controller.replay``); returns how many events were applied."""
        return replay.recover(self, events)

    # -- versions and lifecycle -------------------------------------------------------------
    def publish_version(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < self.version:
            raise ConfigError(
                f"policy versions must be ints that never decrease; current {self.version}, "
                f"got {version!r}"
            )
        self.version = version
        self._emit(VersionPublished, version=version)
        self.waiters.notify(self.ended)

    def close(self) -> None:
        """Refuse further calls and wake every waiter (the caller closes ``log`` unlocked)."""
        self.closed = True
        self.waiters.notify(self.ended, everyone=True)  # (no event)

    def _check_open(self) -> None:
        if self.closed:
            raise HubClosed("the hub was shut down")

    # -- waking waiters ---------------------------------------------------------------------
    def claim_cond(self, task: str) -> threading.Condition:
        """The condition an in-process claim of ``task`` waits on (under ``cond``'s lock)."""
        return self.waiters.claim_cond(task)

    def mark(self) -> tuple[int, int]:
        """Where the controller's state is now, for :meth:`woken_since`."""
        return self.waiters.mark()

    def woken_since(self, mark: tuple[int, int]) -> Wake:
        """Which waiters the changes since ``mark`` may let proceed."""
        return self.waiters.woken_since(mark, self.ended)

    def statistics(self) -> HubStats:
        """Counters of the control plane (``units`` is filled in by the caller)."""
        t = self.table
        live = t.owner >= 0
        tasks = {
            name: TaskStats(
                ready=int(((st.status == READY) & live).sum()),
                leased=int(((st.status == LEASED) & live).sum()),
                consumed=st.consumed_total,
                partition=st.partition,
            )
            for name, st in self.tasks.items()
        }
        # (a count per partition id: np.unique would sort the whole table on every call)
        counts = np.bincount(t.partition[live & t.committed])
        names = self.partition_names
        partitions = {names[p]: int(counts[p]) for p in np.flatnonzero(counts).tolist()}
        return HubStats(
            capacity=self.table.capacity,
            live=self.table.live - self.reservations.ahead,
            reserved=self.reservations.count - self.reservations.ahead,
            reserved_ahead=self.reservations.ahead,
            tasks=tasks,
            leases=len(self.leases),
            version=self.version,
            ended=self.ended,
            events=self.log.seq,
            units=[],
            duplicate_puts=self.producers.duplicates,
            counters=self.counters.snapshot(self.tasks),
            partitions=partitions,
        )

    def _emit(self, cls: type, **fields: object) -> None:
        if not self.replaying:
            self.log.append(cls(seq=self.log.next_seq(), t=time.time(), **fields))

    def _append(self, event: Event) -> None:
        """Append ``event``, built with ``seq=self.log.seq + 1``: the hot paths build theirs
        with keywords, which a struct takes faster than :meth:`_emit`'s ``**fields``
        dict. (A journal's replay appends nothing.)"""
        if not self.replaying:
            self.log.append(event)


def _check_claim_size(cmd: Claim, sampler: Sampler, fanout: int, capacity: int) -> None:
    """Refuse a claim no state of the hub can serve (it would wait its whole timeout)."""
    want = cmd.n if cmd.min_n is None else cmd.min_n
    if min(want, sampler.quota(cmd.n)) * fanout > capacity:
        per = f" for each of {fanout} dp ranks" if fanout > 1 else ""
        at_least = "" if cmd.min_n is None else f" (min_n={cmd.min_n})"
        raise ConfigError(
            f"claim() of n={cmd.n}{at_least} samples{per} can never be filled: the hub holds "
            f"at most {capacity} (HubConfig.capacity); claim fewer, or pass a min_n to take "
            "what is ready"
        )
    if fanout == 1 and cmd.dp_rank:
        raise ConfigError(
            f"claim() dp_rank={cmd.dp_rank} needs a BalancedSampler(dp_size) to name one of "
            f"its ranks; {sampler!r} deals every claim whatever is ready (leave dp_rank at 0)"
        )
    if not 0 <= cmd.dp_rank < fanout:
        raise ConfigError(
            f"claim() dp_rank must be in [0, dp_size={fanout}) of its {sampler!r}, "
            f"got {cmd.dp_rank}"
        )


def _checked_positions(sampler: Sampler, selected: Any, most: int, candidates: int) -> np.ndarray:
    """A sampler's positions, sorted; ConfigError unless distinct, in range and few enough."""
    positions = np.sort(np.asarray(selected, dtype=np.int64))
    if positions.size and (
        positions[0] < 0
        or positions[-1] >= candidates
        or positions.size > most
        or (positions.size > 1 and not (np.diff(positions) > 0).all())
    ):
        raise ConfigError(
            f"sampler {sampler!r} returned invalid positions (must be distinct, within the "
            f"{candidates} candidates, at most n)"
        )
    return positions


def _consumed_by_all(slots: np.ndarray, states: Iterable[TaskState]) -> np.ndarray:
    """Those of ``slots`` that every one of ``states`` consumed (no state: all of them)."""
    # (status is one byte a slot: comparing bytes finds the usual all-or-none answers
    # without building a mask per task)
    every = _CONSUMED_BYTE * slots.size
    done: np.ndarray | None = None
    for state in states:
        status = state.status[slots]
        raw = status.tobytes()
        if raw == every:
            continue
        if _CONSUMED_BYTE not in raw:
            return slots[:0]
        mine = status == CONSUMED
        done = mine if done is None else done & mine
    return slots if done is None else slots[done]


def _distinct(slots: np.ndarray) -> bool:
    """Whether no slot repeats (increasing ones, the usual case, need no sorting)."""
    return slots.size < 2 or all_set(slots[1:] > slots[:-1]) or np.unique(slots).size == slots.size


def _scope(partition: str | None) -> str:
    return "" if partition is None else f" for partition {partition!r}"


def _end_message(task: str, left: int) -> str:
    tail = f"; {left} ready samples were not selectable by the sampler" if left else ""
    return f"end of stream for task {task!r}: nothing more will become ready{tail}"


def _put_version(
    current: int,
    version: int | np.ndarray | None,
    versions: np.ndarray,
    slots: np.ndarray,
    new: bool,
) -> int:
    """The ``Put`` event's version: the oldest the put gave its samples (-1: unchanged)."""
    if version is None:
        return current if new else -1
    if isinstance(version, np.ndarray):
        return int(versions[slots].min())
    return int(version)

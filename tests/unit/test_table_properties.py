"""Stateful property test of the controller's metadata table (hypothesis).

A ``RuleBasedStateMachine`` drives :class:`flowrl._controller.controller.Controller`
directly with random operation sequences — reserve+commit of new samples, more columns put
in random order over several puts, claims by 2-3 tasks with different column sets under
Fifo/Group/Staleness samplers, full and partial acks, releases, forced lease expiry,
version bumps, end of stream, a task unregistered (refused while it holds leases) —
against a plain-Python model of what each task is owed.

Invariants checked after every step (the controller's module docstring):

* a task never receives a sample it has acked, nor one it holds a live lease on;
* at most one live lease per (task, sample);
* a claimed sample had every column of the task ready;
* none lost: every committed sample is ready/leased/consumed/pending for each task, or
  evicted; the task's ready queue holds exactly its ready samples;
* a sample is evicted only after every task acked it, and then exactly once;
* released or expired samples return to the front of the queue;
* events have strictly increasing ``seq``;
* the event log is a complete journal: a fresh controller that replays it (encoded and
  decoded, as on disk) reaches exactly the same state.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler, GroupSampler, StalenessSampler
from flowrl._controller.tasks import CONSUMED, LEASED, PENDING, READY
from flowrl._protocol.commands import Cell, Claim, Commit
from flowrl._schema.columns import Column
from flowrl.errors import EndOfStream, HubFull, LeaseError, SchemaError, UnknownIndexError
from flowrl.events import Evicted, event_decoder, event_encoder

CAP = 10
COLUMNS = ("a", "b", "c")
FAR_FUTURE = 1e18
GROUP_SIZE = 2

column_sets = st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True)


def pick(items: list[Any], k: int) -> Any:
    return items[k % len(items)]


def pick_subset(items: list[int], mask: int) -> list[int]:
    """A non-empty subset of ``items`` (in their order) chosen by the bits of ``mask``."""
    chosen = [x for b, x in enumerate(items) if mask >> (b % CAP) & 1]
    return chosen or items[:1]


def _cells(n: int, columns: list[str]) -> dict[str, Cell]:
    return {c: Cell(np.full(n, 8, dtype=np.int64)) for c in columns}


class ControllerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctl = Controller(CAP, n_units=1, lease_timeout=1e6)
        self.journal: list[bytes] = []
        self.ctl.log.sinks.append(lambda e: self.journal.append(event_encoder.encode(e)))
        self.ctl.add_columns(tuple(Column.scalar(c, "int64") for c in COLUMNS))
        self.tasks: dict[str, tuple[str, ...]] = {}
        # model
        self.cols: dict[int, set[str]] = {}  # live committed sample -> ready columns
        self.group: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        self.allocated: list[int] = []  # every index ever handed out, in order
        self.evicted: set[int] = set()
        self.consumed: dict[str, set[int]] = {}
        self.leases: dict[int, tuple[str, list[int]]] = {}  # live lease -> (task, indices)
        self.settled: list[tuple[str, int]] = []  # (task, lease) acked/released/expired
        self.queue: dict[str, list[int]] = {}  # each task's ready samples, in claim order
        self.version = 0
        self.turn = 0
        self.ended = False
        self.closed: set[str] = set()

    # -- helpers --------------------------------------------------------------------------
    def leased(self, task: str) -> set[int]:
        return {i for t, idx in self.leases.values() if t == task for i in idx}

    def is_ready(self, task: str, i: int) -> bool:
        return (
            i in self.cols
            and set(self.tasks[task]) <= self.cols[i]
            and i not in self.consumed[task]
            and i not in self.leased(task)
        )

    def push_ready(self, indices: list[int], before: dict[str, set[int]]) -> None:
        """Append samples that just became ready for each task, oldest index first."""
        for task in self.tasks:
            fresh = sorted(i for i in indices if i not in before[task] and self.is_ready(task, i))
            self.queue[task].extend(fresh)

    def nothing_more(self, task: str) -> bool:
        """Ended, and every sample the task still lacks misses a closed column."""
        cols = set(self.tasks[task])
        pending = [i for i in self.cols if not cols <= self.cols[i]]  # never consumed
        return self.ended and all((cols - self.cols[i]) & self.closed for i in pending)

    def held_by(self, task: str) -> int:
        """How many live samples every task but ``task`` consumed."""
        others = [c for t, c in self.consumed.items() if t != task]
        return sum(all(i in c for c in others) for i in self.cols)

    def ready_sets(self) -> dict[str, set[int]]:
        return {t: set(q) for t, q in self.queue.items()}

    def return_lease(self, lid: int) -> None:
        task, idx = self.leases.pop(lid)
        self.queue[task][:0] = idx
        self.settled.append((task, lid))

    # -- setup ----------------------------------------------------------------------------
    @initialize(data=st.data())
    def register_tasks(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(2, 3), label="n_tasks")
        for t in range(k):
            cols = tuple(data.draw(column_sets, label=f"task{t}_columns"))
            name = f"task{t}"
            with self.ctl.cond:
                self.ctl.register_task(name, cols)
            self.tasks[name] = cols
            self.consumed[name] = set()
            self.queue[name] = []

    # -- producers ------------------------------------------------------------------------
    @rule(
        n=st.integers(1, 4),
        columns=st.just(list(COLUMNS))
        | st.lists(st.sampled_from(COLUMNS), max_size=3, unique=True),
        groups=st.lists(st.integers(-1, 3), min_size=4, max_size=4),
        version_lag=st.none()
        | st.integers(0, 2)
        | st.lists(st.integers(0, 2), min_size=4, max_size=4),  # one per sample
    )
    def put_new(self, n: int, columns: list[str], groups: list[int], version_lag: Any) -> None:
        version: Any = None
        if isinstance(version_lag, int):
            version = max(self.version - version_lag, 0)
        elif version_lag is not None:
            version = np.maximum(self.version - np.array(version_lag[:n], dtype=np.int64), 0)
        with self.ctl.cond:
            if self.ended:
                with pytest.raises(EndOfStream):
                    self.ctl.reserve(n)
                return
            if CAP - len(self.cols) < n:
                with pytest.raises(HubFull):
                    self.ctl.reserve(n)
                return
            indices, unit = self.ctl.reserve(n)
            assert unit == 0
            got = indices.tolist()
            assert not set(got) & set(self.allocated), "an index was reused"
            assert all(i > j for i in got for j in self.allocated), "indices must only grow"
            self.allocated += got
            self.ctl.commit(
                Commit(
                    indices=indices,
                    cells=_cells(n, columns),
                    new=True,
                    groups=np.array(groups[:n], dtype=np.int64),
                    version=version if isinstance(version, int) else None,
                    versions=version if isinstance(version, np.ndarray) else None,
                )
            )
        before = self.ready_sets()
        for pos, i in enumerate(got):
            self.cols[i] = set(columns)
            self.group[i] = groups[pos]
            if version is None:
                self.version_of[i] = self.version
            else:
                self.version_of[i] = int(version if isinstance(version, int) else version[pos])
        self.push_ready(got, before)

    @rule(n=st.integers(1, 3))
    def reserve_and_abort(self, n: int) -> None:
        with self.ctl.cond:
            if self.ended or CAP - len(self.cols) < n:
                return
            indices, _ = self.ctl.reserve(n)
            self.allocated += indices.tolist()
            self.ctl.abort(indices)

    @precondition(lambda self: self.cols)
    @rule(mask=st.integers(1, 2**CAP - 1), column=st.sampled_from(COLUMNS))
    def put_column(self, mask: int, column: str) -> None:
        chosen = pick_subset(sorted(self.cols), mask)
        idx = np.array(chosen, dtype=np.int64)
        with self.ctl.cond:
            if column in self.closed:
                with pytest.raises(SchemaError, match=column):
                    self.ctl.check_update(idx, (column,))
                return
            self.ctl.check_update(idx, (column,))
            self.ctl.commit(Commit(indices=idx, cells=_cells(idx.size, [column]), new=False))
        before = self.ready_sets()
        for i in chosen:
            self.cols[i].add(column)
        self.push_ready(chosen, before)

    @precondition(lambda self: self.cols)
    @rule(column=st.sampled_from(COLUMNS))
    def put_column_where_missing(self, column: str) -> None:
        """A late producer: writes ``column`` on every live sample that lacks it."""
        missing = sorted(i for i, cols in self.cols.items() if column not in cols)
        if not missing or column in self.closed:
            return
        idx = np.array(missing, dtype=np.int64)
        with self.ctl.cond:
            self.ctl.check_update(idx, (column,))
            self.ctl.commit(Commit(indices=idx, cells=_cells(idx.size, [column]), new=False))
        before = self.ready_sets()
        for i in missing:
            self.cols[i].add(column)
        self.push_ready(missing, before)

    @rule(bad=st.integers(0, 3))
    def put_column_to_unknown_index(self, bad: int) -> None:
        candidates = [i for i in self.allocated if i not in self.cols] + [10_000 + bad, -1 - bad]
        idx = np.array([candidates[bad % len(candidates)]], dtype=np.int64)
        events = self.ctl.log.seq
        with self.ctl.cond, pytest.raises(UnknownIndexError):
            self.ctl.check_update(idx, ("a",))
        assert self.ctl.log.seq == events

    # -- consumers ------------------------------------------------------------------------
    @precondition(lambda self: self.cols or self.ended)
    @rule(
        task_no=st.integers(0, 2),
        kind=st.sampled_from(["fifo", "group", "staleness"]),
        n=st.integers(1, 5),
        partial=st.booleans(),
        eta=st.integers(0, 2),
        then=st.sampled_from(["hold", "ack", "ack", "ack-part", "release"]),
        mask=st.integers(1, 2**CAP - 1),
    )
    def claim(
        self, task_no: int, kind: str, n: int, partial: bool, eta: int, then: str, mask: int
    ) -> None:
        """Claim, then hold the lease, ack it (fully or partly) or release it."""
        self.turn += 1  # rotate over tasks: hypothesis favours small task_no
        task = pick(sorted(self.tasks), task_no + self.turn)
        queue = self.queue[task]
        if kind == "fifo":
            sampler: Any = FifoSampler()
            expected = queue[:n]
        elif kind == "staleness":
            sampler = StalenessSampler(eta)
            expected = [i for i in queue if self.version_of[i] >= self.version - eta][:n]
        else:
            n = max(n - n % GROUP_SIZE, GROUP_SIZE)
            sampler = GroupSampler(GROUP_SIZE)
            counts: dict[int, int] = {}
            for i in queue:
                counts[self.group[i]] = counts.get(self.group[i], 0) + 1
            complete = [g for g in dict.fromkeys(self.group[i] for i in queue) if g >= 0]
            complete = [g for g in complete if counts[g] == GROUP_SIZE][: n // GROUP_SIZE]
            expected = [i for i in queue if self.group[i] in complete]
        min_n = 1 if partial else None
        need = min_n or n
        final = self.nothing_more(task)
        with self.ctl.cond:
            try:
                meta = self.ctl.try_claim(Claim(task=task, n=n, min_n=min_n), sampler)
            except EndOfStream:
                assert final, "EndOfStream although a sample could still become ready"
                assert not expected
                assert not self.leased(task)
                return
        if meta is None:
            if final:  # only an outstanding lease may still return samples
                assert not expected and self.leased(task)
            else:
                assert len(expected) < need
            return
        got = meta.indices.tolist()
        if not final:
            assert len(expected) >= need
        assert got == expected
        assert meta.task == task
        assert meta.columns == self.tasks[task]
        for i in got:
            assert i not in self.consumed[task], "claimed a sample the task already acked"
            assert i not in self.leased(task), "claimed a sample the task holds a lease on"
            assert set(self.tasks[task]) <= self.cols[i], "claimed before its columns were ready"
        if kind == "staleness":
            assert (meta.versions >= self.version - eta).all()
        if kind == "group":
            _, group_counts = np.unique(meta.groups, return_counts=True)
            assert (group_counts == GROUP_SIZE).all()
            assert (meta.groups >= 0).all()
        self.leases[meta.lease] = (task, got)
        self.queue[task] = [i for i in queue if i not in set(got)]
        if then == "ack":
            self.do_ack(meta.lease, True, mask)
        elif then == "ack-part":
            self.do_ack(meta.lease, False, mask)
        elif then == "release":
            self.do_release(meta.lease)

    @precondition(lambda self: self.leases)
    @rule(lease_no=st.integers(0, 7), full=st.booleans(), mask=st.integers(1, 2**CAP - 1))
    def ack(self, lease_no: int, full: bool, mask: int) -> None:
        self.do_ack(pick(sorted(self.leases), lease_no), full, mask)

    def do_ack(self, lid: int, full: bool, mask: int) -> None:
        task, idx = self.leases[lid]
        done = list(idx) if full else pick_subset(idx, mask)
        with self.ctl.cond:
            evicted = self.ctl.ack(task, lid, None if full else np.array(done, dtype=np.int64))
        self.consumed[task].update(done)
        rest = [i for i in idx if i not in set(done)]
        if rest:
            self.leases[lid] = (task, rest)
        else:
            del self.leases[lid]
            self.settled.append((task, lid))
        now_done = {i for i in done if all(i in c for c in self.consumed.values())}
        assert set(evicted.tolist()) == now_done, "evicted exactly the samples every task acked"
        for i in now_done:
            assert i not in self.evicted
            self.evicted.add(i)
            del self.cols[i]

    @precondition(lambda self: self.leases)
    @rule(lease_no=st.integers(0, 7))
    def release(self, lease_no: int) -> None:
        self.do_release(pick(sorted(self.leases), lease_no))

    def do_release(self, lid: int) -> None:
        task, _ = self.leases[lid]
        with self.ctl.cond:
            self.ctl.release(task, lid)
        self.return_lease(lid)

    @precondition(lambda self: self.leases)
    @rule()
    def expire_all(self) -> None:
        with self.ctl.cond:
            count = self.ctl.expire(now=FAR_FUTURE)
        assert count == len(self.leases)
        for lid in sorted(self.leases):  # deadlines follow claim order: oldest returns first
            self.return_lease(lid)

    @precondition(lambda self: self.settled)
    @rule(lease_no=st.integers(0, 7), what=st.sampled_from(["ack", "release"]))
    def settle_again(self, lease_no: int, what: str) -> None:
        task, lid = pick(self.settled, lease_no)
        events = self.ctl.log.seq
        with self.ctl.cond, pytest.raises(LeaseError, match=str(lid)):
            if what == "ack":
                self.ctl.ack(task, lid)
            else:
                self.ctl.release(task, lid)
        assert self.ctl.log.seq == events

    @precondition(lambda self: self.leases)
    @rule(lease_no=st.integers(0, 7))
    def ack_with_foreign_task(self, lease_no: int) -> None:
        lid = pick(sorted(self.leases), lease_no)
        owner, _ = self.leases[lid]
        other = next(t for t in sorted(self.tasks) if t != owner)
        events = self.ctl.log.seq
        with self.ctl.cond, pytest.raises(LeaseError):
            self.ctl.ack(other, lid)
        assert self.ctl.log.seq == events

    # (two tasks left: a foreign task exists; some sample waits for one task only, or
    # hypothesis mostly tries it before any ack, when it can evict nothing)
    @precondition(lambda self: len(self.tasks) > 2 and any(map(self.held_by, self.tasks)))
    @rule(k=st.integers(0, 2))
    def unregister_task(self, k: int) -> None:
        # k == 0: the task that alone holds the most samples (its unregister evicts them)
        task = pick(sorted(self.tasks), k) if k else max(sorted(self.tasks), key=self.held_by)
        events = self.ctl.log.seq
        if self.leased(task):
            with self.ctl.cond, pytest.raises(LeaseError, match="ack or release them first"):
                self.ctl.unregister_task(task)
            assert self.ctl.log.seq == events
            return
        with self.ctl.cond:
            evicted = self.ctl.unregister_task(task)
        del self.tasks[task], self.consumed[task], self.queue[task]
        self.settled = [s for s in self.settled if s[0] != task]
        now_done = {i for i in self.cols if all(i in c for c in self.consumed.values())}
        assert set(evicted.tolist()) == now_done, "evicted what only the task held"
        for i in now_done:
            self.evicted.add(i)
            del self.cols[i]

    @rule()
    def publish_version(self) -> None:
        with self.ctl.cond:
            self.ctl.publish_version(self.version + 1)
        self.version += 1

    @precondition(lambda self: not self.ended and len(self.allocated) >= 4)
    @rule(columns=st.lists(st.sampled_from(COLUMNS), max_size=2, unique=True))
    def end_stream(self, columns: list[str]) -> None:
        with self.ctl.cond:
            self.ctl.end_stream(tuple(columns))
        self.ended = True
        self.closed.update(columns)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def events_have_increasing_seq(self) -> None:
        seqs = [e.seq for e in self.ctl.log.history]
        assert all(b > a for a, b in itertools.pairwise(seqs))
        assert not seqs or seqs[-1] == self.ctl.log.seq

    @invariant()
    def evicted_exactly_once_after_every_task_acked(self) -> None:
        seen: list[int] = []
        for e in self.ctl.log.history:
            if isinstance(e, Evicted):
                seen += e.indices
        assert len(seen) == len(set(seen)), "a sample was evicted twice"
        assert set(seen) == self.evicted
        for i in self.evicted:
            assert all(i in c for c in self.consumed.values())

    @invariant()
    def none_lost(self) -> None:
        t = self.ctl.table
        assert t.live == len(self.cols)
        for i in self.allocated:
            slot = i % CAP
            if i in self.cols:
                assert t.owner[slot] == i and t.committed[slot]
            else:  # evicted, or reserved and aborted: gone from the table
                assert t.owner[slot] != i
        for task, state in self.ctl.tasks.items():
            leased = self.leased(task)
            for i in self.cols:
                slot = i % CAP
                if i in self.consumed[task]:
                    want = CONSUMED
                elif i in leased:
                    want = LEASED
                elif set(self.tasks[task]) <= self.cols[i]:
                    want = READY
                else:
                    want = PENDING
                assert state.status[slot] == want, (task, i, state.status[slot], want)
            assert state.queue.view().tolist() == self.queue[task]
            assert state.consumed_total == len(self.consumed[task])

    @invariant()
    def at_most_one_live_lease_per_task_and_sample(self) -> None:
        held: set[tuple[str, int]] = set()
        live = self.ctl.leases.live
        assert set(live) == set(self.leases)
        for lid, lease in live.items():
            assert lease.task == self.leases[lid][0]
            assert lease.indices.tolist() == self.leases[lid][1]
            for i in lease.indices.tolist():
                assert (lease.task, i) not in held
                held.add((lease.task, i))

    @invariant()
    def statistics_agree(self) -> None:
        s = self.ctl.statistics()
        assert s.live == len(self.cols)
        assert s.reserved == 0
        assert s.leases == len(self.leases)
        assert s.version == self.version
        assert s.ended == self.ended
        for task in self.tasks:
            assert s.tasks[task].ready == len(self.queue[task])
            assert s.tasks[task].leased == len(self.leased(task))
            assert s.tasks[task].consumed == len(self.consumed[task])

    @invariant()
    def journal_replay_is_exact(self) -> None:
        twin = Controller(CAP, n_units=1, lease_timeout=1e6)
        applied = twin.recover(event_decoder.decode(b) for b in self.journal)
        assert applied == len(self.journal)
        assert state_of(twin) == state_of(self.ctl)


ControllerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestController = ControllerMachine.TestCase


def state_of(ctl: Controller) -> dict[str, Any]:
    """Everything a controller's behaviour depends on, as comparable plain values."""
    t = ctl.table
    arrays = ("owner", "committed", "partition", "group", "version", "tokens", "unit")
    live = t.owner >= 0
    return {
        "table": {a: getattr(t, a)[live].tolist() for a in arrays},
        "ready": {c: r[live].tolist() for c, r in t.ready.items()},
        "nbytes": {c: b[live].tolist() for c, b in t.nbytes.items()},
        "live": t.live,
        "tasks": {
            name: (
                st.columns,
                st.missing[live].tolist(),
                st.status[live].tolist(),
                st.queue.view().tolist(),
                st.consumed_total,
            )
            for name, st in ctl.tasks.items()
        },
        "leases": {
            lid: (le.task, le.indices.tolist(), le.deadline, le.dp_rank, le.taken, le.consumer)
            for lid, le in ctl.leases.live.items()
        },
        "rounds": {
            task: [[p.id if p else None for p in r.by_rank] for r in rounds]
            for task, rounds in ctl.rounds.by_task.items()
            if rounds
        },
        "version": ctl.version,
        "ended": ctl.ended,
        "closed": sorted(ctl.closed_columns),
        "seq": ctl.log.seq,
        "declared": ctl.declared,
        "next_index_at_least": t.next_index >= max(t.owner.max() + 1, 0),
        "partitions": ctl.partitions,
        "reserved": ctl.reservations.count,
    }

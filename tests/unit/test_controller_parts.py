"""The objects the controller composes, each on its own: leases and their deadlines,
balanced rounds, reservations, and which waiters a change wakes."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl._controller.eventlog import EventLog
from flowrl._controller.leases import Leases
from flowrl._controller.reservations import Reservations
from flowrl._controller.rounds import Rounds
from flowrl._controller.table import SampleTable
from flowrl._controller.tasks import LEASED, READY, TaskState
from flowrl._controller.wake import EVERYONE, NOBODY
from flowrl._controller.waking import Waiters
from flowrl.errors import LeaseError
from flowrl.events import Claimed, LeaseExpired, LeaseTaken, Released

CAP = 16


def _leases() -> tuple[Leases, TaskState, EventLog]:
    log = EventLog()
    state = TaskState("train", ("x",), CAP)
    tasks = {"train": state}

    def emit(cls: type, **fields: object) -> None:
        log.append(cls(seq=log.next_seq(), t=0.0, **fields))

    return Leases(tasks, CAP, emit), state, log


def _ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_only_live_leases_past_their_current_deadline_come_due() -> None:
    leases, state, log = _leases()
    settled = leases.open(state, _ids(0), 1.0, "")
    renewed = leases.open(state, _ids(1), 2.0, "", reserved=True)
    due = leases.open(state, _ids(2), 3.0, "")
    later = leases.open(state, _ids(3), 9.0, "")
    leases.consume(settled, settled.indices, whole=True)
    leases.take(renewed, 8.0)  # its entry at 2.0 is stale now
    assert leases.next_deadline() == 2.0  # (a stale entry may only make it early)
    assert leases.due == 2.0  # what the controller checks before looking further
    assert leases.pop_due(5.0) is due
    assert leases.pop_due(5.0) is None and leases.due == 8.0
    leases.expire(due)
    assert state.status[2] == READY and state.queue.view().tolist() == [2]
    assert leases.pop_due(8.5) is renewed
    assert set(leases.live) == {renewed.id, later.id}
    assert [type(e) for e in log.history] == [Claimed] * 4 + [LeaseTaken, LeaseExpired]


def test_a_lease_is_found_by_its_own_task_only_and_ends_with_its_last_sample() -> None:
    leases, state, _ = _leases()
    lease = leases.open(state, _ids(4, 5), 1.0, "w")
    assert (state.status[[4, 5]] == LEASED).all()
    with pytest.raises(LeaseError, match="lease 1 of task 'score' is unknown"):
        leases.get("score", lease.id, "ack")
    with pytest.raises(LeaseError, match="expects an int lease id"):
        leases.get("train", True, "ack")  # type: ignore[arg-type]
    leases.consume(lease, _ids(4), whole=False)
    assert leases.get("train", lease.id, "ack").indices.tolist() == [5]
    assert leases.held_by_others("train") and not leases.held_by_others("train", "w")
    leases.consume(lease, _ids(5), whole=False)
    assert not leases.live


def test_a_released_lease_puts_its_samples_first_in_line() -> None:
    leases, state, log = _leases()
    state.queue.push_back(_ids(7, 8))
    lease = leases.open(state, _ids(3, 4), 1.0, "")
    leases.release(lease)
    assert state.queue.view().tolist() == [3, 4, 7, 8]
    assert isinstance(log.history[-1], Released) and not leases.live


def test_a_round_hands_each_rank_its_part_oldest_round_first() -> None:
    leases, state, _ = _leases()
    rounds = Rounds(leases)
    chosen = _ids(0, 1, 2, 3)
    first = rounds.deal(state, chosen, [_ids(0, 1), _ids(2, 3)], 5.0, "", 0, 2)
    second = rounds.deal(state, chosen + 4, [_ids(0), _ids(1, 2, 3)], 5.0, "", 0, 2)
    assert first is not None and second is not None and first.taken
    assert rounds.open_ids() == {"train": [[1, 2], [3, 4]]}
    part = rounds.take("train", 1, 10.0)
    assert part is not None and part.indices.tolist() == [2, 3] and part.taken
    assert rounds.open_ids() == {"train": [[3, 4]]}
    assert rounds.take("train", 0, 10.0) is None  # rank 0 took its parts when dealing
    leases.expire(leases.live[4])  # a waiting part that expired waits no more
    rounds.prune("train")
    assert rounds.open_ids() == {"train": []} and rounds.take("train", 1, 10.0) is None


def test_a_rank_without_samples_gets_no_part() -> None:
    leases, state, _ = _leases()
    rounds = Rounds(leases)
    mine = rounds.deal(state, _ids(0), [_ids(), _ids(0)], 5.0, "", 0, 2)
    assert mine is None and rounds.open_ids() == {"train": [[0, 1]]}


def test_reservations_expire_uncommitted_indices_only() -> None:
    table = SampleTable(CAP)
    res = Reservations(table)
    a = table.allocate(4)
    res.hold(a, 2, deadline=1.0)  # two for the put, two reserved ahead
    b = table.allocate(2)
    res.hold(b, 2, deadline=5.0)
    assert (res.count, res.ahead) == (6, 2)
    table.committed[a[:2] % CAP] = True
    res.committed(a[:2] % CAP)
    assert res.next_deadline() == 1.0 == res.due
    assert res.expire(2.0) == 1  # the put's entry holds nothing any more; its pool is freed
    assert res.due == 5.0
    assert (res.count, res.ahead, table.live) == (2, 0, 4)
    assert res.release(b) == 2 and res.release(b) == 0
    assert res.next_deadline() is None  # nothing reserved: the remaining entry is dropped
    assert res.due == float("inf")


def test_reclaiming_ahead_frees_the_pools_not_the_puts() -> None:
    table = SampleTable(CAP)
    res = Reservations(table)
    res.hold(table.allocate(5), 2, deadline=1.0)
    assert res.reclaim_ahead() == 3
    assert (res.count, res.ahead, table.live) == (2, 0, 2)
    assert res.reclaim_ahead() == 0


def test_waiters_are_woken_by_events_and_by_eventless_changes() -> None:
    log = EventLog()
    waiters = Waiters(log, {"train": TaskState("train", ("x",), CAP)})
    mark = waiters.mark()
    assert waiters.woken_since(mark, ended=False) == NOBODY
    log.append(Released(seq=log.next_seq(), t=0.0, task="train", lease=1, indices=(0,)))
    wake = waiters.woken_since(mark, ended=False)
    assert wake.claim("train") and not wake.claim("score") and not wake.room
    assert waiters.woken_since(mark, ended=True) == EVERYONE
    mark = waiters.mark()
    with waiters.cond:
        waiters.notify(ended=False, everyone=True)
    assert waiters.woken_since(mark, ended=False) == EVERYONE
    assert waiters.claim_cond("train") is waiters.claim_cond("train")

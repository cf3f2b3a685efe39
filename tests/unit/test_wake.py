"""Which waiting claims and puts a batch of events may let proceed: a put costs the
controller the waiters of the tasks that read its columns, not every waiter."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from flowrl import Column
from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler
from flowrl._controller.wake import EVERYONE, NOBODY, Wake, woken
from flowrl._protocol.commands import Cell, Claim, Commit
from flowrl.events import (
    Acked,
    Claimed,
    ColumnsDeclared,
    Event,
    Evicted,
    IndexWatermark,
    LeaseExpired,
    LeaseTaken,
    Put,
    Released,
    StreamEnded,
    TaskRegistered,
    VersionPublished,
)

TASKS = {"score": ("ids",), "train": ("ids", "reward"), "judge": ("verdict",)}


def put(*columns: str) -> Put:
    return Put(seq=1, t=0.0, indices=(0,), columns=columns)


def test_a_put_wakes_the_tasks_that_read_one_of_its_columns() -> None:
    assert woken([put("reward")], TASKS) == Wake(frozenset({"train"}), False)
    assert woken([put("ids", "reward")], TASKS) == Wake(frozenset({"score", "train"}), False)
    assert woken([put("unread")], TASKS) == NOBODY


@pytest.mark.parametrize(
    "event",
    [
        Claimed(seq=1, t=0.0, task="judge", lease=1, indices=(0,)),
        LeaseTaken(seq=1, t=0.0, task="judge", lease=1, deadline=0.0),
        Acked(seq=1, t=0.0, task="judge", lease=1, indices=(0,)),
        Released(seq=1, t=0.0, task="judge", lease=1, indices=(0,)),
        LeaseExpired(seq=1, t=0.0, task="judge", lease=1, indices=(0,)),
    ],
)
def test_a_lease_event_wakes_its_own_task(event: Event) -> None:
    assert woken([event], TASKS) == Wake(frozenset({"judge"}), False)


def test_an_eviction_frees_room_for_waiting_puts_only() -> None:
    assert woken([Evicted(seq=1, t=0.0, indices=(0,))], TASKS) == Wake(frozenset(), True)


@pytest.mark.parametrize(
    "event",
    [
        VersionPublished(seq=1, t=0.0, version=2),  # staleness windows move
        StreamEnded(seq=1, t=0.0),
        TaskRegistered(seq=1, t=0.0, task="new", columns=("ids",)),
        ColumnsDeclared(seq=1, t=0.0, columns=()),
        IndexWatermark(seq=1, t=0.0, next=10),
    ],
)
def test_any_other_event_wakes_everyone(event: Event) -> None:
    assert woken([put("reward"), event], TASKS) is EVERYONE


def test_a_batch_wakes_the_union() -> None:
    events = [
        put("reward"),
        Acked(seq=2, t=0.0, task="score", lease=1, indices=(0,)),
        Evicted(seq=3, t=0.0, indices=(0,)),
    ]
    assert woken(events, TASKS) == Wake(frozenset({"train", "score"}), True)
    assert woken([], TASKS) == NOBODY


def test_which_claims_a_wake_admits() -> None:
    assert EVERYONE.claim("anything") and EVERYONE.room
    assert not NOBODY.claim("train") and not NOBODY.room
    assert Wake(frozenset({"train"}), False).claim("train")
    assert not Wake(frozenset({"train"}), False).claim("score")


# -- the in-process controller wakes the waiters those rules name --------------------------
@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> tuple[Controller, list[str]]:
    """A controller whose tasks 'a' (reads x) and 'b' (reads y) each have a claim waiting,
    recording which conditions are notified ('room': puts waiting for room)."""
    ctl = Controller(capacity=16)
    ctl.add_columns((Column.scalar("x", "int64"), Column.scalar("y", "int64")))
    ctl.register_task("a", ("x",))
    ctl.register_task("b", ("y",))
    notified: list[str] = []
    for task in ("a", "b"):
        monkeypatch.setattr(ctl.claim_cond(task), "notify_all", lambda t=task: notified.append(t))
    monkeypatch.setattr(ctl.cond, "notify_all", lambda: notified.append("room"))
    with ctl.cond:  # set-up events (columns, tasks, the first index watermark) wake everyone
        ctl.abort(ctl.reserve(1)[0])
    notified.clear()
    return ctl, notified


def _put(ctl: Controller, column: str, n: int = 1) -> np.ndarray:
    indices, _ = ctl.reserve(n)
    ctl.commit(
        Commit(indices=indices, cells={column: Cell(np.full(n, 8, dtype=np.int64))}, new=True)
    )
    return indices


def test_a_put_notifies_the_claims_of_the_tasks_reading_it(controller) -> None:
    ctl, notified = controller
    with ctl.cond:
        _put(ctl, "x")
        assert notified == ["a"]
        notified.clear()
        _put(ctl, "y")
        assert notified == ["b"]


def test_an_ack_that_evicts_notifies_its_task_and_waiting_puts(controller) -> None:
    ctl, notified = controller
    with ctl.cond:
        indices = _put(ctl, "x")
        ctl.commit(
            Commit(indices=indices, cells={"y": Cell(np.full(1, 8, dtype=np.int64))}, new=False)
        )
        lease_a = ctl.try_claim(Claim(task="a", n=1), FifoSampler())
        lease_b = ctl.try_claim(Claim(task="b", n=1), FifoSampler())
        assert lease_a is not None and lease_b is not None
        ctl.ack("a", lease_a.lease)
        notified.clear()
        ctl.ack("b", lease_b.lease)  # the last task: the sample is evicted
        assert sorted(notified) == ["b", "room"]


@pytest.mark.parametrize(
    "change",
    [
        lambda ctl: ctl.publish_version(1),
        lambda ctl: ctl.end_stream(),
        lambda ctl: ctl.abort(ctl.reserve(1)[0]),  # room freed without an event
        lambda ctl: ctl.close(),
    ],
)
def test_other_changes_notify_everyone(controller, change: Callable[[Controller], None]) -> None:
    ctl, notified = controller
    with ctl.cond:
        change(ctl)
    assert sorted(set(notified)) == ["a", "b", "room"]


def test_after_end_of_stream_any_change_notifies_everyone(controller) -> None:
    ctl, notified = controller
    with ctl.cond:
        indices, _ = ctl.reserve(1)
        ctl.end_stream()
        notified.clear()
        ctl.commit(
            Commit(indices=indices, cells={"x": Cell(np.full(1, 8, dtype=np.int64))}, new=True)
        )
    assert sorted(notified) == ["a", "b", "room"]  # 'b' may now end: nothing more can come

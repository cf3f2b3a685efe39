"""Which waiting claims and puts a batch of events may let proceed: a put costs the
controller the waiters of the tasks that read its columns, not every waiter."""

from __future__ import annotations

import pytest

from flowrl._controller.wake import EVERYONE, NOBODY, Wake, woken
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

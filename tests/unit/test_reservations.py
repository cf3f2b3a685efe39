"""A producer that dies between reserve and commit leaves no sample and holds no capacity."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler
from flowrl._protocol.commands import Cell, Claim, Commit
from flowrl._schema.columns import Column
from flowrl.errors import EndOfStream, SchemaError, UnknownIndexError


@pytest.fixture
def ctl():
    """A controller, used as the hub uses it: under its condition's lock."""
    controller = Controller(capacity=4, lease_timeout=5.0)
    controller.add_columns((Column.scalar("x", "int64"),))
    controller.register_task("t", ("x",))
    with controller.cond:
        yield controller


def _cells(n: int) -> dict[str, Cell]:
    return {"x": Cell(np.full(n, 8, dtype=np.int64))}


def test_uncommitted_reservation_expires_and_frees_its_slots(ctl: Controller) -> None:
    dead, _ = ctl.reserve(3)  # the producer dies here, before commit
    assert ctl.table.free_slots() == 1
    ctl.expire(now=time.time() + 60)
    assert ctl.table.free_slots() == 4 and ctl.statistics().reserved == 0
    with pytest.raises(UnknownIndexError):  # a late commit of the dead reservation
        ctl.commit(Commit(indices=dead, cells=_cells(3), new=True))
    ctl.abort(dead)  # and its abort are harmless
    assert ctl.table.free_slots() == 4


def test_end_of_stream_is_not_held_up_by_a_dead_reservation(ctl: Controller) -> None:
    live, _ = ctl.reserve(1)
    ctl.commit(Commit(indices=live, cells=_cells(1), new=True))
    ctl.reserve(2)  # never committed
    ctl.end_stream()
    meta = ctl.try_claim(Claim(task="t", n=4, min_n=1), FifoSampler())
    assert meta is not None and meta.indices.tolist() == live.tolist()
    ctl.ack("t", meta.lease)
    assert (
        ctl.try_claim(Claim(task="t", n=1), FifoSampler()) is None
    )  # the reservation might still commit
    assert ctl.next_deadline() is not None  # waiters wake when it expires
    ctl.expire(now=time.time() + 60)
    with pytest.raises(EndOfStream):
        ctl.try_claim(Claim(task="t", n=1), FifoSampler())


def test_committed_reservations_do_not_expire(ctl: Controller) -> None:
    idx, _ = ctl.reserve(2)
    ctl.commit(Commit(indices=idx, cells=_cells(2), new=True))
    ctl.expire(now=time.time() + 60)
    assert ctl.table.live == 2 and ctl.statistics().tasks["t"].ready == 2


def test_indices_reserved_ahead_take_only_free_room_and_are_counted_apart() -> None:
    ctl = Controller(capacity=8, n_units=2, lease_timeout=5.0)
    ctl.add_columns((Column.scalar("x", "int64"),))
    ctl.register_task("t", ("x",))
    with ctl.cond:
        first, unit = ctl.reserve(1, ahead=16)  # only 7 more fit
        assert first.size == 8 and ctl.table.free_slots() == 0
        # spread over the units the way one put after another would have been
        assert ctl.table.unit[first].tolist() == [0, 1, 0, 1, 0, 1, 0, 1] and unit == 0
        stats = ctl.statistics()
        assert (stats.live, stats.reserved, stats.reserved_ahead) == (1, 1, 7)
        ctl.commit(
            Commit(indices=first[:2], cells=_cells(2), new=True)
        )  # the put, and one from the pool
        ctl.abort(first[2:3])
        stats = ctl.statistics()
        assert (stats.live, stats.reserved, stats.reserved_ahead) == (2, 0, 5)
        ctl.expire(now=time.time() + 60)  # a producer that died holds nothing for long
        stats = ctl.statistics()
        assert (stats.live, stats.reserved_ahead, ctl.table.free_slots()) == (2, 0, 6)


def test_a_pooled_reservation_is_held_once_and_expires_like_others(ctl: Controller) -> None:
    # (a batched put's commit reserves the next put's indices, all of them "ahead")
    for _ in range(3):
        idx, _ = ctl.reserve(1, pooled=True)
    assert len(ctl.reservations._held) == 3  # one record each, none empty
    stats = ctl.statistics()
    assert (stats.reserved, stats.reserved_ahead) == (0, 3)
    ctl.commit(Commit(indices=idx, cells=_cells(1), new=True))
    ctl.expire(now=time.time() + 60)
    stats = ctl.statistics()
    assert (stats.live, stats.reserved, stats.reserved_ahead) == (1, 0, 0)


def test_end_of_stream_frees_indices_reserved_ahead_but_waits_for_puts(ctl) -> None:
    put, _ = ctl.reserve(1, ahead=2)
    ctl.end_stream()
    assert ctl.statistics().reserved_ahead == 0 and ctl.statistics().reserved == 1
    with pytest.raises(UnknownIndexError):
        ctl.commit(Commit(indices=put[1:], cells=_cells(2), new=True))  # what the pool held is gone
    ctl.commit(Commit(indices=put[:1], cells=_cells(1), new=True))  # the put in flight still lands
    meta = ctl.try_claim(Claim(task="t", n=1), FifoSampler())
    assert meta is not None and meta.indices.tolist() == put[:1].tolist()
    ctl.ack("t", meta.lease)
    with pytest.raises(EndOfStream):
        ctl.try_claim(Claim(task="t", n=1), FifoSampler())


def test_reclaiming_indices_reserved_ahead_frees_them_but_not_puts_in_flight(ctl) -> None:
    put, _ = ctl.reserve(1, ahead=3)  # the hub is full now
    assert ctl.table.free_slots() == 0
    assert ctl.reclaim_ahead() == 3  # what a full hub does before a put waits for room
    assert ctl.statistics().reserved_ahead == 0 and ctl.table.free_slots() == 3
    with pytest.raises(UnknownIndexError):
        ctl.commit(
            Commit(indices=put[1:2], cells=_cells(1), new=True)
        )  # the pool's owner reserves afresh
    ctl.commit(Commit(indices=put[:1], cells=_cells(1), new=True))  # the put in flight still lands
    assert ctl.reclaim_ahead() == 0 and ctl.table.live == 1


def test_a_commit_to_existing_samples_checks_what_check_update_checks(ctl) -> None:
    """A remote client writes to a claim's samples without asking check_update first: the
    commit refuses a repeated index or a closed column, and changes nothing."""
    idx, _ = ctl.reserve(2)
    ctl.commit(Commit(indices=idx, cells=_cells(2), new=True))
    with pytest.raises(SchemaError, match="names an index twice"):
        ctl.commit(Commit(indices=idx[[0, 0]], cells=_cells(2), new=False))
    ctl.end_stream(("x",))
    events = ctl.log.seq
    with pytest.raises(SchemaError, match="closed by end_stream"):
        ctl.commit(Commit(indices=idx, cells=_cells(2), new=False))
    assert ctl.log.seq == events and ctl.statistics().tasks["t"].ready == 2

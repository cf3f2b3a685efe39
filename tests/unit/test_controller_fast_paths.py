"""The controller's shortcuts for the usual small operations, each next to the case it
must hand to the general path: byte checks of masks, a reservation's slots as a slice,
a whole-lease ack, eviction when every task (or none) consumed a sample, readiness on an
update, and the tuples events reuse."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler
from flowrl._controller.table import SampleTable, _no_negative, all_set, all_zero, any_set
from flowrl._protocol.commands import Cell, Claim, Commit, LeaseRef
from flowrl._schema.columns import Column
from flowrl.errors import LeaseError, SchemaError, UnknownIndexError
from flowrl.events import Acked, Claimed, Evicted, Put

FIFO = FifoSampler()


def _controller(capacity: int = 8, tasks: dict[str, tuple[str, ...]] | None = None) -> Controller:
    ctl = Controller(capacity)
    ctl.add_columns((Column.scalar("a", "int64"), Column.scalar("b", "int64")))
    for task, columns in (tasks or {"t": ("a",)}).items():
        ctl.register_task(task, columns)
    return ctl


def _cells(n: int, *columns: str) -> dict[str, Cell]:
    return {c: Cell(np.full(n, 8, dtype=np.int64)) for c in columns}


def _put(ctl: Controller, n: int, *columns: str) -> np.ndarray:
    indices, _ = ctl.reserve(n)
    ctl.commit(Commit(indices=indices, cells=_cells(n, *columns), new=True))
    return indices


def _events(ctl: Controller, kind: type) -> list:
    return [e for e in ctl.log.history if isinstance(e, kind)]


def test_mask_byte_checks_agree_with_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 64):
        for _ in range(20):
            mask = rng.random(n) < 0.8
            values = rng.integers(-1, 2, size=n).astype(np.int16)
            assert all_set(mask) == bool(mask.all())
            assert any_set(mask) == bool(mask.any())
            assert all_zero(values) == (not values.any())


def test_run_slots_is_a_slice_only_for_a_run_that_does_not_wrap() -> None:
    table = SampleTable(8)
    assert table.run_slots(np.arange(2, 6, dtype=np.int64)) == slice(2, 6)
    assert table.run_slots(np.arange(10, 13, dtype=np.int64)) == slice(2, 5)
    wrapped = table.run_slots(np.arange(6, 10, dtype=np.int64))
    assert isinstance(wrapped, np.ndarray) and wrapped.tolist() == [6, 7, 0, 1]
    gap = table.run_slots(np.array([1, 3, 4], dtype=np.int64))
    assert isinstance(gap, np.ndarray) and gap.tolist() == [1, 3, 4]


def test_a_reservation_across_the_end_of_the_ring_lands_in_its_own_slots() -> None:
    ctl = _controller(capacity=8)
    with ctl.cond:
        first = _put(ctl, 6, "a")
        ctl.ack("t", ctl.try_claim(Claim(task="t", n=6), FIFO).lease)  # frees slots 0-5
        wrapped, _ = ctl.reserve(4)  # indices 6..9: slots 6, 7, 0, 1
        assert wrapped.tolist() == [6, 7, 8, 9] and first.tolist() == list(range(6))
        ctl.commit(Commit(indices=wrapped, cells=_cells(4, "a"), new=True))
        meta = ctl.try_claim(Claim(task="t", n=4), FIFO)
    assert meta is not None and meta.indices.tolist() == [6, 7, 8, 9]
    assert ctl.table.owner.tolist() == [8, 9, -1, -1, -1, -1, 6, 7]


def test_a_new_put_naming_index_minus_one_is_refused_while_the_last_slot_is_free() -> None:
    ctl = _controller(capacity=8)
    with ctl.cond:
        indices, _ = ctl.reserve(2)
        bad = np.array([indices[0], -1], dtype=np.int64)
        with pytest.raises(UnknownIndexError, match="-1"):
            ctl.commit(Commit(indices=bad, cells=_cells(2, "a"), new=True))
    assert not ctl.table.committed.any() and not _events(ctl, Put)


@pytest.mark.parametrize("indices", [[0, 0], [1, 0, 1], [2, 0, 1, 0]])
def test_an_update_naming_an_index_twice_is_refused(indices: list[int]) -> None:
    ctl = _controller()
    with ctl.cond:
        _put(ctl, 3, "a")
        seq = ctl.log.seq
        with pytest.raises(SchemaError, match="twice"):
            ctl.commit(
                Commit(indices=np.array(indices), cells=_cells(len(indices), "b"), new=False)
            )
    assert ctl.log.seq == seq and not ctl.table.ready["b"].any()


def test_a_lease_acked_with_its_indices_in_another_dtype_or_order_is_acked() -> None:
    ctl = _controller(tasks={"t": ("a",), "u": ("a",)})
    with ctl.cond:
        _put(ctl, 4, "a")
        meta = ctl.try_claim(Claim(task="t", n=4), FIFO)
        ctl.ack("t", meta.lease, meta.indices.astype(np.int32))
        other = ctl.try_claim(Claim(task="u", n=4), FIFO)
        with pytest.raises(LeaseError):
            ctl.ack("u", other.lease, np.array([0, 0, 1, 2]))
        ctl.ack("u", other.lease, other.indices[::-1].copy())
    assert not ctl.leases.live and ctl.table.live == 0


def test_an_ack_naming_its_whole_claim_in_order_is_the_whole_claims_ack() -> None:
    """It takes the whole lease's path; the same claim in another order takes the general
    one. Both leave what an ack without indices leaves."""
    outcomes = []
    for named in (None, "in order", "reversed"):
        ctl = _controller(tasks={"t": ("a",), "u": ("a",)})
        with ctl.cond:
            _put(ctl, 4, "a")
            ctl.ack("u", ctl.try_claim(Claim(task="u", n=4), FIFO).lease)
            meta = ctl.try_claim(Claim(task="t", n=4), FIFO)
            indices = {None: None, "in order": meta.indices, "reversed": meta.indices[::-1]}
            evicted = ctl.ack("t", meta.lease, indices[named])
        acked = [sorted(e.indices) for e in _events(ctl, Acked)]
        outcomes.append((sorted(evicted.tolist()), acked, ctl.table.live, len(ctl.leases.live)))
    assert outcomes[0] == outcomes[1] == outcomes[2] == ([0, 1, 2, 3], [[0, 1, 2, 3]] * 2, 0, 0)


def test_eviction_waits_for_every_task_and_frees_exactly_what_all_consumed() -> None:
    ctl = _controller(tasks={"t": ("a",), "u": ("a",)})
    with ctl.cond:
        _put(ctl, 4, "a")
        t = ctl.try_claim(Claim(task="t", n=4), FIFO)
        u = ctl.try_claim(Claim(task="u", n=4), FIFO)
        assert ctl.ack("t", t.lease, t.indices[:2]).size == 0  # u has consumed none
        assert ctl.ack("u", u.lease, u.indices[1:]).tolist() == [1]  # t acked 0 and 1 only
        assert ctl.ack("t", t.lease).tolist() == [2, 3]
        assert ctl.ack("u", u.lease).tolist() == [0]
    assert [e.indices for e in _events(ctl, Evicted)] == [(1,), (2, 3), (0,)]


def test_a_whole_ack_logs_the_claimed_indices_for_the_ack_and_the_eviction() -> None:
    ctl = _controller()
    with ctl.cond:
        _put(ctl, 3, "a")
        ctl.ack("t", ctl.try_claim(Claim(task="t", n=3), FIFO).lease)
        _put(ctl, 2, "a")
        meta = ctl.try_claim(Claim(task="t", n=2), FIFO)
        ack = LeaseRef(task="t", lease=meta.lease)  # a put that acks its claim
        ctl.commit(Commit(indices=meta.indices, cells=_cells(2, "b"), new=False, ack=ack))
    claimed = [e.indices for e in _events(ctl, Claimed)]
    assert claimed == [(0, 1, 2), (3, 4)]
    assert [e.indices for e in _events(ctl, Acked)] == claimed
    assert [e.indices for e in _events(ctl, Evicted)] == claimed


def test_an_update_makes_ready_only_the_samples_it_completes() -> None:
    ctl = _controller(tasks={"both": ("a", "b")})
    with ctl.cond:
        indices = _put(ctl, 4, "a")
        assert ctl.try_claim(Claim(task="both", n=1, min_n=1), FIFO) is None
        # out of order, half of them: exactly those two become ready, oldest first
        ctl.commit(Commit(indices=indices[[3, 1]], cells=_cells(2, "b"), new=False))
        first = ctl.try_claim(Claim(task="both", n=4, min_n=1), FIFO)
        assert first is not None and first.indices.tolist() == [1, 3]
        # again, with one already complete and leased: only the new ones queue
        ctl.commit(Commit(indices=indices[[0, 1, 2]], cells=_cells(3, "b"), new=False))
        second = ctl.try_claim(Claim(task="both", n=4, min_n=1), FIFO)
    assert second is not None and second.indices.tolist() == [0, 2]


def test_the_sign_check_agrees_with_numpy() -> None:
    for values in ([], [0], [5, -1], [-(2**63)], [2**63 - 1, 3], [256, -256, 7]):
        arr = np.array(values, dtype=np.int64)
        assert _no_negative(arr) == bool((arr >= 0).all())

"""The per-message paths take Python shortcuts for a few samples (``flowrl._schema.small``)
and numpy for more: both sides of the threshold give the same answers, and refuse the same
bad input with the same errors, changing nothing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from flowrl import Column
from flowrl._protocol import commands
from flowrl._schema.small import FEW, SMALL, all_equal, bounds, has_negative, never_decreasing
from flowrl._store.unit import StorageUnit
from flowrl._transport import wire
from flowrl._transport.frames import ArrayHeader
from flowrl._transport.pools import Pool
from flowrl.errors import TransportError, UnknownIndexError

#: Sizes on both sides of the threshold.
SIZES = [1, 2, 3, FEW, FEW + 1, SMALL - 1, SMALL, SMALL + 1, 3 * SMALL + 5]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.int16, np.int64])
def test_small_reductions_agree_with_numpy(n: int, dtype: type) -> None:
    rng = np.random.default_rng(n)
    for values in (
        rng.integers(-5, 5, size=n).astype(dtype),
        np.full(n, 3, dtype=dtype),
        np.arange(n, dtype=dtype),
    ):
        assert bounds(values) == (int(values.min()), int(values.max()))
        assert type(bounds(values)[0]) is int
        assert all_equal(values) == bool((values == values[0]).all())
        assert has_negative(values) == bool((values < 0).any())
        assert never_decreasing(values) == bool((np.diff(values) >= 0).all())
        assert never_decreasing(np.sort(values))
    assert not has_negative(np.empty(0, dtype=dtype))


def _unit() -> StorageUnit:
    return StorageUnit(0, capacity=8 * SMALL + 64)


def _write(unit: StorageUnit, indices: np.ndarray, values: np.ndarray) -> None:
    unit.write(indices, {"x": pa.array(values)}, {"x": Column.scalar("x", "int64")})


@pytest.mark.parametrize("n", SIZES)
def test_a_unit_answers_alike_for_few_and_many_samples(n: int) -> None:
    unit = _unit()
    indices = np.arange(5, 5 + n, dtype=np.int64)
    _write(unit, indices, indices * 10)
    assert unit.holds(indices)
    assert unit.read(indices, ("x",))["x"].to_pylist() == (indices * 10).tolist()
    backwards = indices[::-1].copy()  # not consecutive (for n > 1): gathered, not sliced
    assert unit.read(backwards, ("x",))["x"].to_pylist() == (backwards * 10).tolist()
    gappy = np.concatenate([indices, [indices[-1] + 2]])
    with pytest.raises(UnknownIndexError):
        unit.read(gappy, ("x",))
    with pytest.raises(UnknownIndexError, match="does not exist"):
        unit.read(np.concatenate([indices, [-1]]), ("x",))
    unit.evict(indices[-1:])
    assert not unit.holds(indices)
    assert unit.holds(indices[:-1])  # (vacuously for one sample)


@pytest.mark.parametrize("n", SIZES)
def test_a_staged_write_waits_and_a_stale_one_changes_nothing(n: int) -> None:
    unit = _unit()
    capacity = unit.capacity
    indices = np.arange(n, dtype=np.int64)
    _write(unit, indices, indices)
    unit.stage(7, indices, {"x": pa.array(indices + 100)})
    assert unit.staged(indices) and unit.staged(indices[-1:])
    assert not unit.staged(indices + n)
    assert unit.read(indices, ("x",))["x"].to_pylist() == indices.tolist()  # not filed yet
    assert unit.settle(7, True)
    assert not unit.staged(indices)
    assert unit.read(indices, ("x",))["x"].to_pylist() == (indices + 100).tolist()
    # The last sample's slot is reused by a newer index: a write of the old one is stale.
    newer = indices[-1:] + capacity
    _write(unit, newer, newer)
    with pytest.raises(UnknownIndexError, match=f"sample index {indices[-1]} was evicted"):
        _write(unit, indices, indices)
    with pytest.raises(UnknownIndexError, match="was evicted"):
        unit.stage(8, indices, {"x": pa.array(indices)})
    assert not unit.is_staged(8)
    assert unit.read(newer, ("x",))["x"].to_pylist() == newer.tolist()
    if n > 1:
        assert unit.read(indices[:-1], ("x",))["x"].to_pylist() == (indices[:-1] + 100).tolist()


def _ints(values: list[int]) -> bytes:
    return np.array(values, dtype=np.int64).tobytes()


HEADER = [ArrayHeader("x", 1, 1)]
COLUMN = Column.scalar("x", "int64")


def _unit_requests(indices: bytes) -> list[object]:
    return [
        wire.Read(indices=indices, columns=["x"]),
        wire.Discard(indices=indices, columns=["x"]),
        wire.Evict(indices=indices),
        wire.ReadPartial(indices=indices, column=Column.ragged("t", "int64")),
        wire.Retain(indices=indices, below=0),
        wire.write_request(indices, [COLUMN], HEADER),
        wire.Append(indices=indices, columns=[COLUMN], version=0, arrays=HEADER),
    ]


@pytest.mark.parametrize("n", SIZES)
def test_requests_naming_a_negative_sample_are_refused(n: int) -> None:
    fine = list(range(n))
    for msg in _unit_requests(_ints(fine)):
        assert type(wire.decode_request(wire.encode(msg))) is type(msg)
    for msg in _unit_requests(_ints([*fine[:-1], -3])):
        with pytest.raises(TransportError, match="a sample index is negative"):
            wire.decode_request(wire.encode(msg))
    for msg in _unit_requests(_ints(fine) + b"\x00"):
        with pytest.raises(TransportError, match="not a whole number of int64s"):
            wire.decode_request(wire.encode(msg))


@pytest.mark.parametrize("n", SIZES)
def test_indices_whose_high_bytes_are_set_are_not_taken_for_negative_ones(n: int) -> None:
    # (a few indices are checked by their sign bytes alone)
    big = [2**63 - 1 - k if k % 2 else (0x7F << 56) + k for k in range(n)]
    for msg in _unit_requests(_ints(big)):
        assert type(wire.decode_request(wire.encode(msg))) is type(msg)
    for msg in _unit_requests(_ints([*big[:-1], -(2**63)])):
        with pytest.raises(TransportError, match="a sample index is negative"):
            wire.decode_request(wire.encode(msg))


@pytest.mark.parametrize(
    ("msg", "problem"),
    [
        (wire.write_request(_ints([0]), [COLUMN], HEADER * 2), "a column appears twice"),
        (
            wire.Append(indices=_ints([0]), columns=[COLUMN], version=0, arrays=HEADER * 2),
            "a column appears twice",
        ),
        (
            wire.Append(indices=_ints([0]), columns=[], version=0, arrays=[]),
            "an append names no column",
        ),
        (commands.Commit(indices=np.arange(0), cells={}, new=True), "names no sample"),
        (
            commands.Commit(indices=np.arange(2), cells={}, new=True, tokens=np.array([1, -1])),
            "tokens must be >= 0",
        ),
        (
            commands.Commit(indices=np.arange(2), cells={}, new=True, groups=np.arange(3)),
            "groups does not hold one int64 for each of the 2 indices",
        ),
        (commands.Claim(task="t", n=2, min_n=3), "min_n=3 exceeds n=2"),
    ],
)
def test_each_request_kind_gets_its_own_checks(msg: object, problem: str) -> None:
    with pytest.raises(TransportError, match=problem):
        wire.decode_request(wire.encode(msg))


@pytest.mark.parametrize("per_index", [False, True])
def test_a_pool_of_one_unit_hands_out_its_indices_in_order(per_index: bool) -> None:
    indices = np.arange(100, 110, dtype=np.int64)
    units = np.full(10, 3, dtype=np.int16) if per_index else 3
    pool = Pool(indices, units, until=float("inf"))
    assert pool.left() == 10
    taken = pool.take(4)
    assert taken is not None and taken[0].tolist() == [100, 101, 102, 103] and taken[1] == 3
    taken = pool.take(1)
    assert taken is not None and taken[0].tolist() == [104]
    assert pool.take(6) is None and pool.left() == 5  # not enough: nothing taken
    assert pool.rest().tolist() == [105, 106, 107, 108, 109]
    assert pool.left() == 0 and pool.take(1) is None and pool.rest().size == 0


def test_a_pool_over_several_units_hands_out_one_units_indices_at_a_time() -> None:
    pool = Pool(np.arange(10, 16), np.array([1, 1, 2, 2, 1, 2], dtype=np.int16), until=1e9)
    first = pool.take(2)
    assert first is not None and first[0].tolist() == [10, 11] and first[1] == 1
    second = pool.take(3)  # the oldest left is on unit 2: three of unit 2's
    assert second is not None and second[0].tolist() == [12, 13, 15] and second[1] == 2
    assert pool.take(2) is None and pool.left() == 1  # one of unit 1's left
    assert pool.rest().tolist() == [14]

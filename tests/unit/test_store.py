"""StorageUnit invariants (see the docstring of ``flowrl._store.unit``).

* a read returns exactly the bytes last written for each requested index, in request order,
  through the contiguous zero-copy path and the gather path across chunks;
* reading an index that was evicted or never written raises UnknownIndexError, even after
  its slot was reused by a newer index;
* a chunk is freed once every row in it was evicted or overwritten.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowrl
from flowrl import Column
from flowrl._schema.encode import encode
from flowrl._store.unit import Deferred, StorageUnit
from flowrl.errors import UnknownColumnError, UnknownIndexError

CAP = 8
IDS = Column.ragged("ids", "int64")
SCORE = Column.scalar("score", "float32")
PIX = Column.tensor("pix", "int16", (2, 3))
TEXT = Column.string("text")


def _arrays(indices: np.ndarray) -> dict[str, pa.Array]:
    """Column values derived from the sample index, so a read can be checked exactly."""
    n = len(indices)
    ids = [np.arange(int(i) % 5, dtype=np.int64) + 100 * int(i) for i in indices]
    score = indices.astype(np.float32) / 2
    pix = np.stack([np.full((2, 3), int(i), dtype=np.int16) for i in indices])
    text = [f"s{int(i)}" for i in indices]
    return {
        "ids": encode(IDS, ids, n, "test").array,
        "score": encode(SCORE, score, n, "test").array,
        "pix": encode(PIX, pix, n, "test").array,
        "text": encode(TEXT, text, n, "test").array,
    }


def _check(out: dict[str, pa.Array], indices: np.ndarray) -> None:
    want = _arrays(indices)
    for name, arr in out.items():
        assert len(arr) == len(indices), name
        assert arr.to_pylist() == want[name].to_pylist(), name


COLS = ("ids", "score", "pix", "text")


def test_contiguous_read_is_zero_copy_slice_of_the_chunk() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(6, dtype=np.int64)
    arrays = _arrays(idx)
    unit.write(idx, arrays)
    out = unit.read(idx[1:5], COLS)
    _check(out, idx[1:5])
    # zero-copy: the scalar column's data buffer is the written one, at an offset
    written = arrays["score"].buffers()[1]
    read = out["score"].buffers()[1]
    assert read.address == written.address
    assert out["score"].offset == 1


def test_read_in_request_order_within_one_chunk() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(6, dtype=np.int64)
    unit.write(idx, _arrays(idx))
    req = np.array([4, 0, 3, 3, 1], dtype=np.int64)
    _check(unit.read(req, COLS), req)


def test_gather_across_chunks_in_request_order() -> None:
    unit = StorageUnit(0, CAP)
    for start in (0, 3, 5):
        idx = np.arange(start, start + (3 if start < 5 else 2), dtype=np.int64)
        unit.write(idx, _arrays(idx))
    req = np.array([6, 0, 4, 2, 5, 1], dtype=np.int64)
    _check(unit.read(req, COLS), req)


def test_overwrite_returns_last_written_bytes() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(4, dtype=np.int64)
    unit.write(idx, {"score": encode(SCORE, np.zeros(4, np.float32), 4, "t").array})
    unit.write(idx[1:3], {"score": encode(SCORE, np.array([7, 8], np.float32), 2, "t").array})
    out = unit.read(idx, ("score",))["score"]
    assert out.to_pylist() == [0.0, 7.0, 8.0, 0.0]


def test_evicted_index_raises() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(4, dtype=np.int64)
    unit.write(idx, _arrays(idx))
    unit.evict(idx[:2])
    with pytest.raises(UnknownIndexError, match=r"\b1\b"):
        unit.read(np.array([2, 1], dtype=np.int64), COLS)
    _check(unit.read(idx[2:], COLS), idx[2:])


def test_reused_slot_does_not_answer_for_the_old_index() -> None:
    unit = StorageUnit(0, CAP)
    old = np.array([1], dtype=np.int64)
    unit.write(old, _arrays(old))
    unit.evict(old)
    new = old + CAP  # same slot
    unit.write(new, _arrays(new))
    with pytest.raises(UnknownIndexError):
        unit.read(old, COLS)
    _check(unit.read(new, COLS), new)


def test_stale_index_is_not_readable_even_without_evict_message() -> None:
    """A newer index written over a slot shadows the stale one (evict arrives late)."""
    unit = StorageUnit(0, CAP)
    old = np.array([2], dtype=np.int64)
    unit.write(old, _arrays(old))
    new = old + CAP
    unit.write(new, _arrays(new))
    with pytest.raises(UnknownIndexError):
        unit.read(old, COLS)
    unit.evict(old)  # the late evict of the old index must not touch the new sample
    _check(unit.read(new, COLS), new)


def test_stale_write_never_clobbers_a_newer_sample() -> None:
    """Indices only grow, so a write for an index older than the slot's owner is stale.

    In the hub this happens when put(indices=...) passes check_update, the sample is then
    acked by every task and evicted, its slot is reused by a new sample, and only then the
    late update's bytes arrive at the unit.
    """
    unit = StorageUnit(0, CAP)
    new = np.array([3 + CAP], dtype=np.int64)
    unit.write(new, _arrays(new))
    stale = np.array([3], dtype=np.int64)
    with contextlib.suppress(UnknownIndexError):  # rejecting the stale write is fine too
        unit.write(stale, _arrays(stale))
    _check(unit.read(new, COLS), new)


@pytest.mark.parametrize("persistent", [False, True])
def test_on_accepted_runs_once_nothing_can_refuse_the_write(tmp_path, persistent: bool) -> None:
    """A unit server hands a write's commit on from ``on_accepted``: never for a refused
    write; in memory before the bytes are filed (nothing reads in between), on a persistent
    unit only once they are logged (a crash must not leave a commit without its bytes)."""
    folder = str(tmp_path / "unit") if persistent else None
    unit = StorageUnit(0, CAP, folder=folder)
    types = {c.name: c for c in (IDS, SCORE, PIX, TEXT)}
    idx = np.array([1, 2], dtype=np.int64)
    filed_then: list[bool] = []

    def accepted() -> None:  # runs under the unit's lock: look, do not call in
        filed_then.append(any((s.owner >= 0).any() for s in unit._columns.values()))

    unit.write(idx, _arrays(idx), types, on_accepted=accepted)
    assert filed_then == [persistent]
    _check(unit.read(idx, COLS), idx)
    newer = idx + CAP
    unit.write(newer, _arrays(newer), types)
    with pytest.raises(UnknownIndexError):  # stale: refused before on_accepted
        unit.write(idx, _arrays(idx), types, on_accepted=accepted)
    assert len(filed_then) == 1


@pytest.mark.parametrize("persistent", [False, True])
def test_arrays_built_on_acceptance(tmp_path, persistent: bool) -> None:
    """A unit server passes a function that builds the arrays: in memory it runs after
    ``on_accepted`` (the commit leaves before any Arrow work), on a persistent unit before
    (the bytes are logged first); never for a refused write."""
    folder = str(tmp_path / "unit") if persistent else None
    unit = StorageUnit(0, CAP, folder=folder)
    types = {c.name: c for c in (IDS, SCORE, PIX, TEXT)}
    idx = np.array([1, 2], dtype=np.int64)
    order: list[str] = []

    def build() -> dict[str, pa.Array]:
        order.append("build")
        return _arrays(idx)

    unit.write(idx, build, types, on_accepted=lambda: order.append("accepted"))
    assert order == (["build", "accepted"] if persistent else ["accepted", "build"])
    _check(unit.read(idx, COLS), idx)
    unit.write(idx + CAP, _arrays(idx + CAP), types)
    with pytest.raises(UnknownIndexError):
        unit.write(idx, build, types, on_accepted=lambda: order.append("accepted"))
    assert len(order) == 2


def _deferred(arrays: dict[str, pa.Array], built: list[str]) -> dict[str, Deferred]:
    """Each array as a Deferred (a unit server's write) that records its builds."""

    def later(name: str, array: pa.Array) -> Deferred:
        def build() -> pa.Array:
            built.append(name)
            return array

        return Deferred(len(array), array.get_total_buffer_size(), build)

    return {name: later(name, array) for name, array in arrays.items()}


def test_deferred_arrays_are_built_by_the_first_read_that_needs_them_once() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(3, dtype=np.int64)
    built: list[str] = []
    unit.write(idx, _deferred(_arrays(idx), built), tags={name: name for name in COLS})
    nbytes = sum(a.get_total_buffer_size() for a in _arrays(idx).values())
    assert built == [] and unit.statistics().nbytes == nbytes
    # a read of whole chunks in shared memory names them: nothing is built
    assert [tag for tag, _ in unit.read_run(idx[1:], COLS)] == list(COLS)
    assert built == []
    _check(unit.read(idx[1:], COLS), idx[1:])
    assert sorted(built) == sorted(COLS)
    _check(unit.read(idx[::-1], COLS), idx[::-1])  # (a gather: the built arrays again)
    assert len(built) == len(COLS) and unit.statistics().nbytes == nbytes
    unit.evict(idx)
    assert unit.statistics().nbytes == 0 and unit.statistics().chunks == 0


@pytest.mark.parametrize("start", [0, 40, 50])  # within the ring, up to its end, across it
def test_a_write_of_many_samples_in_a_row_within_or_across_the_ring(start: int) -> None:
    cap = 64
    unit = StorageUnit(0, cap)
    old = np.arange(start, start + 14, dtype=np.int64)
    unit.write(old, _arrays(old))
    new = old + cap  # the same slots (a slice of them unless the run wraps)
    unit.write(new, _arrays(new))
    _check(unit.read(new, COLS), new)
    with pytest.raises(UnknownIndexError, match=f"sample index {start} was evicted"):
        unit.write(old, _arrays(old))  # stale: refused whole
    with pytest.raises(UnknownIndexError):
        unit.read(old[:1], COLS)
    unit.evict(new)
    assert unit.statistics().samples == 0 and unit.statistics().chunks == 0


def test_consecutive_read_sees_overwrites_and_evictions_inside_its_chunk() -> None:
    """Reads of consecutive indices take a slice of the chunk only while every row of it
    is live: an overwritten or evicted row inside makes them look row by row."""
    unit = StorageUnit(0, CAP)
    idx = np.arange(6, dtype=np.int64)
    unit.write(idx, _arrays(idx))
    _check(unit.read(idx[1:5], COLS), idx[1:5])
    unit.write(idx[2:3], {"score": pa.array([99.0], type=pa.float32())})
    assert unit.read(idx[1:4], ("score",))["score"].to_pylist() == [0.5, 99.0, 1.5]
    unit.evict(idx[3:4])
    with pytest.raises(UnknownIndexError):
        unit.read(idx[2:5], ("ids",))
    _check(unit.read(idx[4:6], COLS), idx[4:6])


def test_read_run_names_the_whole_chunk_a_run_lies_in() -> None:
    """``read_run`` hands back each column's chunk tag and first row for consecutive
    indices inside whole tagged chunks; anything else is left to ``read``."""
    unit = StorageUnit(0, CAP)
    idx = np.arange(6, dtype=np.int64)
    unit.write(idx, _arrays(idx), tags={"ids": "A", "score": "B"})
    assert unit.read_run(idx[1:5], ("ids", "score")) == [("A", 1), ("B", 1)]
    assert unit.read_run(idx, ("score",)) == [("B", 0)]
    assert unit.read_run(idx[1:5], ("ids", "pix")) == []  # pix's chunk has no tag
    assert unit.read_run(idx[1:5], ("nope",)) == []  # read raises for it
    assert unit.read_run(np.array([1, 3], dtype=np.int64), ("ids",)) == []  # not a run
    assert unit.read_run(np.array([], dtype=np.int64), ("ids",)) == []
    assert unit.read_run(np.array([-1, 0], dtype=np.int64), ("ids",)) == []
    later = np.arange(6, 8, dtype=np.int64)
    unit.write(later, _arrays(later), tags={"ids": "C"})
    assert unit.read_run(np.arange(5, 7, dtype=np.int64), ("ids",)) == []  # two chunks
    assert unit.read_run(later, ("ids",)) == [("C", 0)]
    unit.write(idx[2:3], {"ids": _arrays(idx[2:3])["ids"]}, tags={"ids": "D"})
    assert unit.read_run(idx[3:5], ("ids",)) == []  # A lost a row: no longer whole
    assert unit.read_run(idx[2:3], ("ids",)) == [("D", 0)]
    assert unit.read_run(idx[3:5], ("score",)) == [("B", 3)]
    unit.evict(idx[5:6])
    assert unit.read_run(idx[3:5], ("score",)) == []  # B lost a row
    unit.evict(np.concatenate([idx, later]))
    assert all(not s.tags for s in unit._columns.values())  # tags go with their chunks


def test_never_written_index_and_unknown_column_raise() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(2, dtype=np.int64)
    unit.write(idx, {"score": _arrays(idx)["score"]})
    with pytest.raises(UnknownIndexError):
        unit.read(np.array([5], dtype=np.int64), ("score",))
    with pytest.raises(UnknownColumnError, match="ids"):
        unit.read(idx, ("ids",))


def test_chunks_are_freed_after_eviction() -> None:
    unit = StorageUnit(0, CAP)
    a = np.arange(0, 3, dtype=np.int64)
    b = np.arange(3, 6, dtype=np.int64)
    unit.write(a, _arrays(a))
    unit.write(b, _arrays(b))
    stats = unit.statistics()
    assert stats.samples == 6
    assert stats.chunks == 2 * len(COLS)
    assert stats.nbytes > 0
    unit.evict(a[:2])
    assert unit.statistics().chunks == 2 * len(COLS)  # a's chunk still holds index 2
    unit.evict(np.array([2], dtype=np.int64))
    stats = unit.statistics()
    assert stats.chunks == len(COLS)
    assert stats.samples == 3
    unit.evict(b)
    stats = unit.statistics()
    assert (stats.samples, stats.chunks, stats.nbytes) == (0, 0, 0)


def test_overwritten_chunk_is_freed() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(3, dtype=np.int64)
    unit.write(idx, {"score": _arrays(idx)["score"]})
    unit.write(idx, {"score": _arrays(idx)["score"]})
    assert unit.statistics().chunks == 1


def test_discard_undoes_a_write() -> None:
    unit = StorageUnit(0, CAP)
    idx = np.arange(3, dtype=np.int64)
    unit.write(idx, _arrays(idx))
    unit.discard(idx, COLS)
    assert unit.statistics().chunks == 0
    with pytest.raises(UnknownIndexError):
        unit.read(idx, ("score",))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_writes_evicts_reads(data: st.DataObject) -> None:
    """Model check: after random writes/evicts, every read equals the model's last write."""
    unit = StorageUnit(0, CAP)
    model: dict[int, int] = {}  # index -> generation of its last score write
    row: dict[int, int] = {}  # index -> its row in that write's chunk
    slot_owner: dict[int, int] = {}
    next_index = 0
    gen = 0
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        op = data.draw(st.sampled_from(["new", "overwrite", "evict", "read", "run"]), label="op")
        if op == "new":
            free = [s for s in range(CAP) if s not in slot_owner]
            k = data.draw(st.integers(0, len(free)), label="k")
            idx_list = []
            while len(idx_list) < k:
                if next_index % CAP not in slot_owner:
                    idx_list.append(next_index)
                    slot_owner[next_index % CAP] = next_index
                next_index += 1
            if not idx_list:
                continue
            idx = np.array(idx_list, dtype=np.int64)
            gen += 1
            vals = np.full(idx.size, gen, np.float32) + idx.astype(np.float32) / 1000
            unit.write(
                idx, {"score": encode(SCORE, vals, idx.size, "t").array}, tags={"score": gen}
            )
            model.update({i: gen for i in idx_list})
            row.update({i: k for k, i in enumerate(idx_list)})
        elif op == "overwrite" and model:
            chosen = data.draw(
                st.lists(st.sampled_from(sorted(model)), min_size=1, unique=True), label="ow"
            )
            idx = np.array(chosen, dtype=np.int64)
            gen += 1
            vals = np.full(idx.size, gen, np.float32) + idx.astype(np.float32) / 1000
            unit.write(
                idx, {"score": encode(SCORE, vals, idx.size, "t").array}, tags={"score": gen}
            )
            model.update({i: gen for i in chosen})
            row.update({i: k for k, i in enumerate(chosen)})
        elif op == "evict" and model:
            chosen = data.draw(
                st.lists(st.sampled_from(sorted(model)), min_size=1, unique=True), label="ev"
            )
            unit.evict(np.array(chosen, dtype=np.int64))
            for i in chosen:
                del model[i]
                del slot_owner[i % CAP]
        elif op in ("read", "run") and model:
            if op == "read":
                chosen = data.draw(
                    st.lists(st.sampled_from(sorted(model)), min_size=1, max_size=12), label="rd"
                )
            else:  # consecutive indices (the slice fast path), as long as they are live
                chosen = [data.draw(st.sampled_from(sorted(model)), label="start")]
                most = data.draw(st.integers(1, CAP), label="len")
                while chosen[-1] + 1 in model and len(chosen) < most:
                    chosen.append(chosen[-1] + 1)
            out = unit.read(np.array(chosen, dtype=np.int64), ("score",))["score"]
            want = [np.float32(model[i] + np.float32(i) / 1000) for i in chosen]
            assert out.to_numpy().tolist() == pytest.approx([float(w) for w in want])
            # a run's chunk, when named, is the one last written for all of its indices
            named = unit.read_run(np.array(chosen, dtype=np.int64), ("score",))
            if named:
                assert named == [(model[chosen[0]], row[chosen[0]])]
                assert {model[i] for i in chosen} == {named[0][0]}
    # whatever is left is readable, and nothing else is kept alive
    live = sorted(model)
    if live:
        unit.read(np.array(live, dtype=np.int64), ("score",))
    assert unit.statistics().samples == len(live)
    unit.evict(np.array(live, dtype=np.int64))
    assert unit.statistics().chunks == 0
    assert all(not s.tags for s in unit._columns.values())  # tags go with their chunks


# -- staged writes (puts to existing samples, visible once committed) ---------------------
R = Column.scalar("r", "int64")


@pytest.mark.parametrize("persistent", [False, True])
def test_a_staged_write_is_visible_only_once_committed(tmp_path, persistent: bool) -> None:
    folder = str(tmp_path) if persistent else None
    unit = StorageUnit(0, CAP, folder=folder)
    unit.write(np.arange(3), {"r": pa.array([0, 1, 2])}, {"r": R})
    unit.stage(7, np.array([1, 2]), {"r": pa.array([-1, -2])}, {"r": R})
    assert unit.staged(np.array([2])) and not unit.staged(np.array([0]))
    assert unit.read(np.arange(3), ("r",))["r"].to_pylist() == [0, 1, 2]  # not yet
    assert unit.settle(7, False)  # refused: forgotten
    assert not unit.settle(7, True)  # settled already
    assert unit.read(np.arange(3), ("r",))["r"].to_pylist() == [0, 1, 2]
    unit.stage(8, np.array([0, 2]), {"r": pa.array([10, 12])}, {"r": R})
    assert unit.settle(8, True)
    assert unit.read(np.arange(3), ("r",))["r"].to_pylist() == [10, 1, 12]
    assert not unit.staged(np.arange(3))
    unit.close()
    if persistent:  # the files hold what was committed, not what was refused
        again = StorageUnit(0, CAP, folder=folder)
        assert again.read(np.arange(3), ("r",))["r"].to_pylist() == [10, 1, 12]
        again.close()


def test_a_staged_write_is_checked_when_staged(tmp_path) -> None:
    unit = StorageUnit(0, CAP, folder=str(tmp_path))
    unit.write(np.array([9]), {"r": pa.array([9])}, {"r": R})  # slot 1 holds index 9
    with pytest.raises(UnknownIndexError, match="evicted"):
        unit.stage(1, np.array([1]), {"r": pa.array([1])})  # stale: nothing staged
    with pytest.raises(flowrl.errors.SchemaError, match="declaration"):
        unit.stage(2, np.array([9]), {"new": pa.array([1])})
    assert not unit.has_staged
    unit.close()

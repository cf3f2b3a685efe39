"""Columns through the hub: every kind round-trips; bad input raises and changes nothing.

Round trips: put -> claim/meta -> get returns exactly what was put, dense columns stay
dense, ragged columns come back as RaggedArray (padded/packed on request), from numpy,
torch and plain Python input, with declared or inferred columns.

Wrong input: every bad call raises the documented FlowRLError subclass with a message that
names the column (or argument), and leaves the hub as it was: ``statistics()`` and
``columns`` are identical, and the next valid put/claim behaves as if the bad call never
happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import flowrl
from flowrl import Column, FlowRLError, HubConfig, RaggedArray
from flowrl.errors import (
    ConfigError,
    HubFull,
    LeaseError,
    LengthMismatchError,
    SchemaError,
    UnknownColumnError,
    UnknownIndexError,
    UnknownTaskError,
)

COLUMNS = [
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
    Column.tensor("pix", "float32", (2, 2)),
    Column.string("text"),
    Column.object("obj"),
    Column.scalar("small", "int8"),
]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}


def over(*placements: str) -> Any:
    """Run a test only under these placements (the client-side checks and conversions are
    one code path for every placement: the large input matrices run in-process, and over
    zmq only where the server takes part)."""
    return pytest.mark.parametrize("placement", placements, indirect=True)


def placed(cases: list[Any], zmq: set[str]) -> list[Any]:
    """(placement, *case) params: every case in-process, the ``zmq`` ids over zmq too."""
    out = []
    for case in cases:
        values = case.values if hasattr(case, "values") else case
        out.append(pytest.param("inproc", *values, id=f"inproc-{values[0]}"))
        if values[0] in zmq:
            out.append(pytest.param("zmq", *values, id=f"zmq-{values[0]}"))
    return out


def rows(n: int, start: int = 0) -> dict[str, Any]:
    """Valid values for every column; sample i's values are derived from i."""
    r = range(start, start + n)
    return {
        "ids": [np.arange(i % 3, dtype=np.int64) + 10 * i for i in r],  # i % 3 == 0: empty
        "reward": np.array(list(r), dtype=np.float32),
        "pix": np.stack([np.full((2, 2), i, dtype=np.float32) for i in r]),
        "text": [f"t{i}" for i in r],
        "obj": [{"i": i, "tags": ["a", i]} for i in r],
        "small": np.array([i % 100 for i in r], dtype=np.int8),
    }


def check_rows(batch: flowrl.Batch, indices: list[int]) -> None:
    for name in batch.columns:
        got = batch[name]
        for pos, i in enumerate(indices):
            want = rows(1, i)
            if name == "ids":
                np.testing.assert_array_equal(got[pos], want["ids"][0])
            elif name in ("text", "obj"):
                assert got[pos] == want[name][0]
            else:
                np.testing.assert_array_equal(got[pos], want[name][0])


# -- round trips ---------------------------------------------------------------------------
SCALARS = [
    ("int64", np.array([1, -2, 3], dtype=np.int64)),
    ("int32", np.array([1, -2, 2**31 - 1], dtype=np.int32)),
    ("uint8", np.array([0, 7, 255], dtype=np.uint8)),
    ("float32", np.array([0.5, -1.25, 3e38], dtype=np.float32)),
    ("float64", np.array([0.1, -2.5, 1e300], dtype=np.float64)),
    ("float16", np.array([0.5, -1.0, 2.0], dtype=np.float16)),
    ("bool", np.array([True, False, True])),
]


@pytest.mark.parametrize(("dtype", "values"), SCALARS, ids=[d for d, _ in SCALARS])
@pytest.mark.parametrize(
    ("placement", "source"),
    [("inproc", "numpy"), ("inproc", "torch"), ("inproc", "list"), ("zmq", "numpy")],
    indirect=["placement"],
)
def test_scalar_round_trip(
    make_hub, request: pytest.FixtureRequest, dtype: str, values: np.ndarray, source: str
) -> None:
    hub = make_hub(columns=[Column.scalar("x", dtype)], tasks={"t": ["x"]})
    data: Any = {
        "numpy": values,
        "torch": torch.from_numpy(values.copy()),
        "list": values.tolist(),
    }[source]
    idx = hub.put({"x": data})
    assert idx.tolist() == [0, 1, 2]
    batch = hub.get(hub.claim("t", 3, timeout=2))
    got = batch["x"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == (3,)
    np.testing.assert_array_equal(got, values)
    np.testing.assert_array_equal(batch.numpy("x"), values)
    t = batch.torch("x")
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), values)


TENSORS = [
    ("float32", (2, 3)),
    ("int64", (4,)),
    ("bool", (2, 2)),
    ("int16", (1, 2, 3)),
]


@pytest.mark.parametrize(("dtype", "shape"), TENSORS, ids=[f"{d}{s}" for d, s in TENSORS])
@pytest.mark.parametrize(
    ("placement", "source"),
    [("inproc", "numpy"), ("inproc", "torch"), ("inproc", "list"), ("zmq", "numpy")],
    indirect=["placement"],
)
def test_tensor_round_trip(make_hub, dtype: str, shape: tuple[int, ...], source: str) -> None:
    rng = np.random.default_rng(0)
    values = (rng.integers(0, 5, size=(4, *shape)) % (2 if dtype == "bool" else 5)).astype(dtype)
    hub = make_hub(columns=[Column.tensor("x", dtype, shape)], tasks={"t": ["x"]})
    data: Any = {
        "numpy": values,
        "torch": torch.from_numpy(values.copy()),
        "list": values.tolist(),
    }[source]
    hub.put({"x": data})
    batch = hub.get(hub.claim("t", 4, timeout=2))
    got = batch["x"]
    assert isinstance(got, np.ndarray)
    assert got.shape == (4, *shape)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, values)
    np.testing.assert_array_equal(batch.torch("x").numpy(), values)


RAGGED = [
    [[1, 2, 3], [], [4], [5, 6]],
    [[], [], []],
    [[7]],
    [[], [1, 2, 3, 4, 5, 6, 7, 8, 9]],
]


@pytest.mark.parametrize("seqs", RAGGED, ids=["mixed", "all-empty", "one", "empty-first"])
@pytest.mark.parametrize(
    ("placement", "source"),
    [(p, src) for p in ("inproc",) for src in ("lists", "numpy", "torch", "ragged", "padded")]
    + [("zmq", "ragged")],
    indirect=["placement"],
)
def test_ragged_round_trip(make_hub, seqs: list[list[int]], source: str) -> None:
    hub = make_hub(columns=[Column.ragged("ids", "int64")], tasks={"t": ["ids"]})
    arrays = [np.array(s, dtype=np.int64) for s in seqs]
    if source == "lists":
        data: Any = seqs
    elif source == "numpy":
        data = arrays
    elif source == "torch":
        data = [torch.from_numpy(a) for a in arrays]
    elif source == "ragged":
        data = RaggedArray.from_list(arrays, dtype=np.int64)
    else:
        width = max(len(s) for s in seqs)
        padded = np.full((len(seqs), width), -9, dtype=np.int64)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        data = RaggedArray.from_padded(padded, np.array([len(s) for s in seqs]))
    n = len(seqs)
    hub.put({"ids": data})
    batch = hub.get(hub.claim("t", n, timeout=2))
    got = batch["ids"]
    assert isinstance(got, RaggedArray)
    assert got.dtype == np.int64
    assert got.tolist() == seqs
    assert got.lengths.tolist() == [len(s) for s in seqs]
    values, cu = batch.packed("ids")
    assert values.tolist() == [v for s in seqs for v in s]
    assert cu.tolist() == np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).tolist()
    tv, tcu = batch.packed("ids", torch=True)
    assert isinstance(tv, torch.Tensor)
    assert tv.tolist() == values.tolist()
    assert tcu.tolist() == cu.tolist()
    width = max(len(s) for s in seqs)
    padded, mask = batch.padded("ids", pad_value=-1)
    assert padded.shape == mask.shape == (n, width)
    for i, s in enumerate(seqs):
        assert padded[i, : len(s)].tolist() == s
        assert (padded[i, len(s) :] == -1).all()
        assert mask[i].tolist() == [True] * len(s) + [False] * (width - len(s))
    left, lmask = batch.padded("ids", left=True, max_len=width + 2)
    for i, s in enumerate(seqs):
        assert left[i, width + 2 - len(s) :].tolist() == s
        assert lmask[i].sum() == len(s)
    with pytest.raises(SchemaError, match="ids"):
        batch.numpy("ids")


@pytest.mark.parametrize("dtype", ["float32", "bool", "uint16"])
def test_ragged_other_dtypes_round_trip(make_hub, dtype: str) -> None:
    hub = make_hub(columns=[Column.ragged("v", dtype)], tasks={"t": ["v"]})
    seqs = [np.array([1, 0, 1], dtype=dtype), np.array([], dtype=dtype), np.array([1], dtype=dtype)]
    hub.put({"v": seqs})
    got = hub.get(hub.claim("t", 3, timeout=2))["v"]
    assert got.dtype == np.dtype(dtype)
    assert [a.tolist() for a in got] == [s.tolist() for s in seqs]


def test_string_and_object_round_trip(make_hub) -> None:
    hub = make_hub(columns=[Column.string("s"), Column.object("o")], tasks={"t": ["s", "o"]})
    strings = ["", "héllo", "日本語", "a" * 1000]
    objs = [None, {"k": [1, 2.5, "x"], "n": {"deep": True}}, [1, [2, [3]]], "plain"]
    hub.put({"s": strings, "o": objs})
    batch = hub.get(hub.claim("t", 4, timeout=2))
    assert batch["s"] == strings
    assert batch["o"] == objs
    with pytest.raises(SchemaError, match="s"):
        batch.numpy("s")
    with pytest.raises(SchemaError, match="o"):
        batch.ragged("o")


def test_all_kinds_together_and_get_subset_of_columns(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    hub.put(rows(5))
    meta = hub.claim("train", 5, timeout=2)
    assert meta.columns == ("ids", "reward")
    batch = hub.get(meta)
    assert batch.columns == ("ids", "reward")
    check_rows(batch, list(range(5)))
    everything = hub.get(meta, columns=[c.name for c in COLUMNS])
    check_rows(everything, list(range(5)))
    assert set(everything.to_dict()) == {c.name for c in COLUMNS}


def test_get_returns_rows_in_requested_order_across_puts(make_hub) -> None:
    """meta(indices) in any order, spanning several puts (the gather path)."""
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    hub.put(rows(3, 0))
    hub.put(rows(2, 3))
    hub.put(rows(4, 5))
    order = [7, 0, 4, 2, 8, 3]
    batch = hub.get(hub.meta(order, [c.name for c in COLUMNS]))
    assert batch.indices.tolist() == order
    check_rows(batch, order)


def test_round_trip_across_storage_units(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS, config=HubConfig(n_units=3))
    row_of = {}  # sample index -> the row it holds (indices are handles, not put order)
    for start in range(0, 12, 2):
        for k, i in enumerate(hub.put(rows(2, start)).tolist()):
            row_of[i] = start + k
    meta = hub.claim("train", 12, timeout=2)
    assert len(set(meta.units.tolist())) > 1
    got = hub.get(meta, columns=[c.name for c in COLUMNS])
    check_rows(got, [row_of[i] for i in meta.indices.tolist()])
    order = [list(row_of)[k] for k in (11, 0, 5, 6, 1)]
    check_rows(hub.get(hub.meta(order, [c.name for c in COLUMNS])), [row_of[i] for i in order])


def test_put_to_existing_samples_adds_and_overwrites_columns(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    data = rows(3)
    idx = hub.put({"ids": data["ids"]})
    hub.put({"reward": np.array([1, 2, 3], np.float32)}, indices=idx)
    hub.put({"reward": np.array([9], np.float32)}, indices=idx[1:2])
    batch = hub.get(hub.claim("train", 3, timeout=2))
    assert batch["reward"].tolist() == [1, 9, 3]
    assert batch["ids"].tolist() == [s.tolist() for s in data["ids"]]


def test_arrays_handed_out_are_not_aliases_of_the_input(make_hub) -> None:
    hub = make_hub(columns=[Column.scalar("x", "int64")], tasks={"t": ["x"]})
    values = np.arange(4, dtype=np.int64)
    hub.put({"x": values})
    values[:] = -1  # the hub stored its own copy
    assert hub.get(hub.claim("t", 4, timeout=2))["x"].tolist() == [0, 1, 2, 3]


def test_batch_arrays_are_read_only_views(make_hub) -> None:
    """Batch docs: arrays share memory with the hub's storage and are read-only."""
    hub = make_hub(columns=COLUMNS, tasks={"a": ["ids", "reward", "pix"], "b": ["reward"]})
    hub.put(rows(3))
    batch = hub.get(hub.claim("a", 3, timeout=2))
    dense = [batch["reward"], batch["pix"], batch["ids"].values, batch["ids"].cu_seqlens]
    for arr in dense:
        with pytest.raises(ValueError):
            arr[0] = 1
    other = hub.get(hub.claim("b", 3, timeout=2))
    assert other["reward"].tolist() == [0.0, 1.0, 2.0]


def test_batch_column_not_in_batch_raises_unknown_column(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    hub.put(rows(2))
    batch = hub.get(hub.claim("train", 2, timeout=2))
    with pytest.raises(UnknownColumnError, match=r"'pix'.*not in this batch"):
        batch.arrow("pix")
    for read in (batch.__getitem__, batch.numpy, batch.torch, batch.packed, batch.padded):
        with pytest.raises(UnknownColumnError, match=r"'pix'.*not in this batch"):
            read("pix")


# -- inference at first write ----------------------------------------------------------------
INFERRED = [
    ("np-int32", np.array([1, 2], dtype=np.int32), Column.scalar("x", "int32")),
    ("np-float-2d", np.zeros((2, 3), np.float32), Column.tensor("x", "float32", (3,))),
    ("torch-float", torch.zeros(2, 2, 2), Column.tensor("x", "float32", (2, 2))),
    ("torch-int", torch.tensor([1, 2]), Column.scalar("x", "int64")),
    ("py-int", [1, 2], Column.scalar("x", "int64")),
    ("py-float", [1.5, 2.0], Column.scalar("x", "float64")),
    ("py-bool", [True, False], Column.scalar("x", "bool")),
    ("py-str", ["a", "b"], Column.string("x")),
    ("py-lists", [[1, 2], [3]], Column.ragged("x", "int64")),
    ("np-seqs", [np.zeros(2, np.int32), np.zeros(1, np.int32)], Column.ragged("x", "int32")),
    ("torch-seqs", [torch.zeros(2), torch.zeros(3)], Column.ragged("x", "float32")),
    ("ragged", RaggedArray.from_list([[1], [2, 3]], dtype=np.int16), Column.ragged("x", "int16")),
    ("dicts", [{"a": 1}, {"b": 2}], Column.object("x")),
]


@over("inproc")
@pytest.mark.parametrize(
    ("values", "column"), [v[1:] for v in INFERRED], ids=[v[0] for v in INFERRED]
)
def test_inference_at_first_write(make_hub, values: Any, column: Column) -> None:
    hub = make_hub()
    hub.put({"x": values})
    assert hub.columns == (column,)
    hub.register_task("t", ["x"])
    batch = hub.get(hub.claim("t", 2, timeout=2))
    got = batch["x"]
    if column.kind in ("string", "object"):
        assert got == list(values)
    elif column.kind == "ragged":
        want = (
            values.tolist()
            if isinstance(values, RaggedArray)
            else [np.asarray(v).tolist() for v in values]
        )
        assert got.tolist() == want
    else:
        np.testing.assert_array_equal(got, np.asarray(values))


def test_inferred_column_is_fixed_by_first_write(make_hub) -> None:
    hub = make_hub()
    hub.put({"x": np.array([1, 2], dtype=np.int32)})
    before = hub.statistics()
    with pytest.raises(SchemaError, match="'x'"):
        hub.put({"x": np.array([1.0], dtype=np.float32)})
    assert hub.statistics() == before
    assert hub.columns == (Column.scalar("x", "int32"),)


@over("inproc")
@pytest.mark.parametrize(
    "values",
    [np.int64(3), np.array(3), [], np.array(["a", "b"]), 3, None, "abc"],
    ids=["np-scalar", "0d", "empty-list", "np-str", "int", "none", "str"],
)
def test_uninferable_first_write_raises_and_declares_nothing(make_hub, values: Any) -> None:
    hub = make_hub()
    with pytest.raises(SchemaError, match="'x'"):
        hub.put({"x": values})
    assert hub.columns == ()
    assert hub.statistics().live == 0


def test_failed_multi_column_first_write_declares_nothing(make_hub) -> None:
    hub = make_hub()
    with pytest.raises(LengthMismatchError, match="'b'"):
        hub.put({"a": [1, 2], "b": [1.0, 2.0, 3.0]})
    assert hub.columns == ()
    hub.put({"a": [1, 2], "b": [1.0, 2.0]})
    assert [c.name for c in hub.columns] == ["a", "b"]


# -- wrong input leaves the hub unchanged -----------------------------------------------------
class Env:
    """A hub with samples 0 and 1 fully put, and task 'score' holding a lease on both."""

    def __init__(self, make_hub: Callable[..., Any]) -> None:
        self.hub = make_hub(columns=COLUMNS, tasks=TASKS, config=HubConfig(capacity=16))
        assert self.hub.put(rows(2)).tolist() == [0, 1]
        self.lease = self.hub.claim("score", 2, timeout=2)
        self.stats = self.hub.statistics()
        self.columns = self.hub.columns

    def assert_unchanged_and_working(self) -> None:
        hub = self.hub
        assert hub.statistics() == self.stats
        assert hub.columns == self.columns
        # the next valid calls behave as if the bad call never happened
        hub.ack(self.lease)
        assert hub.put(rows(1, 2)).tolist() == [2]
        meta = hub.claim("train", 3, timeout=2)
        assert meta.indices.tolist() == [0, 1, 2]
        check_rows(hub.get(meta), [0, 1, 2])
        hub.ack(meta)
        stats = hub.statistics()
        assert stats.live == 1  # 0 and 1 consumed by both tasks; 2 still owed to 'score'
        assert stats.tasks["train"].consumed == 3
        assert stats.tasks["score"].consumed == 2


@pytest.fixture
def env(make_hub) -> Env:
    return Env(make_hub)


def _with(**overrides: Any) -> dict[str, Any]:
    data = rows(2, 2)
    data.update(overrides)
    return data


def _declare_and_shadow(hub: Any) -> None:
    hub.declare(Column.scalar("fresh", "int64"), Column.scalar("reward", "float64"))


# (id, call, expected error, words that must appear in the message)
BAD_CALLS: list[Any] = [
    # -- put: dtype
    (
        "put-dtype-numpy",
        lambda h, m: h.put(_with(reward=np.zeros(2, np.int64))),
        SchemaError,
        ["'reward'", "float32", "int64"],
    ),
    (
        "put-dtype-torch",
        lambda h, m: h.put(_with(reward=torch.zeros(2, dtype=torch.float64))),
        SchemaError,
        ["'reward'", "float32", "float64"],
    ),
    (
        "put-dtype-bfloat16",
        lambda h, m: h.put(_with(reward=torch.zeros(2, dtype=torch.bfloat16))),
        SchemaError,
        ["'reward'", "bfloat16"],
    ),
    (
        "put-dtype-pylist-float-to-int",
        lambda h, m: h.put(_with(small=[1.5, 2.5])),
        SchemaError,
        ["'small'"],
    ),
    (
        "put-dtype-pylist-str",
        lambda h, m: h.put(_with(reward=["a", "b"])),
        SchemaError,
        ["'reward'"],
    ),
    (
        "put-dtype-ragged",
        lambda h, m: h.put(_with(ids=[np.zeros(2, np.float32), np.zeros(1)])),
        SchemaError,
        ["'ids'", "int64"],
    ),
    ("put-dtype-ragged-lists", lambda h, m: h.put(_with(ids=[[1.5], [2]])), SchemaError, ["'ids'"]),
    (
        "put-dtype-tensor",
        lambda h, m: h.put(_with(pix=np.zeros((2, 2, 2), np.int32))),
        SchemaError,
        ["'pix'", "float32", "int32"],
    ),
    ("put-dtype-string", lambda h, m: h.put(_with(text=[1, 2])), SchemaError, ["'text'"]),
    (
        "put-dtype-string-array",
        lambda h, m: h.put(_with(text=np.array(["a", "b"]))),
        SchemaError,
        ["'text'"],
    ),
    (
        "put-object-unencodable",
        lambda h, m: h.put(_with(obj=[object(), 1])),
        SchemaError,
        ["'obj'"],
    ),
    ("put-object-not-list", lambda h, m: h.put(_with(obj={"a": 1})), SchemaError, ["'obj'"]),
    pytest.param(
        "put-object-bigint",
        lambda h, m: h.put(_with(obj=[2**70, 1])),
        SchemaError,
        ["'obj'"],
    ),
    pytest.param(
        "put-string-surrogate",
        lambda h, m: h.put(_with(text=["\ud800", "x"])),
        SchemaError,
        ["'text'"],
    ),
    pytest.param(
        "put-float32-overflow",
        lambda h, m: h.put(_with(reward=[1e300, 1.0])),
        SchemaError,
        ["'reward'"],
    ),
    ("put-scalar-not-array", lambda h, m: h.put(_with(reward=3.0)), SchemaError, ["'reward'"]),
    pytest.param(
        "put-int8-overflow",
        lambda h, m: h.put(_with(small=[300, 1])),
        SchemaError,
        ["'small'"],
    ),
    pytest.param(
        "put-ragged-mixed-dtypes",
        lambda h, m: h.put(_with(ids=[np.zeros(2, np.int32), np.zeros(1, np.int64)])),
        SchemaError,
        ["'ids'", "int32"],
    ),
    # -- put: shape
    (
        "put-shape-tensor",
        lambda h, m: h.put(_with(pix=np.zeros((2, 3, 3), np.float32))),
        SchemaError,
        ["'pix'", "(2, 3, 3)"],
    ),
    (
        "put-shape-tensor-flat",
        lambda h, m: h.put(_with(pix=np.zeros(2, np.float32))),
        SchemaError,
        ["'pix'"],
    ),
    (
        "put-shape-scalar-2d",
        lambda h, m: h.put(_with(reward=np.zeros((2, 1), np.float32))),
        SchemaError,
        ["'reward'", "(2, 1)"],
    ),
    (
        "put-shape-ragged-dense",
        lambda h, m: h.put(_with(ids=np.zeros((2, 3), np.int64))),
        SchemaError,
        ["'ids'"],
    ),
    (
        "put-shape-ragged-item-str",
        lambda h, m: h.put(_with(ids=["ab", [1]])),
        SchemaError,
        ["'ids'"],
    ),
    ("put-shape-ragged-not-list", lambda h, m: h.put(_with(ids=5)), SchemaError, ["'ids'"]),
    (
        "put-shape-tensor-list",
        lambda h, m: h.put(_with(pix=[[[1.0]], [[1.0]]])),
        SchemaError,
        ["'pix'"],
    ),
    pytest.param(
        "put-shape-ragged-item-2d",
        lambda h, m: h.put(_with(ids=[np.zeros((2, 2), np.int64), np.zeros(1, np.int64)])),
        SchemaError,
        ["'ids'"],
    ),
    # -- put: length, names, mapping
    (
        "put-length",
        lambda h, m: h.put(_with(reward=np.zeros(3, np.float32))),
        LengthMismatchError,
        ["'reward'", "3", "2"],
    ),
    (
        "put-length-first",
        lambda h, m: h.put({"ids": [[1]], "reward": np.zeros(2, np.float32)}),
        LengthMismatchError,
        ["'reward'"],
    ),
    ("put-unknown-column", lambda h, m: h.put(_with(nope=[1, 2])), UnknownColumnError, ["'nope'"]),
    ("put-not-mapping", lambda h, m: h.put([("ids", [[1]])]), SchemaError, ["mapping"]),
    ("put-empty-mapping", lambda h, m: h.put({}), SchemaError, ["mapping"]),
    ("put-non-str-name", lambda h, m: h.put({1: [1]}), SchemaError, ["1"]),
    (
        "put-zero-samples",
        lambda h, m: h.put({"reward": np.zeros(0, np.float32)}),
        SchemaError,
        ["zero"],
    ),
    # -- put: keyword arguments
    ("put-partition", lambda h, m: h.put(rows(2, 2), partition=3), ConfigError, ["partition"]),
    ("put-version-str", lambda h, m: h.put(rows(2, 2), version="1"), ConfigError, ["version"]),
    ("put-version-bool", lambda h, m: h.put(rows(2, 2), version=True), ConfigError, ["version"]),
    ("put-groups-len", lambda h, m: h.put(rows(2, 2), groups=[1, 2, 3]), SchemaError, ["groups"]),
    (
        "put-groups-float",
        lambda h, m: h.put(rows(2, 2), groups=[0.5, 1.5]),
        SchemaError,
        ["groups"],
    ),
    ("put-groups-str", lambda h, m: h.put(rows(2, 2), groups="ab"), SchemaError, ["groups"]),
    ("put-tokens", lambda h, m: h.put(rows(2, 2), tokens=[1]), SchemaError, ["tokens"]),
    ("put-tokens-2d", lambda h, m: h.put(rows(2, 2), tokens=[[1, 2]]), SchemaError, ["tokens"]),
    pytest.param(
        "put-tokens-overflow",
        lambda h, m: h.put(rows(2, 2), tokens=np.array([2**63, 1], dtype=np.uint64)),
        SchemaError,
        ["tokens"],
    ),
    pytest.param(
        "put-tokens-negative",
        lambda h, m: h.put(rows(2, 2), tokens=[-5, 1]),
        SchemaError,
        ["tokens"],
    ),
    pytest.param(
        "put-groups-overflow",
        lambda h, m: h.put(rows(2, 2), groups=2**63),
        SchemaError,
        ["groups"],
    ),
    pytest.param(
        "put-version-overflow",
        lambda h, m: h.put(rows(2, 2), version=2**63),
        ConfigError,
        ["version"],
    ),
    pytest.param(
        "put-timeout-str",
        lambda h, m: h.put(rows(2, 2), timeout="1"),
        ConfigError,
        ["timeout"],
    ),
    pytest.param(
        "put-producer-int",
        lambda h, m: h.put(rows(2, 2), producer=7),
        ConfigError,
        ["producer"],
    ),
    # -- put to existing indices
    (
        "put-index-unknown",
        lambda h, m: h.put({"reward": [1.0]}, indices=[99]),
        UnknownIndexError,
        ["99"],
    ),
    (
        "put-index-negative",
        lambda h, m: h.put({"reward": [1.0]}, indices=[-1]),
        UnknownIndexError,
        ["-1"],
    ),
    (
        "put-index-partly-unknown",
        lambda h, m: h.put({"reward": [1.0, 2.0]}, indices=[0, 7]),
        UnknownIndexError,
        ["7"],
    ),
    (
        "put-index-float",
        lambda h, m: h.put({"reward": [1.0]}, indices=[0.5]),
        SchemaError,
        ["indices"],
    ),
    (
        "put-index-2d",
        lambda h, m: h.put({"reward": [1.0]}, indices=[[0]]),
        SchemaError,
        ["indices"],
    ),
    ("put-index-str", lambda h, m: h.put({"reward": [1.0]}, indices="0"), SchemaError, ["indices"]),
    (
        "put-index-duplicate",
        lambda h, m: h.put({"reward": [1.0, 2.0]}, indices=[0, 0]),
        SchemaError,
        ["twice"],
    ),
    (
        "put-index-length",
        lambda h, m: h.put({"reward": [1.0, 2.0, 3.0]}, indices=[0, 1]),
        LengthMismatchError,
        ["'reward'"],
    ),
    (
        "put-index-bad-dtype",
        lambda h, m: h.put({"reward": np.zeros(1, np.float64)}, indices=[0]),
        SchemaError,
        ["'reward'", "float64"],
    ),
    # -- put_nowait
    (
        "put_nowait-dtype",
        lambda h, m: h.put_nowait(_with(reward=np.zeros(2, np.int32))),
        SchemaError,
        ["'reward'"],
    ),
    (
        "put_nowait-unknown",
        lambda h, m: h.put_nowait(_with(zz=[1, 2])),
        UnknownColumnError,
        ["'zz'"],
    ),
    (
        "put_nowait-length",
        lambda h, m: h.put_nowait(_with(text=["a"])),
        LengthMismatchError,
        ["'text'"],
    ),
    (
        "put_nowait-index",
        lambda h, m: h.put_nowait({"reward": [1.0]}, indices=[42]),
        UnknownIndexError,
        ["42"],
    ),
    ("put_nowait-too-big", lambda h, m: h.put_nowait(rows(17, 2)), HubFull, ["17"]),
    ("put-too-big", lambda h, m: h.put(rows(17, 2), timeout=0.05), HubFull, ["17"]),
    # -- claim / claim_nowait
    ("claim-task-type", lambda h, m: h.claim_nowait(3, 1), ConfigError, ["task"]),
    ("claim-task-unknown", lambda h, m: h.claim_nowait("nope", 1), UnknownTaskError, ["'nope'"]),
    ("claim-n-zero", lambda h, m: h.claim_nowait("train", 0), ConfigError, ["n "]),
    ("claim-n-negative", lambda h, m: h.claim("train", -1, timeout=0.05), ConfigError, ["n "]),
    ("claim-n-str", lambda h, m: h.claim_nowait("train", "2"), ConfigError, ["n "]),
    ("claim-n-bool", lambda h, m: h.claim_nowait("train", True), ConfigError, ["n "]),
    ("claim-n-float", lambda h, m: h.claim_nowait("train", 2.0), ConfigError, ["n "]),
    ("claim-min_n-zero", lambda h, m: h.claim_nowait("train", 2, min_n=0), ConfigError, ["min_n"]),
    (
        "claim-min_n-above-n",
        lambda h, m: h.claim_nowait("train", 2, min_n=3),
        ConfigError,
        ["min_n"],
    ),
    ("claim-min_n-str", lambda h, m: h.claim_nowait("train", 2, min_n="1"), ConfigError, ["min_n"]),
    (
        "claim-timeout-negative",
        lambda h, m: h.claim("train", 1, timeout=-1),
        ConfigError,
        ["timeout"],
    ),
    ("claim-timeout-str", lambda h, m: h.claim("train", 1, timeout="1"), ConfigError, ["timeout"]),
    pytest.param(
        "claim-timeout-nan",
        lambda h, m: h.claim("train", 1, timeout=float("nan")),
        ConfigError,
        ["timeout"],
    ),
    (
        "claim-lease-zero",
        lambda h, m: h.claim_nowait("train", 1, lease_timeout=0),
        ConfigError,
        ["lease_timeout"],
    ),
    (
        "claim-lease-str",
        lambda h, m: h.claim_nowait("train", 1, lease_timeout="5"),
        ConfigError,
        ["lease_timeout"],
    ),
    pytest.param(
        "claim-lease-nan",
        lambda h, m: h.claim_nowait("train", 1, lease_timeout=float("nan")),
        ConfigError,
        ["lease_timeout"],
    ),
    (
        "claim-sampler",
        lambda h, m: h.claim_nowait("train", 1, sampler="fifo"),
        ConfigError,
        ["sampler"],
    ),
    (
        "claim-sampler-class",
        lambda h, m: h.claim_nowait("train", 1, sampler=flowrl.FifoSampler),
        ConfigError,
        ["sampler"],
    ),
    (
        "claim-columns-unknown",
        lambda h, m: h.claim_nowait("train", 1, columns=["nope"]),
        UnknownColumnError,
        ["'nope'"],
    ),
    (
        "claim-columns-not-task",
        lambda h, m: h.claim_nowait("train", 1, columns=["pix"]),
        SchemaError,
        ["'pix'", "train"],
    ),
    (
        "claim-columns-duplicate",
        lambda h, m: h.claim_nowait("train", 1, columns=["ids", "ids"]),
        SchemaError,
        ["ids"],
    ),
    pytest.param(
        "claim-columns-int",
        lambda h, m: h.claim_nowait("train", 1, columns=5),
        ConfigError,
        ["columns"],
    ),
    pytest.param(
        "claim-dp_rank-str",
        lambda h, m: h.claim_nowait("train", 1, sampler=flowrl.BalancedSampler(2), dp_rank="0"),
        ConfigError,
        ["dp_rank"],
    ),
    (
        "claim-dp_rank-range",
        lambda h, m: h.claim_nowait("train", 1, sampler=flowrl.BalancedSampler(2), dp_rank=2),
        ConfigError,
        ["dp_rank"],
    ),
    pytest.param(
        "claim-consumer-int",
        lambda h, m: h.claim_nowait("train", 1, consumer=5),
        ConfigError,
        ["consumer"],
    ),
    ("claim_nowait-unknown", lambda h, m: h.claim_nowait("nope", 1), UnknownTaskError, ["nope"]),
    # -- get
    ("get-not-meta", lambda h, m: h.get("meta"), ConfigError, ["BatchMeta"]),
    ("get-unknown-column", lambda h, m: h.get(m, columns=["nope"]), UnknownColumnError, ["'nope'"]),
    pytest.param(
        "get-columns-int",
        lambda h, m: h.get(m, columns=5),
        ConfigError,
        ["columns"],
    ),
    # -- ack
    ("ack-not-meta", lambda h, m: h.ack(m.lease), ConfigError, ["BatchMeta"]),
    ("ack-unleased-meta", lambda h, m: h.ack(h.meta([0], ["ids"])), LeaseError, ["meta()"]),
    ("ack-foreign-index", lambda h, m: h.ack(m, indices=[0, 5]), LeaseError, ["not in it"]),
    ("ack-repeated-index", lambda h, m: h.ack(m, indices=[0, 0]), LeaseError, ["repeats"]),
    ("ack-index-float", lambda h, m: h.ack(m, indices=[0.0]), SchemaError, ["indices"]),
    ("ack-index-str", lambda h, m: h.ack(m, indices="0"), SchemaError, ["indices"]),
    # -- release
    ("release-not-meta", lambda h, m: h.release(None), ConfigError, ["BatchMeta"]),
    (
        "release-unleased-meta",
        lambda h, m: h.release(h.meta([0, 1], ["ids"])),
        LeaseError,
        ["meta()"],
    ),
    # -- register_task
    ("register-task-int", lambda h, m: h.register_task(5, ["ids"]), ConfigError, ["5"]),
    ("register-task-empty", lambda h, m: h.register_task("", ["ids"]), ConfigError, ["task"]),
    ("register-columns-str", lambda h, m: h.register_task("new", "ids"), ConfigError, ["ids"]),
    ("register-columns-int", lambda h, m: h.register_task("new", 5), ConfigError, ["5"]),
    ("register-columns-empty", lambda h, m: h.register_task("new", []), ConfigError, ["new"]),
    (
        "register-columns-unknown",
        lambda h, m: h.register_task("new", ["ids", "nope"]),
        UnknownColumnError,
        ["'nope'"],
    ),
    ("register-columns-non-str", lambda h, m: h.register_task("new", [1]), SchemaError, ["1"]),
    (
        "register-columns-dup",
        lambda h, m: h.register_task("new", ["ids", "ids"]),
        SchemaError,
        ["ids"],
    ),
    ("register-conflict", lambda h, m: h.register_task("train", ["ids"]), ConfigError, ["'train'"]),
    # -- declare
    ("declare-not-column", lambda h, m: h.declare("ids"), ConfigError, ["Column"]),
    (
        "declare-partly-bad",
        lambda h, m: h.declare(Column.scalar("fresh", "int64"), "x"),
        ConfigError,
        ["Column"],
    ),
    (
        "declare-conflict",
        lambda h, m: h.declare(Column.scalar("reward", "float64")),
        SchemaError,
        ["'reward'", "float32", "float64"],
    ),
    pytest.param(
        "declare-conflict-after-new",
        lambda h, m: _declare_and_shadow(h),
        SchemaError,
        ["'reward'"],
    ),
    # -- publish_version
    ("version-str", lambda h, m: h.publish_version("1"), ConfigError, ["'1'"]),
    ("version-float", lambda h, m: h.publish_version(1.0), ConfigError, ["1.0"]),
    ("version-bool", lambda h, m: h.publish_version(True), ConfigError, ["True"]),
    ("version-none", lambda h, m: h.publish_version(None), ConfigError, ["None"]),
    ("version-decrease", lambda h, m: h.publish_version(-1), ConfigError, ["-1"]),
    pytest.param(
        "version-overflow",
        lambda h, m: h.publish_version(2**63),
        ConfigError,
        ["version"],
    ),
    # -- end_stream
    ("end-unknown", lambda h, m: h.end_stream(["nope"]), UnknownColumnError, ["'nope'"]),
    ("end-dup", lambda h, m: h.end_stream(["ids", "ids"]), SchemaError, ["ids"]),
    pytest.param(
        "end-columns-int",
        lambda h, m: h.end_stream(5),
        ConfigError,
        ["columns"],
    ),
    # -- subscribe
    ("subscribe-not-callable", lambda h, m: h.subscribe(42), ConfigError, ["42"]),
    # -- meta
    ("meta-index-unknown", lambda h, m: h.meta([0, 9], ["ids"]), UnknownIndexError, ["9"]),
    ("meta-index-float", lambda h, m: h.meta([0.5], ["ids"]), SchemaError, ["indices"]),
    ("meta-column-unknown", lambda h, m: h.meta([0], ["nope"]), UnknownColumnError, ["'nope'"]),
    pytest.param(
        "meta-columns-int",
        lambda h, m: h.meta([0], 5),
        ConfigError,
        ["columns"],
    ),
]


# Calls whose error comes from the server (controller or storage unit) over zmq, plus a
# few client-side ones as a check that the same validation runs there.
SERVER_SIDE = {
    "put-dtype-numpy",
    "put-unknown-column",
    "put-index-unknown",
    "put-index-negative",
    "put-index-partly-unknown",
    "put-index-duplicate",
    "put_nowait-index",
    "put_nowait-too-big",
    "put-too-big",
    "claim-task-unknown",
    "claim-sampler-class",
    "claim-columns-not-task",
    "claim-dp_rank-range",
    "claim_nowait-unknown",
    "get-unknown-column",
    "ack-foreign-index",
    "ack-repeated-index",
    "register-task-int",
    "register-conflict",
    "declare-conflict",
    "declare-conflict-after-new",
    "version-decrease",
    "meta-index-unknown",
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("placement", "name", "call", "error", "words"),
    placed(BAD_CALLS, SERVER_SIDE),
    indirect=["placement"],
)
def test_wrong_input_raises_and_leaves_hub_unchanged(
    env: Env,
    name: str,
    call: Callable[..., Any],
    error: type[Exception],
    words: list[str],
) -> None:
    with pytest.raises(error) as info:
        call(env.hub, env.lease)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    env.assert_unchanged_and_working()


def test_every_error_is_a_flowrl_error() -> None:
    for entry in BAD_CALLS:
        error = entry.values[2] if hasattr(entry, "values") else entry[2]
        assert issubclass(error, FlowRLError)


# -- wrong input: evicted indices and stale handles -------------------------------------------
def _evict_first(hub: Any) -> tuple[Any, Any]:
    """Put 2 samples, have both tasks consume sample 0; returns (train meta, score meta)."""
    hub.put(rows(2))
    m_train = hub.claim("train", 2, timeout=2)
    m_score = hub.claim("score", 2, timeout=2)
    hub.ack(m_train, indices=[0])
    hub.ack(m_score, indices=[0])
    deadline = time.monotonic() + 5  # evictions reach remote storage units asynchronously
    while sum(u.samples for u in hub.statistics().units) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return m_train, m_score


def test_evicted_index_is_unknown_everywhere(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    m_train, m_score = _evict_first(hub)
    assert hub.statistics().live == 1
    before = hub.statistics()
    with pytest.raises(UnknownIndexError, match=r"\b0\b"):
        hub.put({"reward": [1.0]}, indices=[0])
    with pytest.raises(UnknownIndexError, match=r"\b0\b"):
        hub.meta([0], ["ids"])
    with pytest.raises(UnknownIndexError, match=r"\b0\b"):
        hub.get(m_train)  # the handle still names evicted sample 0
    with pytest.raises(LeaseError):
        hub.ack(m_train, indices=[0])  # already acked
    assert hub.statistics() == before
    # sample 1 is untouched and readable
    check_rows(hub.get(hub.meta([1], ["ids", "reward"])), [1])
    hub.ack(m_train)
    hub.ack(m_score)
    assert hub.statistics().live == 0


def test_stale_handle_after_slot_reuse_raises(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS, config=HubConfig(capacity=2))
    m_train, m_score = _evict_first(hub)
    hub.ack(m_train)
    hub.ack(m_score)
    assert hub.put(rows(2, 2)).tolist() == [2, 3]  # slots 0 and 1 reused
    with pytest.raises(UnknownIndexError):
        hub.get(m_train)
    with pytest.raises(UnknownIndexError):
        hub.put({"reward": [5.0]}, indices=[1])
    check_rows(hub.get(hub.meta([2, 3], ["ids", "reward"])), [2, 3])


def test_ack_and_release_twice_raise_lease_error(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    hub.put(rows(2))
    meta = hub.claim("train", 2, timeout=2)
    hub.ack(meta)
    before = hub.statistics()
    with pytest.raises(LeaseError, match=str(meta.lease)):
        hub.ack(meta)
    with pytest.raises(LeaseError, match=str(meta.lease)):
        hub.release(meta)
    assert hub.statistics() == before
    meta = hub.claim("score", 2, timeout=2)
    hub.release(meta)
    with pytest.raises(LeaseError):
        hub.release(meta)
    with pytest.raises(LeaseError):
        hub.ack(meta)


def test_closed_column_cannot_be_put_again(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    idx = hub.put({"ids": rows(2)["ids"]})
    hub.end_stream(["ids"])
    before = hub.statistics()
    with pytest.raises(SchemaError, match="'ids'"):
        hub.put({"ids": [[1], [2]]}, indices=idx)
    assert hub.statistics() == before
    hub.put({"reward": np.ones(2, np.float32)}, indices=idx)  # open columns still accepted
    assert hub.claim("train", 2, timeout=2).indices.tolist() == [0, 1]


# -- a failed put must not change the schema either -------------------------------------------
@pytest.mark.parametrize("case", ["hub-full", "unknown-index"])
def test_failed_put_does_not_declare_inferred_columns(make_hub, case: str) -> None:
    hub = make_hub(config=HubConfig(capacity=2))
    hub.put({"a": [1, 2]})
    before_cols, before = hub.columns, hub.statistics()
    if case == "hub-full":
        with pytest.raises(HubFull):
            hub.put_nowait({"a": [3], "zz": [1.0]})
    else:
        with pytest.raises(UnknownIndexError):
            hub.put({"zz": [1.0]}, indices=[99])
    assert hub.statistics() == before
    assert hub.columns == before_cols


def test_columns_given_as_a_string_are_rejected(make_hub) -> None:
    hub = make_hub(
        columns=[Column.scalar("a", "int64"), Column.scalar("b", "int64")],
        tasks={"t": ["a", "b"]},
    )
    hub.put({"a": [1], "b": [2]})
    meta = hub.claim("t", 1, timeout=2)
    with pytest.raises(ConfigError, match="columns"):
        hub.get(meta, columns="ab")


def test_subscribe_strict_must_be_bool(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    with pytest.raises(ConfigError, match="strict"):
        hub.subscribe(lambda e: None, strict="no")


def test_undeclared_schema_rejects_unknown_columns_with_a_hint(make_hub) -> None:
    hub = make_hub(columns=COLUMNS, tasks=TASKS)
    with pytest.raises(UnknownColumnError) as info:
        hub.put(_with(rewrad=[1.0, 2.0]))
    message = str(info.value)
    assert "'rewrad'" in message
    assert "reward" in message  # lists the declared columns
    assert "declare" in message.lower()


def test_config_errors() -> None:
    for kwargs in (
        {"capacity": 0},
        {"capacity": 1.5},
        {"n_units": 0},
        {"lease_timeout": 0},
        {"lease_timeout": float("nan")},
        {"lease_timeout": "1"},
    ):
        with pytest.raises(ConfigError):
            HubConfig(**kwargs)
    with pytest.raises(ConfigError, match="'bad name'"):
        Column.scalar("bad name", "int64")
    with pytest.raises(ConfigError, match="'x'"):
        Column.tensor("x", "float32", (0, 2))
    with pytest.raises(ConfigError, match="'x'"):
        Column("x", "scalar", "complex128")
    with pytest.raises(ConfigError):
        Column.scalar("x", "notatype")
    assert Column.scalar("x", torch.float32) == Column.scalar("x", "float32")
    assert Column.scalar("x", np.dtype("int16")) == Column.scalar("x", "int16")


def test_column_accepts_numpy_scalar_types() -> None:
    assert Column.scalar("x", np.int16) == Column.scalar("x", "int16")
    assert Column.ragged("x", np.float32) == Column.ragged("x", "float32")


@pytest.mark.parametrize(
    "make",
    [
        lambda: HubConfig(capacity=True),
        lambda: HubConfig(n_units=True),
        lambda: HubConfig(lease_timeout=True),
        lambda: HubConfig(infer_columns="yes"),
        lambda: flowrl.GroupSampler(True),
        lambda: flowrl.BalancedSampler(True),
        lambda: flowrl.StalenessSampler(False),
        lambda: Column.tensor("x", "float32", (True, 2)),
    ],
    ids=[
        "capacity",
        "n_units",
        "lease_timeout",
        "infer_columns",
        "group_size",
        "dp_size",
        "max_staleness",
        "shape",
    ],
)
def test_configs_reject_bools_and_wrong_types(make: Callable[[], Any]) -> None:
    with pytest.raises(ConfigError):
        make()

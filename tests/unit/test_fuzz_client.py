"""Fuzzing the public client API with malformed input (hypothesis), under every placement.

Each test builds one hub with ``make_hub`` (one per test function, not per example: a zmq
hub takes ~0.4 s to launch) holding known samples, a live lease, an evicted sample and a
published version, then throws malformed calls at one API entry point. Every call must:

* raise a ``FlowRLError`` subclass from ``flowrl.errors`` with a message (never a raw
  TypeError/KeyError/IndexError/OverflowError/zmq error), of the documented class where
  the input is wrong in exactly one documented way;
* leave the hub unchanged: ``statistics()`` (counters, leases, event count, bytes per
  storage unit), ``columns`` and the stored samples read back are identical;
* leave the servers up: after the examples a valid put/claim/get/ack round trip works.

Where the validity of generated input is not obvious (column values), a scratch in-process
hub is the oracle: input it accepts is valid and is skipped with ``assume``. Bugs this
file found are pinned by regression tests at its end.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import flowrl
from flowrl import BatchMeta, Column, HubConfig
from flowrl.errors import (
    ConfigError,
    FlowRLError,
    LeaseError,
    LengthMismatchError,
    SchemaError,
    UnknownColumnError,
    UnknownIndexError,
    UnknownTaskError,
    WouldBlock,
)

GUARD = 5.0  # seconds a blocking call may wait before the test fails instead of hanging

COLUMNS = [
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
    Column.tensor("pix", "float32", (2, 2)),
    Column.string("text"),
    Column.object("obj"),
    Column.scalar("small", "int8"),
    Column.scalar("later", "float64"),  # never written: task 'idle' never has work
]
WRITTEN = ("ids", "reward", "pix", "text", "obj", "small")
NAMES = tuple(c.name for c in COLUMNS)
TASKS = {"train": ["ids", "reward"], "score": ["ids"], "idle": ["later"]}
CONFIG = HubConfig(capacity=32, n_units=2)
LIVE = [1, 2, 3, 4]  # after setup; sample 0 was dropped and evicted
VERSION = 3

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one hub per test function, on purpose
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)


def rows(n: int, start: int = 0) -> dict[str, Any]:
    """Valid values for every written column; sample i's values derive from i."""
    r = range(start, start + n)
    return {
        "ids": [np.arange(i % 3, dtype=np.int64) + 10 * i for i in r],
        "reward": np.array(list(r), dtype=np.float32),
        "pix": np.stack([np.full((2, 2), i, dtype=np.float32) for i in r]),
        "text": [f"t{i}" for i in r],
        "obj": [{"i": i, "tags": ["a", i]} for i in r],
        "small": np.array([i % 100 for i in r], dtype=np.int8),
    }


def expected_values(indices: list[int]) -> dict[str, list[Any]]:
    """What reading ``indices`` must return, as Arrow ``to_pylist`` values."""
    out: dict[str, list[Any]] = {c: [] for c in WRITTEN}
    for i in indices:
        one = rows(1, i)
        out["ids"].append(one["ids"][0].tolist())
        out["reward"].append(float(one["reward"][0]))
        out["pix"].append(one["pix"][0].reshape(-1).tolist())
        out["text"].append(one["text"][0])
        out["obj"].append(one["obj"][0])
        out["small"].append(int(one["small"][0]))
    return out


def read_back(hub: Any, indices: list[int]) -> dict[str, list[Any]]:
    batch = hub.get(hub.meta(indices, list(WRITTEN)))
    values = {c: batch.arrow(c).to_pylist() for c in WRITTEN}
    values["pix"] = [np.asarray(p, dtype=np.float32).reshape(-1).tolist() for p in values["pix"]]
    values["obj"] = [batch["obj"][k] for k in range(len(indices))]
    return values


class World:
    """A hub in a known state, and the means to check a bad call changed nothing.

    Sample 0 was claimed by 'train' and dropped (evicted): ``stale`` is its settled lease.
    Samples 1..4 are live on both storage units; 'score' holds ``lease`` on 1 and 2;
    'idle' needs the never-written column 'later', so claims for it find nothing.
    """

    def __init__(self, make_hub: Callable[..., Any]) -> None:
        self.hub = hub = make_hub(columns=COLUMNS, tasks=TASKS, config=CONFIG)
        assert hub.put(rows(1)).tolist() == [0]
        self.stale = hub.claim("train", 1, timeout=GUARD)
        hub.drop(self.stale)
        assert hub.put(rows(2, 1)).tolist() == [1, 2]
        assert hub.put(rows(2, 3)).tolist() == [3, 4]
        self.lease = hub.claim("score", 2, timeout=GUARD)
        assert self.lease.indices.tolist() == [1, 2]
        hub.publish_version(VERSION)
        self.oracle = flowrl.Hub(COLUMNS, tasks=TASKS, config=HubConfig(capacity=1 << 16))
        settle(hub)
        self.baseline = self.snapshot()
        assert self.baseline[2] == expected_values(LIVE)
        stats = self.baseline[0]
        assert stats.live == 4 and stats.leases == 1 and stats.version == VERSION
        assert [u.samples for u in stats.units] == [2, 2]

    def snapshot(self) -> tuple[Any, ...]:
        hub = self.hub
        return hub.statistics(), hub.columns, read_back(hub, LIVE)

    def rejects(self, call: Callable[[], Any], expected: Any = FlowRLError) -> FlowRLError:
        """``call`` raises a typed flowrl error (``expected``) and the hub is unchanged."""
        try:
            call()
        except FlowRLError as exc:
            assert type(exc).__module__ == "flowrl.errors", repr(exc)
            assert str(exc), f"{type(exc).__name__} without a message"
            assert isinstance(exc, expected), f"expected {expected}, got {exc!r}"
            error = exc
        except Exception as exc:
            raise AssertionError(f"raw {type(exc).__name__} escaped: {exc!r}") from exc
        else:
            pytest.fail("the malformed call was accepted")
        self.check_unchanged()
        return error

    def check_unchanged(self) -> None:
        now = self.snapshot()
        assert now[0] == self.baseline[0], "statistics() changed"
        assert now[1] == self.baseline[1], "columns changed"
        assert now[2] == self.baseline[2], "stored samples changed"

    @staticmethod
    def valid_on_a_fresh_hub(call: Callable[[Any], Any]) -> bool:
        """Whether ``call(hub)`` succeeds on a scratch in-process hub with the same columns,
        tasks and version (the oracle for calls whose validity needs no samples)."""
        scratch = flowrl.Hub(COLUMNS, tasks=TASKS, config=HubConfig(capacity=8))
        scratch.publish_version(VERSION)
        try:
            call(scratch)
        except Exception:
            return False
        finally:
            scratch.close()
        return True

    def oracle_accepts(self, data: Any, **kwargs: Any) -> bool:
        """Whether an in-process hub takes this put of new samples (valid input)."""
        try:
            self.oracle.put(data, timeout=0, **kwargs)
        except Exception:
            return False
        return True

    def still_serves(self) -> None:
        """A valid round trip after the fuzzing: the servers are up and consistent."""
        hub = self.hub
        new = hub.put(rows(2, 5)).tolist()  # a refused put may have used up an index
        assert len(new) == 2 and min(new) > max(LIVE)
        meta = hub.claim("train", 8, min_n=1, timeout=GUARD)
        assert meta.indices.tolist() == [*LIVE, *new]
        got = hub.get(meta)
        assert got.arrow("reward").to_pylist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        hub.ack(meta)
        hub.ack(self.lease)
        stats = hub.statistics()
        assert stats.tasks["train"].consumed == 7
        assert stats.tasks["score"].consumed == 3  # 0 (dropped), 1, 2
        assert stats.leases == 0


def settle(hub: Any) -> None:
    """Wait until storage units applied the controller's evictions (asynchronous over zmq:
    the controller pushes them), so that statistics() is stable."""
    deadline = time.monotonic() + GUARD
    while True:
        stats = hub.statistics()
        if sum(u.samples for u in stats.units) == stats.live:
            return
        assert time.monotonic() < deadline, f"storage units never caught up: {stats}"
        time.sleep(0.005)


@pytest.fixture(params=["inproc", "zmq"])
def placement(request: pytest.FixtureRequest) -> str:
    """The in-process and zmq placements. (Ray runs the zmq servers inside actors: the same
    wire and the same client code; one test below also runs there, the fuzz does not, to
    keep this file's time bounded.)"""
    return str(request.param)


@pytest.fixture
def world(make_hub: Callable[..., Any]) -> World:
    return World(make_hub)


# -- strategies ---------------------------------------------------------------------------
class Opaque:
    """An object nothing in flowrl knows how to handle."""

    def __repr__(self) -> str:
        return "Opaque()"


small_arrays = hnp.arrays(
    dtype=st.one_of(hnp.scalar_dtypes(), st.just(np.dtype(object))),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    elements={"allow_nan": True} if False else None,
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=10),
    st.just(Opaque()),
)
junk = st.recursive(
    st.one_of(scalars, small_arrays),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=2),
        st.sets(st.integers(-3, 3), max_size=2),
    ),
    max_leaves=6,
)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=6))
unknown_names = st.text(max_size=8).filter(lambda s: s not in NAMES)


def near_miss(column: Column, n: int) -> st.SearchStrategy[Any]:
    """Values that look like what ``column`` takes for ``n`` samples, but are off."""
    wrong_dtypes = hnp.scalar_dtypes().filter(
        lambda d: column.kind not in "scalar tensor ragged" or d != np.dtype(column.dtype or "O")
    )
    shapes = {"scalar": (n,), "tensor": (n, 2, 2), "ragged": (n,)}.get(column.kind, (n,))
    out = [
        junk,
        hnp.arrays(dtype=wrong_dtypes, shape=st.just(shapes)),
        hnp.arrays(dtype=wrong_dtypes, shape=hnp.array_shapes(max_dims=3, max_side=3)),
        st.lists(junk, min_size=n, max_size=n),  # the right length, wrong items
        st.lists(st.just(1), min_size=0, max_size=4).filter(lambda v: len(v) != n),
    ]
    if column.kind in ("scalar", "tensor", "ragged"):
        dtype = np.dtype(column.dtype)
        out.append(hnp.arrays(dtype=dtype, shape=hnp.array_shapes(max_dims=3, max_side=3)))
    if column.kind == "scalar":
        big = st.sampled_from([300, -129, 2**63, 2**64, 2**70, 1e300, -1e300, 0.5, True])
        out.append(st.lists(big, min_size=n, max_size=n))
    if column.kind == "ragged":
        item = st.one_of(junk, hnp.arrays(dtype=wrong_dtypes, shape=hnp.array_shapes()))
        out.append(st.lists(item, min_size=n, max_size=n))
        out.append(st.lists(st.lists(st.floats(), max_size=3), min_size=n, max_size=n))
    if column.kind == "string":
        text = st.one_of(st.just("\ud800"), st.text(max_size=3), st.binary(max_size=3))
        out.append(st.lists(text, min_size=n, max_size=n))
    if column.kind == "object":
        unencodable = st.one_of(st.just(Opaque()), st.just(2**70), st.complex_numbers())
        out.append(st.lists(st.one_of(unencodable, junk), min_size=n, max_size=n))
    return st.one_of(*out)


@st.composite
def bad_column_values(draw: st.DrawFn, n: int) -> tuple[str, Any]:
    name = draw(st.sampled_from(WRITTEN))
    column = next(c for c in COLUMNS if c.name == name)
    return name, draw(near_miss(column, n))


bad_seconds = st.one_of(
    st.floats(max_value=-1e-9),
    st.just(math.nan),
    st.just(-math.inf),
    st.text(max_size=2),
    st.booleans(),
    st.complex_numbers(max_magnitude=1),
    st.lists(st.integers(0, 3), max_size=2),
    st.just(Opaque()),
)


def is_seconds(value: Any, *, zero_ok: bool) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0 if zero_ok else value > 0


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# -- more strategies ------------------------------------------------------------------------
def _bad_indices(repeats: bool = True) -> st.SearchStrategy[Any]:
    """Index lists naming at least one sample that is not live (never allocated, evicted,
    negative, huge), or not integers at all, or not 1-D, or (``repeats``) repeating one."""
    outside = st.one_of(
        st.just(0),  # evicted
        st.integers(5, 2**62),  # never allocated
        st.integers(-(2**62), -1),
    )
    with_outside = st.tuples(st.lists(st.sampled_from(LIVE), max_size=2), outside).map(
        lambda t: [*t[0], t[1]]
    )
    repeat = st.lists(st.sampled_from(LIVE), min_size=1, max_size=2).map(lambda v: v + v)
    return st.one_of(
        with_outside,
        with_outside.map(lambda v: np.array(v, dtype=np.int64)),
        repeat if repeats else with_outside,
        hnp.arrays(dtype=st.sampled_from([np.float64, np.float32, np.bool_, np.str_]), shape=2),
        hnp.arrays(dtype=np.int64, shape=(2, 1), elements=st.sampled_from(LIVE)),
        st.text(min_size=1, max_size=3),
        st.lists(st.one_of(st.floats(), st.text(max_size=1), st.none()), min_size=1, max_size=2),
        st.just([2**70]),
    )


bad_tasks = st.one_of(
    junk.filter(lambda v: not isinstance(v, str)), st.just(""), unknown_names.filter(bool)
)
bad_counts = st.one_of(
    st.integers(max_value=0),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=2),
    st.none(),
    st.just(Opaque()),
    st.lists(st.integers(1, 3), max_size=2),
)
bad_samplers = st.one_of(
    junk,
    st.sampled_from(
        [flowrl.FifoSampler, flowrl.GroupSampler, flowrl.Sampler, "fifo", print, object()]
    ),
)
bad_claim_columns = st.one_of(
    st.lists(unknown_names, min_size=1, max_size=2),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=2).map(lambda v: v + v),
    st.lists(st.sampled_from(["ids", "reward", "text"]), min_size=1, max_size=2),  # not idle's
    st.text(min_size=1, max_size=4),
    st.integers(),
    st.lists(st.one_of(st.integers(), st.none(), st.binary(max_size=2)), min_size=1, max_size=2),
)


bad_versions = st.one_of(
    st.integers(-(2**70), VERSION - 1),
    st.integers(2**63, 2**70),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    junk,
)


def forged(meta: BatchMeta, **changes: Any) -> BatchMeta:
    """A copy of a handle with some fields changed (a stale, foreign or tampered handle)."""
    fields = {name: getattr(meta, name) for name in BatchMeta.__slots__}
    fields.update(changes)
    return BatchMeta(**fields)


class Case(NamedTuple):
    """One malformed call: ``call(hub)`` must raise ``expected`` and change nothing."""

    what: str
    call: Callable[[Any], Any]
    expected: type[Exception] = FlowRLError
    not_would_block: bool = False  # wrong input, so never "nothing ready"/"hub full"


def fuzz(world: World, cases: Callable[[World], st.SearchStrategy[Case]], examples: int) -> None:
    """Run ``examples`` malformed calls drawn from ``cases`` against the world's hub."""

    @settings(FUZZ, max_examples=examples)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(cases(world), label="case")
        note(case.what)
        exc = world.rejects(lambda: case.call(world.hub), case.expected)
        if case.not_would_block:
            assert not isinstance(exc, WouldBlock), f"wrong input reported as {exc!r}"

    run()


# -- put / put_nowait ---------------------------------------------------------------------
@st.composite
def bad_puts(draw: st.DrawFn, world: World) -> Case:
    """A put (of new samples, or to existing ones) that must be refused."""
    n = draw(st.integers(1, 3))
    data: Any = rows(n, 100)
    kwargs: dict[str, Any] = {}
    kind = draw(
        st.sampled_from(
            [
                "value",
                "length",
                "unknown",
                "key",
                "mapping",
                "kwarg",
                "many",
                "too-big",
                "timeout",
                "indices",
                "indices-value",
                "stale",
                "append",
            ]
        )
    )
    expected: type[Exception] = FlowRLError
    if kind == "value":
        name, value = draw(bad_column_values(n))
        data[name] = value
    elif kind == "length":
        name = draw(st.sampled_from(WRITTEN))
        m = draw(st.integers(1, 4).filter(lambda k: k != n))
        data[name] = rows(m, 100)[name]
        expected = LengthMismatchError
    elif kind == "unknown":
        data[draw(unknown_names)] = draw(st.one_of(junk, st.just([1] * n)))
        expected = UnknownColumnError
    elif kind == "key":
        data[draw(st.one_of(st.integers(), st.binary(max_size=3), st.none()))] = [1] * n
        expected = SchemaError
    elif kind == "mapping":
        data = draw(st.one_of(st.just({}), junk.filter(lambda v: not isinstance(v, dict))))
        expected = SchemaError
    elif kind == "kwarg":
        key = draw(st.sampled_from(["partition", "producer", "version", "groups", "tokens"]))
        kwargs[key] = draw(junk)
    elif kind == "many":
        for _ in range(draw(st.integers(2, 3))):
            name, value = draw(bad_column_values(n))
            data[name] = value
        kwargs[draw(st.sampled_from(["partition", "version", "groups", "tokens"]))] = draw(junk)
    elif kind == "too-big":
        big = rows(CONFIG.capacity + 1, 100)
        return Case("put of capacity + 1 samples", lambda h: h.put_nowait(big), WouldBlock)
    elif kind == "timeout":
        timeout = draw(bad_seconds)
        return Case(
            f"put(timeout={timeout!r})", lambda h: h.put(data, timeout=timeout), ConfigError
        )
    elif kind == "indices":
        indices = draw(_bad_indices())
        size = len(indices) if isinstance(indices, list | np.ndarray) else 1
        column = draw(st.sampled_from(WRITTEN))
        part = {column: rows(size + draw(st.sampled_from([0, 0, 1])), 200)[column]}
        return Case(
            f"put({column}) to indices {indices!r}",
            lambda h: h.put(part, indices=indices, timeout=0),
        )
    elif kind == "indices-value":
        name, value = draw(bad_column_values(2))
        assume(not world.oracle_accepts({name: value}))
        return Case(
            f"put({name}={value!r}) to [3, 4]",
            lambda h: h.put({name: value}, indices=[3, 4], timeout=0),
        )
    elif kind == "append":  # token appends: a column, indices or version that cannot be
        column = draw(st.one_of(st.sampled_from(["ids", "reward", "text", "nope"]), junk))
        indices = draw(st.one_of(st.just([3, 4]), _bad_indices()))
        version = draw(st.one_of(st.integers(0, 9), bad_versions))
        values = draw(st.one_of(st.just([[1], [2, 3]]), bad_column_values(2).map(lambda c: c[1])))
        # 'ids' is complete on live samples and the others are not ragged: always refused
        return Case(
            f"append({indices!r}, {column!r}, {values!r}, version={version!r})",
            lambda h: h.append(indices, column, values, version=version),
        )
    else:  # a handle whose sample was evicted
        return Case(
            "put to a stale handle",
            lambda h: h.put({"reward": [1.0]}, indices=world.stale),
            UnknownIndexError,
        )
    assume(not world.oracle_accepts(data, **kwargs))
    if draw(st.booleans()):
        return Case(f"put_nowait({data!r}, {kwargs!r})", lambda h: h.put_nowait(data, **kwargs))
    return Case(f"put({data!r}, {kwargs!r})", lambda h: h.put(data, timeout=0, **kwargs), expected)


def test_put_and_put_nowait_reject_malformed_input(world: World) -> None:
    fuzz(world, bad_puts, examples=120)
    world.still_serves()


# -- claim / claim_nowait -------------------------------------------------------------------
CLAIM_ARGS = [
    "task", "n", "min_n", "timeout", "lease_timeout", "dp_rank", "consumer", "sampler",
    "columns", "balanced",
]  # fmt: skip


@st.composite
def bad_claims(draw: st.DrawFn, world: World) -> Case:
    """A claim on 'idle' (which never has work) with 1-3 malformed arguments.

    A claim with valid arguments raises NothingReady and changes nothing, so a mutation
    that happens to be valid cannot change the hub either.
    """
    args: dict[str, Any] = {"task": "idle", "n": 1}
    for key in draw(st.lists(st.sampled_from(CLAIM_ARGS), min_size=1, max_size=3, unique=True)):
        if key == "task":
            args["task"] = draw(bad_tasks)
        elif key == "n":
            args["n"] = draw(bad_counts)
        elif key == "min_n":
            args["min_n"] = draw(st.one_of(bad_counts, st.integers(2, 9)))  # 2..9 > n=1
        elif key == "timeout":
            args["timeout"] = draw(bad_seconds)
        elif key == "lease_timeout":
            args["lease_timeout"] = draw(st.one_of(bad_seconds, st.just(0), st.just(0.0)))
        elif key == "dp_rank":
            args["dp_rank"] = draw(
                st.one_of(st.integers(max_value=-1), st.booleans(), st.text(max_size=1))
            )
        elif key == "consumer":
            args["consumer"] = draw(junk.filter(lambda v: not isinstance(v, str)))
        elif key == "sampler":
            args["sampler"] = draw(bad_samplers)
        elif key == "columns":
            args["columns"] = draw(bad_claim_columns)
        else:  # a balanced claim for a rank the sampler does not have
            size = draw(st.integers(1, 4))
            args["sampler"] = flowrl.BalancedSampler(size)
            args["dp_rank"] = draw(st.integers(size, 2**62))
    task, n = args.pop("task"), args.pop("n")
    wrong = not isinstance(task, str) or not is_count(n)
    if draw(st.booleans()) and "timeout" not in args:
        return Case(
            f"claim_nowait({task!r}, {n!r}, {args!r})",
            lambda h: h.claim_nowait(task, n, **args),
            not_would_block=wrong,
        )
    args.setdefault("timeout", 0)
    return Case(
        f"claim({task!r}, {n!r}, {args!r})",
        lambda h: h.claim(task, n, **args),
        not_would_block=wrong,
    )


def test_claim_and_claim_nowait_reject_malformed_arguments(world: World) -> None:
    fuzz(world, bad_claims, examples=100)
    world.still_serves()


# -- get / meta ---------------------------------------------------------------------------
def _readable(columns: Any) -> bool:
    """Columns a get may validly read."""
    return (
        isinstance(columns, list)
        and len(set(map(str, columns))) == len(columns)
        and all(isinstance(c, str) and c in WRITTEN for c in columns)
    )


@st.composite
def bad_reads(draw: st.DrawFn, world: World) -> Case:
    kind = draw(
        st.sampled_from(["junk", "stale", "unallocated", "columns", "both", "meta", "partial"])
    )
    meta: Any = world.lease
    columns: Any = None
    if kind == "partial":  # prefixes of in-progress values: of unknown samples or columns
        indices = draw(st.one_of(st.just([3]), _bad_indices(repeats=False)))
        column = draw(st.one_of(st.sampled_from(["ids", "reward", "nope"]), junk))
        assume(
            not (
                isinstance(indices, list)
                and indices == [3]
                and isinstance(column, str)
                and column == "ids"
            )
        )
        return Case(f"partial({indices!r}, {column!r})", lambda h: h.partial(indices, column))
    if kind == "meta":
        indices = draw(_bad_indices(repeats=False))  # reading a sample twice is fine
        cols = draw(st.one_of(st.just(["ids"]), st.just(list(WRITTEN)), bad_claim_columns))
        return Case(f"meta({indices!r}, {cols!r})", lambda h: h.meta(indices, cols))
    if kind == "junk":
        meta = draw(junk)
    elif kind == "stale":
        meta = world.stale
    elif kind == "unallocated":  # never allocated, or negative
        index = st.one_of(st.integers(5, 2**62), st.integers(-(2**62), -1))
        idx = draw(st.lists(index, min_size=1, max_size=3))
        zeros = np.zeros(len(idx), dtype=np.int64)
        meta = forged(
            world.lease,
            indices=np.array(idx, dtype=np.int64),
            units=zeros.astype(np.int16),
            tokens=zeros,
            versions=zeros,
            groups=zeros,
        )
    if kind in ("columns", "both"):
        columns = draw(bad_claim_columns.filter(lambda c: not _readable(c)))
    if kind == "both":
        meta = world.stale
    return Case(f"get({meta!r}, columns={columns!r})", lambda h: h.get(meta, columns=columns))


def test_get_and_meta_reject_malformed_handles_and_columns(world: World) -> None:
    fuzz(world, bad_reads, examples=80)
    world.still_serves()


def test_valid_reads_between_bad_calls_return_what_was_stored(world: World) -> None:
    """Reads are the one call the fuzz may also run validly: they return what was stored."""

    @settings(FUZZ, max_examples=25)
    @given(
        columns=st.lists(st.sampled_from(WRITTEN), min_size=1, max_size=3, unique=True),
        picks=st.lists(st.sampled_from(LIVE), min_size=1, max_size=4),
        bad=bad_reads(world),
    )
    def run(columns: list[str], picks: list[int], bad: Case) -> None:
        world.rejects(lambda: bad.call(world.hub), bad.expected)
        batch = world.hub.get(world.hub.meta(picks, columns))
        want = expected_values(picks)
        for c in columns:
            got = batch.arrow(c).to_pylist()
            if c == "pix":
                got = [np.asarray(p, dtype=np.float32).reshape(-1).tolist() for p in got]
            if c == "obj":
                got = [batch["obj"][k] for k in range(len(picks))]
            assert got == want[c]
        world.check_unchanged()

    run()


# -- ack / drop / release -------------------------------------------------------------------
@st.composite
def bad_settles(draw: st.DrawFn, world: World) -> Case:
    """ack/drop/release that must not settle anything: 'score' holds the only live lease."""
    lease = world.lease
    how = draw(st.sampled_from(["ack", "drop", "release"]))
    kind = draw(st.sampled_from(["junk", "unleased", "stale", "task", "lease", "indices"]))
    indices: Any = None
    meta: Any = lease
    if kind == "junk":
        meta = draw(junk)
    elif kind == "unleased":
        meta = world.hub.meta([3], ["ids"])
    elif kind == "stale":
        meta = world.stale
        indices = draw(st.one_of(st.none(), st.just([0])))
    elif kind == "task":
        task = draw(st.one_of(st.sampled_from(["train", "idle", ""]), unknown_names))
        assume(task != "score")
        meta = forged(lease, task=task)
    elif kind == "lease":
        lid = draw(st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 10)))
        assume(lid not in (lease.lease, 0))
        meta = forged(lease, lease=lid)
    else:
        assume(how != "release")
        indices = draw(
            st.one_of(
                _bad_indices(),
                st.tuples(st.sampled_from([1, 2]), st.sampled_from([3, 4])).map(list),
                st.just([1, 1]),
            )
        )
    if how == "release":
        return Case(f"release({meta!r})", lambda h: h.release(meta))
    return Case(
        f"{how}({meta!r}, indices={indices!r})",
        lambda h: getattr(h, how)(meta, indices=indices),
    )


def test_ack_drop_release_reject_bad_leases(world: World) -> None:
    fuzz(world, bad_settles, examples=80)
    world.still_serves()


# -- register_task / declare / publish_version / end_stream / subscribe --------------------------
new_columns = st.builds(
    Column.scalar,
    st.sampled_from(["fresh", "reward", "ids", "small"]),
    st.sampled_from(["int64", "float32", "float64", "int8", "bool"]),
)


@st.composite
def bad_control_calls(draw: st.DrawFn, world: World) -> Case:
    what = draw(st.sampled_from(["register", "declare", "version", "end", "subscribe"]))
    if what == "register":
        task = draw(st.one_of(st.sampled_from(["train", "fresh"]), bad_tasks))
        columns = draw(
            st.one_of(
                bad_claim_columns,
                st.just([]),
                st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True),
                junk,
            )
        )
        case = Case(
            f"register_task({task!r}, {columns!r})", lambda h: h.register_task(task, columns)
        )
    elif what == "declare":
        args = draw(st.lists(st.one_of(new_columns, junk), min_size=1, max_size=3))
        case = Case(f"declare(*{args!r})", lambda h: h.declare(*args))
    elif what == "version":
        version = draw(bad_versions)
        case = Case(
            f"publish_version({version!r})", lambda h: h.publish_version(version), ConfigError
        )
    elif what == "end":
        columns = draw(st.one_of(bad_claim_columns, junk))
        case = Case(f"end_stream({columns!r})", lambda h: h.end_stream(columns))
    else:
        observer = draw(st.one_of(junk, st.just(print)))
        strict = draw(st.one_of(st.booleans(), junk))
        case = Case(
            f"subscribe({observer!r}, strict={strict!r})",
            lambda h: h.subscribe(observer, strict=strict),
            ConfigError,
        )
    assume(not world.valid_on_a_fresh_hub(case.call))
    return case


def test_control_calls_reject_malformed_input(world: World) -> None:
    fuzz(world, bad_control_calls, examples=100)
    world.still_serves()


# -- documented single-argument errors, then a burst of bad calls ------------------------------
@pytest.mark.parametrize(
    "placement", ["inproc", "zmq", pytest.param("ray", marks=pytest.mark.ray)], indirect=True
)
def test_documented_errors_then_a_burst_then_the_hub_serves(world: World, placement: str) -> None:
    hub = world.hub
    world.rejects(lambda: hub.claim_nowait("nope", 1), UnknownTaskError)
    world.rejects(lambda: hub.claim_nowait(3, 1), ConfigError)
    world.rejects(lambda: hub.claim_nowait("idle", 0), ConfigError)
    world.rejects(lambda: hub.claim("idle", 1, timeout=-1), ConfigError)
    world.rejects(lambda: hub.claim("idle", 1, timeout=math.nan), ConfigError)
    world.rejects(lambda: hub.claim_nowait("idle", 1, lease_timeout=math.nan), ConfigError)
    world.rejects(lambda: hub.claim_nowait("idle", 1, columns=["nope"]), UnknownColumnError)
    world.rejects(lambda: hub.claim_nowait("idle", 1, columns=["ids"]), SchemaError)
    world.rejects(lambda: hub.claim_nowait("idle", 1), WouldBlock)
    world.rejects(lambda: hub.claim_nowait("idle", 2**70), WouldBlock | ConfigError)
    world.rejects(lambda: hub.ack(world.stale), LeaseError)
    world.rejects(lambda: hub.release(world.stale), LeaseError)
    world.rejects(lambda: hub.ack(hub.meta([3], ["ids"])), LeaseError)
    world.rejects(lambda: hub.ack(world.lease, indices=[1, 3]), LeaseError)
    world.rejects(lambda: hub.drop(forged(world.lease, lease=999)), LeaseError)
    world.rejects(lambda: hub.ack(forged(world.lease, lease=2**64)), LeaseError | ConfigError)
    world.rejects(lambda: hub.release("lease"), ConfigError)
    world.rejects(lambda: hub.put({"reward": [1.0]}, indices=world.stale), UnknownIndexError)
    world.rejects(lambda: hub.meta([0], ["ids"]), UnknownIndexError)
    world.rejects(lambda: hub.get(world.stale), UnknownIndexError)
    world.rejects(lambda: hub.publish_version(VERSION - 1), ConfigError)
    if placement != "inproc":  # in-process names may hold lone surrogates; msgpack cannot
        world.rejects(lambda: hub.put(rows(1, 9), producer="\ud800"), ConfigError)
        world.rejects(lambda: hub.register_task("\ud800", ["ids"]), ConfigError)
    for k in range(30):
        world.rejects(lambda k=k: hub.put({"reward": [float(k)]}, indices=[100 + k]))
        world.rejects(lambda: hub.claim("idle", 1, timeout=-1), ConfigError)
    world.still_serves()


def inproc_only() -> Any:
    """Client-side code paths: one placement exercises them."""
    return pytest.mark.parametrize("placement", ["inproc"], indirect=True)


@inproc_only()
def test_per_sample_object_arrays_are_refused(world: World) -> None:
    for key in ("tokens", "groups"):
        for value in ([None], [1, None], [Opaque()], [[1], [1, 2]]):
            world.rejects(
                lambda key=key, value=value: world.hub.put(rows(len(value), 60), **{key: value}),
                SchemaError,
            )


def _blocking_claim_then_put(world: World, timeout: float) -> Any:
    """A claim waiting with ``timeout`` for samples that a put makes ready."""
    hub = world.hub
    hub.register_task("waiter", ["text"])
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(hub.claim("waiter", 5, min_n=5, timeout=timeout))
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(0.3)  # it is waiting (or it failed at once)
    if not box:
        hub.put(rows(4, 40))  # with samples 1..4 already there: 5 ready for 'waiter'
        thread.join(GUARD)
    assert box, "the claim neither returned nor raised"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def test_a_claim_may_wait_for_ever(world: World) -> None:
    """``timeout=inf`` passes the documented check (any number >= 0) and means: wait."""
    world.hub.ack(world.lease)  # no lease deadline to shorten the wait
    meta = _blocking_claim_then_put(world, math.inf)
    assert meta.indices.tolist() == [1, 2, 3, 4, 5]


def test_a_claim_may_wait_1e10_seconds(world: World) -> None:
    world.hub.ack(world.lease)  # no lease deadline to shorten the wait
    meta = _blocking_claim_then_put(world, 1e10)
    assert meta.indices.tolist() == [1, 2, 3, 4, 5]


def test_a_handle_naming_index_minus_one_is_refused(world: World) -> None:
    tampered = forged(world.lease, indices=np.array([-1, 1], dtype=np.int64))
    world.rejects(lambda: world.hub.get(tampered), UnknownIndexError)
    world.still_serves()

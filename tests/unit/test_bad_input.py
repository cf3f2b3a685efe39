"""Every public hub call, given one bad argument, raises a typed error naming what it
expected and leaves the hub unchanged, in-process and over zmq (issue 26, item 7).

The table below is (call, bad argument, expected error, words of its message). One hub
per placement serves the whole table: it holds samples, a live lease and a published
version, and ``statistics()`` (counters, leases, events, bytes per storage unit) must read
the same after each bad call. Cases that must succeed (numpy integers where ints are
expected) are at the end, each on a hub of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest

import flowrl
from flowrl import BalancedSampler, BatchMeta, Column, GroupSampler, HubConfig
from flowrl.errors import (
    ConfigError,
    FlowRLError,
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
    Column.ragged("gen", "int64"),  # never put: append() extends it
]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
CAPACITY = 64
CONFIG = HubConfig(capacity=CAPACITY, n_units=2, lease_timeout=600.0)
#: Seconds a claim may wait in a case: a refusal that waits its timeout instead raises
#: Timeout, and the case fails on the error's type (never on a clock).
WAIT_S = 2.0


def rows(n: int) -> dict[str, Any]:
    return {
        "ids": [np.arange(i + 1, dtype=np.int64) for i in range(n)],
        "reward": np.arange(n, dtype=np.float32),
    }


class Case(NamedTuple):
    call: str
    bad: str  # the bad argument, as the test id shows it
    run: Callable[[Any, SimpleNamespace], Any]
    error: type[FlowRLError]
    says: str  # words the message must hold (what was expected)


def forged(meta: BatchMeta, **fields: Any) -> BatchMeta:
    """A copy of ``meta`` with some fields replaced (a tampered or hand-made handle)."""
    kw = {k: getattr(meta, k) for k in BatchMeta.__slots__}
    kw.update(fields)
    return BatchMeta(**kw)


C = Case
CASES = [
    # -- declare, register_task ----------------------------------------------------------
    C("declare", "a str", lambda h, s: h.declare("ids"), ConfigError, "flowrl.Column"),
    C("register_task", "task=1", lambda h, s: h.register_task(1, ["ids"]), ConfigError, "str"),
    C("register_task", "task=''", lambda h, s: h.register_task("", ["ids"]), ConfigError, "str"),
    C(
        "register_task",
        "columns a str",
        lambda h, s: h.register_task("t", "ids"),
        ConfigError,
        "list of names",
    ),
    C(
        "register_task",
        "unknown column",
        lambda h, s: h.register_task("t", ["nope"]),
        UnknownColumnError,
        "nope",
    ),
    C("register_task", "column 1", lambda h, s: h.register_task("t", [1]), SchemaError, "str"),
    # -- put -----------------------------------------------------------------------------
    C("put", "data a list", lambda h, s: h.put([1, 2]), SchemaError, "mapping"),
    C("put", "data empty", lambda h, s: h.put({}), SchemaError, "mapping"),
    C("put", "unknown column", lambda h, s: h.put({"nope": [1.0]}), UnknownColumnError, "nope"),
    C(
        "put",
        "wrong dtype",
        lambda h, s: h.put({"reward": ["a"], "ids": [[1]]}),
        SchemaError,
        "reward",
    ),
    C(
        "put",
        "lengths disagree",
        lambda h, s: h.put({"reward": [1.0, 2.0], "ids": [[1]]}),
        LengthMismatchError,
        "",
    ),
    C("put", "partition=1", lambda h, s: h.put(rows(1), partition=1), ConfigError, "str"),
    C("put", "producer=1", lambda h, s: h.put(rows(1), producer=1), ConfigError, "str"),
    C("put", "timeout=-1", lambda h, s: h.put(rows(1), timeout=-1), ConfigError, "seconds"),
    C("put", "timeout=nan", lambda h, s: h.put(rows(1), timeout=math.nan), ConfigError, "seconds"),
    C("put", "timeout='1'", lambda h, s: h.put(rows(1), timeout="1"), ConfigError, "seconds"),
    C("put", "indices 2-D", lambda h, s: h.put(rows(1), indices=[[1]]), SchemaError, "1-D"),
    C("put", "indices str", lambda h, s: h.put(rows(1), indices=["a"]), SchemaError, "integer"),
    C(
        "put",
        "indices unknown",
        lambda h, s: h.put(rows(1), indices=[10**6]),
        UnknownIndexError,
        "",
    ),
    C("put", "indices -1", lambda h, s: h.put(rows(1), indices=[-1]), UnknownIndexError, ""),
    C(
        "put",
        "indices count",
        lambda h, s: h.put(rows(1), indices=s.meta.indices),
        LengthMismatchError,
        "",
    ),
    C("put", "groups str", lambda h, s: h.put(rows(1), groups="a"), SchemaError, "groups"),
    C("put", "groups count", lambda h, s: h.put(rows(1), groups=[1, 2]), SchemaError, "groups"),
    C("put", "tokens -1", lambda h, s: h.put(rows(1), tokens=[-1]), SchemaError, "tokens"),
    C("put", "version -1", lambda h, s: h.put(rows(1), version=-1), ConfigError, "version"),
    C("put", "version 2**63", lambda h, s: h.put(rows(1), version=2**63), ConfigError, "version"),
    C("put", "version '1'", lambda h, s: h.put(rows(1), version="1"), ConfigError, "version"),
    C("put", "version 1.5", lambda h, s: h.put(rows(1), version=1.5), ConfigError, "version"),
    C("put", "ack=object", lambda h, s: h.put(rows(1), ack=object()), ConfigError, "ack="),
    C("put", "ack without indices", lambda h, s: h.put(rows(1), ack=s.meta), ConfigError, "ack="),
    C(
        "put",
        "ack of a meta() handle",
        lambda h, s: h.put(rows(1), indices=s.handle, ack=s.handle),
        ConfigError,
        "ack=",
    ),
    C(
        "put",
        "more samples than capacity",
        lambda h, s: h.put(rows(CAPACITY + 1), timeout=WAIT_S),
        HubFull,
        "capacity",
    ),
    C("put_async", "timeout=-1", lambda h, s: h.put_async(rows(1), timeout=-1), ConfigError, "s"),
    C("put_async", "version -1", lambda h, s: h.put_async(rows(1), version=-1), ConfigError, "v"),
    C("put_nowait", "data empty", lambda h, s: h.put_nowait({}), SchemaError, "mapping"),
    C("flush", "timeout=-1", lambda h, s: h.flush(timeout=-1), ConfigError, "seconds"),
    C("flush", "timeout='1'", lambda h, s: h.flush(timeout="1"), ConfigError, "seconds"),
    # -- claim ---------------------------------------------------------------------------
    C("claim", "task=1", lambda h, s: h.claim(1, 1), ConfigError, "str"),
    C("claim", "unknown task", lambda h, s: h.claim("nope", 1), UnknownTaskError, "nope"),
    C("claim", "n=0", lambda h, s: h.claim("train", 0), ConfigError, "positive int"),
    C("claim", "n=-1", lambda h, s: h.claim("train", -1), ConfigError, "positive int"),
    C("claim", "n='2'", lambda h, s: h.claim("train", "2"), ConfigError, "positive int"),
    C("claim", "n=True", lambda h, s: h.claim("train", True), ConfigError, "positive int"),
    C("claim", "n=2.0", lambda h, s: h.claim("train", 2.0), ConfigError, "positive int"),
    C("claim", "n=np.bool_", lambda h, s: h.claim("train", np.True_), ConfigError, "int"),
    C(
        "claim",
        "n above capacity",
        lambda h, s: h.claim("train", CAPACITY + 1, timeout=WAIT_S),
        ConfigError,
        "capacity",
    ),
    C(
        "claim",
        "min_n above capacity",
        lambda h, s: h.claim("train", CAPACITY + 2, min_n=CAPACITY + 1, timeout=WAIT_S),
        ConfigError,
        "capacity",
    ),
    C("claim", "n=2**63", lambda h, s: h.claim("train", 2**63, timeout=WAIT_S), ConfigError, "int"),
    C("claim", "min_n=0", lambda h, s: h.claim("train", 2, min_n=0), ConfigError, "min_n"),
    C("claim", "min_n>n", lambda h, s: h.claim("train", 2, min_n=3), ConfigError, "min_n"),
    C("claim", "min_n='1'", lambda h, s: h.claim("train", 2, min_n="1"), ConfigError, "min_n"),
    C("claim", "timeout=-1", lambda h, s: h.claim("train", 1, timeout=-1), ConfigError, "seconds"),
    C(
        "claim",
        "lease_timeout=0",
        lambda h, s: h.claim("train", 1, lease_timeout=0),
        ConfigError,
        "seconds",
    ),
    C("claim", "dp_rank=-1", lambda h, s: h.claim("train", 1, dp_rank=-1), ConfigError, "dp_rank"),
    C(
        "claim",
        "dp_rank without a balanced sampler",
        lambda h, s: h.claim("train", 1, dp_rank=1, timeout=WAIT_S),
        ConfigError,
        "BalancedSampler",
    ),
    C(
        "claim",
        "dp_rank >= dp_size",
        lambda h, s: h.claim("train", 1, dp_rank=2, sampler=BalancedSampler(2), timeout=WAIT_S),
        ConfigError,
        "dp_size",
    ),
    C(
        "claim",
        "n below group_size",
        lambda h, s: h.claim("train", 1, sampler=GroupSampler(2), timeout=WAIT_S),
        ConfigError,
        "group",
    ),
    C("claim", "columns a str", lambda h, s: h.claim("train", 1, columns="ids"), ConfigError, ""),
    C(
        "claim",
        "unknown column",
        lambda h, s: h.claim("train", 1, columns=["nope"]),
        UnknownColumnError,
        "nope",
    ),
    C("claim", "sampler str", lambda h, s: h.claim("train", 1, sampler="fifo"), ConfigError, "S"),
    C("claim", "consumer=1", lambda h, s: h.claim("train", 1, consumer=1), ConfigError, "str"),
    C("claim_nowait", "n=0", lambda h, s: h.claim_nowait("train", 0), ConfigError, "positive"),
    # -- get, meta -----------------------------------------------------------------------
    C("get", "meta a str", lambda h, s: h.get("x"), ConfigError, "BatchMeta"),
    C("get", "unknown column", lambda h, s: h.get(s.meta, ["nope"]), UnknownColumnError, "nope"),
    C(
        "get",
        "forged units",
        lambda h, s: h.get(forged(s.meta, units=np.full(2, 99, np.int16))),
        UnknownIndexError,
        "storage unit",
    ),
    C(
        "get",
        "forged negative unit",
        lambda h, s: h.get(forged(s.meta, units=np.full(2, -1, np.int16))),
        UnknownIndexError,
        "storage unit",
    ),
    C(
        "get",
        "forged indices",
        lambda h, s: h.get(forged(s.meta, indices=np.array([10**6, 10**6 + 1]))),
        UnknownIndexError,
        "",
    ),
    C(
        "get",
        "units and indices disagree",
        lambda h, s: h.get(forged(s.meta, units=s.meta.units[:1])),
        ConfigError,
        "units",
    ),
    C("meta", "unknown index", lambda h, s: h.meta([10**6], ["ids"]), UnknownIndexError, ""),
    C("meta", "indices str", lambda h, s: h.meta("ab", ["ids"]), SchemaError, "integer"),
    C("meta", "unknown column", lambda h, s: h.meta([1], ["nope"]), UnknownColumnError, "nope"),
    # -- ack, drop, release --------------------------------------------------------------
    C("ack", "meta a str", lambda h, s: h.ack("x"), ConfigError, "BatchMeta"),
    C("ack", "a meta() handle", lambda h, s: h.ack(s.handle), LeaseError, "meta()"),
    C("ack", "forged lease", lambda h, s: h.ack(forged(s.meta, lease=987654)), LeaseError, ""),
    C("ack", "indices str", lambda h, s: h.ack(s.meta, indices="ab"), SchemaError, "integer"),
    C("ack", "index not leased", lambda h, s: h.ack(s.meta, indices=[10**6]), LeaseError, ""),
    C("drop", "meta a str", lambda h, s: h.drop("x"), ConfigError, "BatchMeta"),
    C("drop", "a meta() handle", lambda h, s: h.drop(s.handle), LeaseError, "meta()"),
    C("release", "meta a str", lambda h, s: h.release("x"), ConfigError, "BatchMeta"),
    C("release", "forged lease", lambda h, s: h.release(forged(s.meta, lease=9)), LeaseError, ""),
    # -- append, partial -----------------------------------------------------------------
    C(
        "append",
        "not a ragged column",
        lambda h, s: h.append(s.meta, "reward", [[1.0], [2.0]], version=0),
        SchemaError,
        "ragged",
    ),
    C("append", "column=1", lambda h, s: h.append(s.meta, 1, [[1]], version=0), ConfigError, ""),
    C("append", "no column", lambda h, s: h.append(s.meta, {}, version=0), ConfigError, "column"),
    C(
        "append",
        "version -1",
        lambda h, s: h.append(s.meta, "ids", [[1], [2]], version=-1),
        ConfigError,
        "version",
    ),
    C(
        "append",
        "values count",
        lambda h, s: h.append(s.meta, "ids", [[1]], version=0),
        LengthMismatchError,
        "",
    ),
    C(
        "append",
        "forged units",
        lambda h, s: h.append(
            forged(s.meta, units=np.full(2, 7, np.int16)), "ids", [[1], [2]], version=0
        ),
        UnknownIndexError,
        "storage unit",
    ),
    C("partial", "not ragged", lambda h, s: h.partial(s.meta, "reward"), SchemaError, "ragged"),
    C("partial", "column=1", lambda h, s: h.partial(s.meta, 1), ConfigError, "column"),
    C(
        "partial",
        "forged units",
        lambda h, s: h.partial(forged(s.meta, units=np.full(2, 7, np.int16)), "ids"),
        UnknownIndexError,
        "storage unit",
    ),
    # -- versions, stream end, events ----------------------------------------------------
    C("publish_version", "-1", lambda h, s: h.publish_version(-1), ConfigError, "version"),
    C("publish_version", "'1'", lambda h, s: h.publish_version("1"), ConfigError, "version"),
    C("publish_version", "True", lambda h, s: h.publish_version(True), ConfigError, "version"),
    C("publish_version", "2**63", lambda h, s: h.publish_version(2**63), ConfigError, "version"),
    C("publish_version", "older", lambda h, s: h.publish_version(1), ConfigError, "version"),
    C("end_stream", "unknown", lambda h, s: h.end_stream(["nope"]), UnknownColumnError, "nope"),
    C("end_stream", "a str", lambda h, s: h.end_stream("ids"), ConfigError, "list"),
    C("subscribe", "not callable", lambda h, s: h.subscribe(1), ConfigError, "callable"),
    C(
        "subscribe",
        "strict='yes'",
        lambda h, s: h.subscribe(lambda e: None, strict="yes"),
        ConfigError,
        "bool",
    ),
    C("flush_events", "timeout=-1", lambda h, s: h.flush_events(-1), ConfigError, "seconds"),
]


@pytest.fixture(scope="module")
def hubs() -> Iterator[dict[str, Any]]:
    """One hub per placement, made on first use, with its setup (see ``setup``)."""
    made: dict[str, Any] = {}
    yield made
    for hub, _ in made.values():
        hub.close()


def setup(placement: str) -> tuple[Any, SimpleNamespace]:
    if placement == "inproc":
        hub = flowrl.Hub(COLUMNS, tasks=TASKS, config=CONFIG)
    else:
        hub = flowrl.launch_hub(COLUMNS, tasks=TASKS, config=CONFIG)
    hub.put(rows(6))
    hub.publish_version(3)
    meta = hub.claim("train", 2, timeout=WAIT_S)
    handle = hub.meta(meta.indices, ["ids"])
    return hub, SimpleNamespace(meta=meta, handle=handle)


@pytest.fixture
def hub_and_state(placement: str, hubs: dict[str, Any]) -> tuple[Any, SimpleNamespace]:
    if placement not in hubs:
        hubs[placement] = setup(placement)
    hub, state = hubs[placement]
    return hub, state


def snapshot(hub: Any) -> Any:
    return hub.statistics(), hub.columns, hub.version


@pytest.mark.parametrize("case", CASES, ids=[f"{c.call}-{c.bad}" for c in CASES])
def test_bad_input_gets_a_typed_error_and_changes_nothing(
    case: Case, hub_and_state: tuple[Any, SimpleNamespace]
) -> None:
    hub, state = hub_and_state
    before = snapshot(hub)
    with pytest.raises(case.error) as info:
        case.run(hub, state)
    assert str(info.value), "the error says nothing"
    assert case.says in str(info.value)
    assert snapshot(hub) == before


# -- numpy integers are ints -------------------------------------------------------------
def test_numpy_integers_are_accepted_where_ints_are(make_hub: Any) -> None:
    hub = make_hub(COLUMNS, tasks=TASKS, config=CONFIG)
    n = np.int64(2)
    hub.put(rows(4), version=np.int32(0), groups=np.int64(7), tokens=np.uint8(3))
    group = hub.claim("score", np.uint32(4), sampler=GroupSampler(4), timeout=np.float32(WAIT_S))
    assert len(group) == 4
    hub.publish_version(np.int64(1))
    meta = hub.claim("train", n, min_n=np.int16(1), dp_rank=np.int64(0), timeout=WAIT_S)
    assert len(meta) == 2
    assert hub.append(meta, "gen", [[5], [6]], version=np.int64(1)).tolist() == [1, 1]
    hub.ack(meta, indices=meta.indices[:1])
    hub.drop(meta)
    rest = hub.claim("train", 10 * CAPACITY, min_n=np.int8(1), timeout=0)  # all that is ready
    assert len(rest) == 2


def test_numpy_integers_configure_the_hub_and_its_samplers() -> None:
    from flowrl import StalenessSampler

    config = HubConfig(capacity=np.int64(8), n_units=np.int32(2))
    assert (config.capacity, config.n_units) == (8, 2)
    assert type(config.capacity) is int and type(config.n_units) is int  # encodable as is
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=HubConfig) == config
    assert GroupSampler(np.int64(4)).group_size == 4
    assert BalancedSampler(np.uint8(2)).dp_size == 2
    assert StalenessSampler(np.int16(0)).max_staleness == 0
    for bad in (True, np.int64(0), 2.0):
        with pytest.raises(ConfigError, match="capacity must be a positive int"):
            HubConfig(capacity=bad)
    with pytest.raises(ConfigError, match=r"n_units must be an int in \[1, 1024\]"):
        HubConfig(n_units=np.int64(1025))


# -- a zmq client's own settings ---------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "bad"),
    [
        ("rpc_timeout", 0),
        ("rpc_timeout", -1.0),
        ("rpc_timeout", math.nan),
        ("rpc_timeout", None),
        ("rpc_timeout", "30"),
        ("max_puts_in_flight", 0),
        ("max_puts_in_flight", 2.5),
        ("max_puts_in_flight", True),
    ],
)
@pytest.mark.parametrize("placement", ["zmq"])
def test_bad_client_settings_are_refused(
    setting: str, bad: Any, hub_and_state: tuple[Any, SimpleNamespace]
) -> None:
    hub, _ = hub_and_state
    before = getattr(hub, setting)
    with pytest.raises(ConfigError, match=setting):
        setattr(hub, setting, bad)
    assert getattr(hub, setting) == before


# -- making a hub ------------------------------------------------------------------------
MAKE_CASES = [
    ("columns a str", dict(columns="ids"), ConfigError, "Column"),
    ("tasks a list", dict(tasks=["train"]), ConfigError, "tasks must map"),
    ("task name ''", dict(tasks={"": ["ids"]}), ConfigError, "task name"),
    ("task columns a str", dict(tasks={"t": "ids"}), ConfigError, "list of column names"),
    ("task of an unknown column", dict(tasks={"t": ["nope"]}), UnknownColumnError, "nope"),
    ("config a dict", dict(config={}), ConfigError, "HubConfig"),
]


@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [case[1:] for case in MAKE_CASES],
    ids=[case[0] for case in MAKE_CASES],
)
def test_a_hub_made_with_bad_input_is_refused(
    placement: str, bad: dict[str, Any], error: type[FlowRLError], says: str
) -> None:
    make = flowrl.Hub if placement == "inproc" else flowrl.launch_hub
    args: dict[str, Any] = {"tasks": None, "config": CONFIG, **bad}
    with pytest.raises(error, match=says):
        make(args.pop("columns", COLUMNS), **args).close()


def test_launch_hub_refuses_a_bad_startup_timeout() -> None:
    with pytest.raises(ConfigError, match="startup_timeout"):
        flowrl.launch_hub(COLUMNS, startup_timeout=-1)

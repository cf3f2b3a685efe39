"""Fuzzing the wire protocol: malformed multipart frames straight to the hub's zmq sockets.

A raw DEALER socket plays a broken (or hostile) client of the controller and of a storage
unit; a raw PUSH socket plays a broken controller on a unit's eviction channel. Messages
are random bytes, unknown tags, known tags with wrong field types, well-typed requests
with values out of range (negative counts, NaN timeouts, arrays that are not whole int64s
or disagree in length), writes whose frame counts do not match their headers, truncated
or oversized Arrow buffers, huge claimed lengths and broken offsets.

For every message that carries a request id and a body, the server must answer with a
``wire.Error`` (what a malformed request gets) or, for a well-typed request about
samples/leases/tasks that do not exist, a typed refusal (or a harmless ``Done``); the hub's
state must be unchanged (``statistics()`` and the stored samples, read back through a
normal client); the server processes must be alive; and a normal client must be served
afterwards.

Messages that cannot be answered are dropped, which is also checked: a message of one
frame from a DEALER (a request id without a body, so nothing to decode) and anything on
the one-way PUSH/PULL eviction channel. A request with a marker id sent right after such a
message must be the next thing answered.

``Shutdown`` is a valid request any client may send (``launch_hub`` stops servers with
it), so it is never generated. Server bugs this file found are pinned by regression tests
at its end.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import flowrl
from flowrl import Column, HubConfig
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl._transport.frames import ArrayHeader

pytestmark = pytest.mark.integration

GUARD_MS = 5000  # how long a reply may take before the test fails instead of hanging

COLUMNS = [
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
    Column.tensor("pix", "float32", (2, 2)),
    Column.string("text"),
    Column.scalar("flag", "bool"),
]
BY_NAME = {c.name: c for c in COLUMNS}
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
LIVE = [0, 1, 2, 3]
VERSION = 2

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def rows(n: int, start: int = 0) -> dict[str, Any]:
    r = range(start, start + n)
    return {
        "ids": [np.arange(i % 3, dtype=np.int64) + 10 * i for i in r],
        "reward": np.array(list(r), dtype=np.float32),
        "pix": np.stack([np.full((2, 2), i, dtype=np.float32) for i in r]),
        "text": [f"t{i}é" for i in r],
        "flag": np.array([i % 2 == 0 for i in r]),
    }


def ints(*values: int) -> bytes:
    return np.array(values, dtype=np.int64).tobytes()


# -- the hub under test ------------------------------------------------------------------------
class Target:
    """A zmq hub with known contents, raw sockets to its servers, and the checks."""

    def __init__(self) -> None:
        self.hub = hub = flowrl.launch_hub(
            COLUMNS, tasks=TASKS, config=HubConfig(capacity=32, n_units=2)
        )
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.rids = itertools.count(1)
        assert hub.put(rows(2)).tolist() == [0, 1]  # unit 0
        assert hub.put(rows(2, 2)).tolist() == [2, 3]  # unit 1
        self.lease = hub.claim("score", 2, timeout=5)
        hub.publish_version(VERSION)
        self.pids = server_pids(hub)
        assert len(self.pids) == 3, "expected a controller and two storage units"
        self.baseline = self.snapshot()
        assert self.baseline[0].live == 4 and self.baseline[0].leases == 1

    def dealer(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self.socks.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.hub.close()

    def snapshot(self) -> tuple[Any, ...]:
        hub = self.hub
        batch = hub.get(hub.meta(LIVE, list(BY_NAME)))
        data = {c: batch.arrow(c).to_pylist() for c in BY_NAME}
        return hub.statistics(), hub.columns, hub.version, data

    def check(self) -> None:
        """Servers alive, hub unchanged, a normal client served."""
        for pid in self.pids:
            assert alive(pid), f"hub server process {pid} died"
        now = self.snapshot()
        assert now[0] == self.baseline[0], "statistics() changed"
        assert now[1:3] == self.baseline[1:3], "columns or version changed"
        assert now[3] == self.baseline[3], "stored samples changed"

    def request(self, sock: zmq.Socket, body: Any, *extra: Any) -> tuple[Any, list[bytes]]:
        """Send one request with a fresh id; its decoded reply and payload frames."""
        rid = next(self.rids).to_bytes(8, "little")
        sock.send_multipart([rid, body, *extra])
        return self.reply_to(sock, rid)

    @staticmethod
    def reply_to(sock: zmq.Socket, rid: bytes) -> tuple[Any, list[bytes]]:
        assert sock.poll(GUARD_MS), "the server did not answer"
        frames = sock.recv_multipart()
        assert frames[0] == rid, "a reply to some other request arrived first"
        return wire.decode_reply(frames[1]), frames[2:]

    def dropped(self, sock: zmq.Socket, *frames: bytes) -> None:
        """``frames`` cannot be answered: the next reply is the one to a marker request."""
        sock.send_multipart(list(frames))
        reply, _ = self.request(sock, wire.encode(wire.UnitStatsReq()))
        assert not isinstance(reply, wire.Error) or reply.type == "SchemaError"

    def still_serves(self) -> None:
        hub = self.hub
        new = hub.put(rows(2, 4)).tolist()
        meta = hub.claim("train", 10, min_n=1, timeout=5)
        assert meta.indices.tolist() == [*LIVE, *new]
        batch = hub.get(meta, columns=["text", "reward"])
        assert batch.arrow("text").to_pylist() == [f"t{i}é" for i in range(6)]
        hub.ack(meta)
        hub.ack(self.lease)
        assert hub.statistics().tasks["train"].consumed == 6


def server_pids(hub: Any) -> list[int]:
    """Processes serving this hub (its launcher's; their command lines name nothing of it:
    specs travel on stdin)."""
    return [proc.pid for proc in hub.servers.procs]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # not a zombie


@pytest.fixture
def target() -> Iterator[Target]:
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("finding the server processes needs /proc")
    t = Target()
    yield t
    t.close()


def encode_map(fields: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(fields)


# -- strategies: what a broken client sends -------------------------------------------------------
CONTROLLER_TAGS = [
    "hello", "declare", "task", "reserve", "abort", "check", "commit", "claim", "meta",
    "ack", "release", "publish", "end", "stats", "pub_hello",
]  # fmt: skip
UNIT_TAGS = ["write", "read", "evict", "discard", "unit_stats"]

junk = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=6),
        st.binary(max_size=12),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def malformed(body: bytes) -> bool:
    """Whether the servers' own decoder refuses ``body`` (the server must say so)."""
    try:
        wire.decode_request(body)
    except flowrl.errors.TransportError:
        return True
    return False


@st.composite
def garbage_bodies(draw: st.DrawFn, tags: list[str]) -> bytes:
    """Bodies that do not decode to a valid request."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "unknown-tag", "wrong-fields"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=64))
    elif kind == "msgpack":
        body = msgspec.msgpack.encode(draw(junk))
    elif kind == "unknown-tag":
        fields = draw(st.dictionaries(st.text(max_size=5), junk, max_size=3))
        fields["op"] = draw(st.one_of(st.text(max_size=8), junk))
        body = encode_map(fields)
    else:  # a known tag, fields of the wrong type (or missing, or extra)
        fields = draw(
            st.dictionaries(
                st.sampled_from(
                    [
                        "n",
                        "task",
                        "indices",
                        "columns",
                        "timeout",
                        "lease",
                        "version",
                        "cells",
                        "new",
                        "arrays",
                        "sampler",
                        "min_n",
                        "token",
                        "unit",
                        "drop",
                        "x",
                    ]
                ),
                junk,
                max_size=4,
            )
        )
        fields["op"] = draw(st.sampled_from(tags))
        body = encode_map(fields)
    assume(malformed(body))
    return body


nan_or_negative = st.one_of(st.just(math.nan), st.floats(max_value=-1e-6), st.just(-math.inf))
not_int64s = st.binary(max_size=20).filter(lambda b: len(b) % 8 != 0)
unknown_indices = st.lists(
    st.one_of(st.integers(64, 2**62), st.integers(-(2**62), -1)), min_size=1, max_size=3
).map(lambda v: ints(*v))


@st.composite
def out_of_range_requests(draw: st.DrawFn) -> bytes:
    """Well-typed requests whose values break the protocol's constraints."""
    pick = draw(st.integers(0, 11))
    if pick == 0:
        msg: dict[str, Any] = {"op": "reserve", "n": draw(st.integers(-(2**63), 0))}
    elif pick == 1:
        msg = {"op": "reserve", "n": 1, "timeout": draw(nan_or_negative)}
    elif pick == 2:
        msg = {"op": "claim", "task": "train", "n": draw(st.integers(-(2**63), 0))}
    elif pick == 3:
        msg = {"op": "claim", "task": "train", "n": 1, "timeout": draw(nan_or_negative)}
    elif pick == 4:
        msg = {"op": "claim", "task": "train", "n": 1, "lease_timeout": draw(
            st.one_of(nan_or_negative, st.just(0.0)))}  # fmt: skip
    elif pick == 5:
        n = draw(st.integers(1, 5))
        msg = {"op": "claim", "task": "train", "n": n, "min_n": draw(st.integers(n + 1, 99))}
    elif pick == 6:
        msg = {"op": "claim", "task": "train", "n": 1, "sampler": {"op": "group",
               "group_size": draw(st.integers(-5, 0))}}  # fmt: skip
    elif pick == 7:
        tag = draw(st.sampled_from(["abort", "check", "meta", "ack"]))
        msg = {"op": tag, "indices": draw(not_int64s), "columns": ["ids"], "task": "score",
               "lease": 1}  # fmt: skip
    elif pick == 8:  # a commit whose per-sample arrays disagree with its indices
        n = draw(st.integers(1, 3))
        bad = ints(*range(draw(st.integers(0, 4).filter(lambda k: k != n))))
        where = draw(st.sampled_from(["nbytes", "lengths", "groups", "tokens"]))
        cell = [bad if where == "nbytes" else ints(*[8] * n)]
        if where == "lengths":
            cell.append(bad)
        msg = {"op": "commit", "indices": ints(*range(100, 100 + n)), "cells": {"ids": cell},
               "new": True}  # fmt: skip
        if where in ("groups", "tokens"):
            msg[where] = bad
    elif pick == 9:
        msg = {"op": "commit", "indices": b"", "cells": {}, "new": True}
    elif pick == 10:
        msg = {"op": "publish", "version": draw(st.integers(-(2**63), -1))}
    else:
        msg = {"op": "ack", "task": "score", "lease": draw(st.integers(2**63, 2**64 - 1))}
    body = encode_map(msg)
    assume(malformed(body))
    return body


@st.composite
def refused_requests(draw: st.DrawFn, lease: int) -> bytes:
    """Well-formed requests about things that do not exist, or conflicting: refused (or a
    no-op) by the controller, never a change. Nothing here can lease, put or end."""
    pick = draw(st.integers(0, 11))
    other = draw(st.text(min_size=1, max_size=6).filter(lambda t: t not in TASKS))
    if pick == 0:
        msg: Any = commands.Claim(task=other, n=draw(st.integers(1, 2**62)))
    elif pick == 1:
        msg = commands.Claim(task="train", n=1, columns=[draw(st.sampled_from(["text", "nope"]))])
    elif pick == 2:
        lid = draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != lease))
        msg = commands.Ack(task="score", lease=lid, drop=draw(st.booleans()))
    elif pick == 3:
        msg = commands.Ack(task="score", lease=lease, indices=draw(unknown_indices))
    elif pick == 4:
        msg = commands.Release(task=draw(st.sampled_from(["train", other])), lease=lease)
    elif pick == 5:
        cases = st.sampled_from([ints(*LIVE), ints(-1)])
        msg = commands.Abort(indices=draw(st.one_of(unknown_indices, cases)))
    elif pick == 6:
        msg = commands.CheckUpdate(indices=draw(unknown_indices), columns=["reward"])
    elif pick == 7:
        msg = commands.MetaOf(indices=draw(unknown_indices), columns=["ids"])
    elif pick == 8:
        idx = draw(unknown_indices)
        n = len(idx) // 8
        msg = commands.Commit(
            indices=idx, cells={"reward": commands.Cell(ints(*[4] * n))}, new=False
        )
    elif pick == 9:
        msg = commands.PublishVersion(version=draw(st.integers(0, VERSION - 1)))
    elif pick == 10:
        msg = commands.Declare(
            columns=[Column.scalar(draw(st.sampled_from(list(BY_NAME))), "int8")]
        )
    else:
        msg = commands.RegisterTask(task="train", columns=[draw(st.sampled_from(["text", "nope"]))])
    return wire.encode(msg)


# -- the controller ----------------------------------------------------------------------------
def test_controller_answers_garbage_with_errors(target: Target) -> None:
    sock = target.dealer(target.hub.address)

    @FUZZ
    @given(body=garbage_bodies(CONTROLLER_TAGS + UNIT_TAGS), extra=st.integers(0, 2))
    def run(body: bytes, extra: int) -> None:
        note(repr(body))
        reply, _ = target.request(sock, body, *[b"x" * k for k in range(extra)])
        assert isinstance(reply, wire.Error), reply
        assert reply.type == "TransportError" and reply.message
        target.check()

    run()
    target.still_serves()


def test_controller_refuses_out_of_range_values(target: Target) -> None:
    sock = target.dealer(target.hub.address)

    @FUZZ
    @given(body=out_of_range_requests())
    def run(body: bytes) -> None:
        note(repr(msgspec.msgpack.decode(body)))
        reply, _ = target.request(sock, body)
        assert isinstance(reply, wire.Error) and reply.type == "TransportError", reply
        target.check()

    run()
    target.still_serves()


def test_controller_refuses_requests_about_what_does_not_exist(target: Target) -> None:
    sock = target.dealer(target.hub.address)

    @FUZZ
    @given(body=refused_requests(target.lease.lease))
    def run(body: bytes) -> None:
        msg = wire.decode_request(body)
        note(repr(msg))
        reply, _ = target.request(sock, body)
        if isinstance(msg, commands.Abort):  # giving back reservations nobody holds: a no-op
            assert isinstance(reply, wire.Error | wire.Done), reply
        elif isinstance(msg, commands.Claim) and msg.task != "train":
            assert isinstance(reply, wire.Error) and reply.type == "UnknownTaskError", reply
        else:
            assert isinstance(reply, wire.Error), reply
            assert reply.type in flowrl.errors.__all__ and reply.type != "FlowRLError", reply
        target.check()

    run()
    target.still_serves()


def test_controller_drops_what_it_cannot_answer(target: Target) -> None:
    sock = target.dealer(target.hub.address)
    for lonely in [b"", b"rid-only", wire.encode(wire.Stats())]:
        target.dropped(sock, lonely)  # one frame: a request id but no body to answer
        target.check()
    target.still_serves()


# -- a storage unit ----------------------------------------------------------------------------
def write(indices: bytes, columns: list[Column], headers: list[ArrayHeader]) -> bytes:
    return wire.encode(wire.write_request(indices, columns, headers))


def good_buffers(column: Column, n: int) -> list[bytes]:
    """The frames a correct write of ``n`` samples of ``column`` carries."""
    if column.kind == "scalar":
        if column.dtype == "bool":
            return [np.packbits(np.ones(n, dtype=bool), bitorder="little").tobytes()]
        return [np.zeros(n, dtype=column.np_dtype).tobytes()]
    if column.kind == "tensor":
        return [np.zeros(n * 4, dtype=column.np_dtype).tobytes()]
    offsets = np.arange(n + 1, dtype=np.int64) * 2
    data = np.zeros(2 * n, dtype=np.int64).tobytes() if column.kind == "ragged" else b"ab" * n
    return [offsets.tobytes(), data]


@st.composite
def broken_writes(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A write to never-allocated indices that is wrong in its framing or its buffers."""
    kind = draw(
        st.sampled_from(
            [
                "fewer-frames",
                "more-frames",
                "truncated",
                "oversized",
                "huge-length",
                "length-mismatch",
                "offsets-start",
                "offsets-decrease",
                "offsets-huge",
                "utf8",
                "unknown-column",
                "duplicate",
                "indices",
            ]
        )
    )
    if kind.startswith("offsets"):
        column = BY_NAME[draw(st.sampled_from(["ids", "text"]))]
    elif kind == "utf8":
        column = BY_NAME["text"]
    else:
        column = draw(st.sampled_from(COLUMNS))
    n = draw(st.integers(2 if kind == "offsets-decrease" else 1, 4))
    idx = ints(*range(200, 200 + n))
    frames = good_buffers(column, n)
    header = ArrayHeader(column.name, n, len(frames))
    if kind == "fewer-frames":
        frames = frames[: draw(st.integers(0, len(frames) - 1))]
    elif kind == "more-frames":
        frames = frames + [b"x"] * draw(st.integers(1, 3))
    elif kind == "truncated":
        k = draw(st.integers(0, len(frames) - 1))
        frames[k] = frames[k][: draw(st.integers(0, len(frames[k]) - 1))]
    elif kind == "oversized":
        k = draw(st.integers(0, len(frames) - 1))
        frames[k] = frames[k] + draw(st.binary(min_size=1, max_size=9))
    elif kind == "huge-length":
        header = ArrayHeader(column.name, draw(st.integers(2**40, 2**63 - 1)), len(frames))
    elif kind == "length-mismatch":
        header = ArrayHeader(column.name, n + draw(st.integers(1, 3)), len(frames))
    elif kind == "utf8":
        frames[1] = b"\xff\xfe" * n  # the right size, not UTF-8
    elif kind.startswith("offsets"):
        offsets = np.frombuffer(frames[0], dtype=np.int64).copy()  # 0, 2, 4, ..., 2n
        if kind == "offsets-start":
            offsets += draw(st.integers(1, 2**40))
        elif kind == "offsets-decrease":  # an inner offset past the end: lengths < 0
            offsets[1] = offsets[-1] + draw(st.integers(1, 5))
        else:
            offsets[-1] = draw(st.integers(2**40, 2**62))
        frames[0] = offsets.tobytes()
    elif kind == "unknown-column":
        header = ArrayHeader(draw(st.sampled_from(["nope", "reward2"])), n, len(frames))
    elif kind == "duplicate":
        return write(idx, [column], [header, header]), frames + frames
    else:
        idx = draw(not_int64s)
    return write(idx, [column], [header]), frames


APPEND_COLUMNS = [
    BY_NAME["ids"],
    Column.ragged("ids", "float32"),  # another dtype than the stored one
    Column.ragged("gen", "int64"),
    Column.scalar("reward", "float32"),  # not ragged
    Column.string("text"),
]


@st.composite
def broken_appends(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """Token appends that must be refused: to samples the unit does not hold, to columns
    already complete, or with frames that do not match their header."""
    column = draw(st.sampled_from(APPEND_COLUMNS))
    live = draw(st.booleans()) and column.name in BY_NAME  # complete columns only
    n = draw(st.integers(1, 2))
    idx = ints(*(LIVE[:n] if live else range(200, 200 + n)))
    frames = good_buffers(column, n)
    header = ArrayHeader(column.name, n, len(frames))
    columns, headers = [column], [header]
    broken = draw(
        st.sampled_from(["none", "frames", "length", "truncated", "indices", "names", "twice"])
    )
    if broken == "names":  # the header of another column than the one named
        headers = [ArrayHeader("other", n, len(frames))]
    elif broken == "twice":  # one column appended twice in one request
        columns, headers, frames = [column] * 2, [header] * 2, frames * 2
    elif broken == "frames":
        frames = frames[:-1]
    elif broken == "length":
        headers = [ArrayHeader(column.name, n + 1, len(frames))]
    elif broken == "truncated":
        frames[-1] = frames[-1][:-1]
    elif broken == "indices":
        idx = draw(st.one_of(not_int64s, st.just(ints(-1))))
    version = draw(st.integers(0, 9))
    msg = wire.Append(indices=idx, columns=columns, version=version, arrays=headers)
    return wire.encode(msg), frames


def test_storage_unit_refuses_broken_writes_and_reads(target: Target) -> None:
    units = [target.dealer(a) for a in target.hub.unit_addresses]

    @FUZZ
    @given(
        unit=st.sampled_from([0, 1]),
        case=st.one_of(
            broken_writes(),
            broken_appends(),
            st.builds(
                lambda i, c: (wire.encode(wire.ReadPartial(indices=i, column=c)), []),
                st.one_of(not_int64s, unknown_indices),
                st.sampled_from(APPEND_COLUMNS),
            ),
            garbage_bodies(UNIT_TAGS + CONTROLLER_TAGS).map(lambda b: (b, [])),
            st.builds(
                lambda i, c: (wire.encode(wire.Read(indices=i, columns=c)), []),
                st.one_of(not_int64s, unknown_indices, st.just(ints(*LIVE))),
                st.lists(st.sampled_from(["nope", "ids", ""]), min_size=1, max_size=2),
            ),
            st.builds(
                lambda i: (wire.encode(wire.Discard(indices=i, columns=["ids"])), []),
                not_int64s,
            ),
            st.sampled_from(
                [
                    (wire.encode(wire.Stats()), []),
                    (wire.encode(commands.Claim(task="train", n=1)), []),
                    (wire.encode(wire.Evict(indices=ints(*LIVE))), []),
                    (wire.encode(commands.PublishVersion(version=99)), []),
                ]
            ),
        ),
    )
    def run(unit: int, case: tuple[bytes, list[bytes]]) -> None:
        body, frames = case
        note(repr((unit, body, [len(f) for f in frames])))
        reply, payload = target.request(units[unit], body, *frames)
        msg = None if malformed(body) else wire.decode_request(body)
        if isinstance(msg, wire.Read) and len(msg.indices) % 8 == 0 and set(msg.columns) <= {"ids"}:
            # reading what is there is allowed: the right rows come back, or a typed refusal
            assert isinstance(reply, wire.Arrays | wire.Error), reply
        else:
            assert isinstance(reply, wire.Error), reply
            assert payload == []
        target.check()

    run()
    target.still_serves()


def test_storage_unit_drops_what_it_cannot_answer(target: Target) -> None:
    sock = target.dealer(target.hub.unit_addresses[1])
    for lonely in [b"", b"rid-only"]:
        target.dropped(sock, lonely)
        target.check()
    # The eviction channel is one-way (controller -> unit): nothing there can be answered.
    # Garbage on it is logged by the unit and dropped; the unit keeps serving.
    push = target.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(target.hub.unit_addresses[1] + "-ctl")
    try:
        for body in [b"", b"\x00\xff", wire.encode(wire.Stats()), encode_map({"op": "evict"})]:
            push.send(body)
            push.send(wire.encode(wire.Evict(indices=b"\x01\x02\x03")))  # not whole int64s
        time.sleep(0.2)  # let them arrive (no reply can tell when they were handled)
        target.check()
    finally:
        push.close()
    target.still_serves()


# -- regressions: bugs this file found in the servers ---------------------------------------
def test_controller_survives_very_long_waits_and_leases(target: Target) -> None:
    """The nearest deadline (a parked request's or a lease's) may be decades or infinitely
    far; the controller's event loop must not overflow zmq's int poll timeout and die."""
    hub = target.hub
    hub.ack(target.lease)  # no other lease deadline nearer than the ones under test
    sock = target.dealer(hub.address)
    parked = [
        commands.Claim(task="train", n=30, timeout=math.inf),  # first: alone, the nearest
        commands.Claim(task="train", n=30, timeout=1e10),
        commands.Reserve(n=29, timeout=1e10),  # 28 free slots
    ]
    for k, msg in enumerate(parked):
        sock.send_multipart([b"parked%d" % k, wire.encode(msg)])  # nothing can satisfy it
        reply, _ = target.request(sock, wire.encode(wire.Stats()))  # it serves on
        assert isinstance(reply, wire.StatsReply)
    granted, _ = target.request(
        sock, wire.encode(commands.Claim(task="train", n=1, lease_timeout=1e10))
    )
    assert isinstance(granted, wire.MetaReply)
    time.sleep(0.2)  # a loop turn or two with only far deadlines
    assert all(alive(pid) for pid in target.pids)
    reply, _ = target.request(sock, wire.encode(wire.Stats()))
    assert isinstance(reply, wire.StatsReply)
    assert reply.stats.leases == 1


@pytest.fixture(scope="module")
def unchanged_target() -> Iterator[Target]:
    """One hub for the regression tests below, each of which must leave it unchanged."""
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("finding the server processes needs /proc")
    t = Target()
    yield t
    t.close()


def test_abort_of_index_minus_one_changes_nothing(unchanged_target: Target) -> None:
    target = unchanged_target
    sock = target.dealer(target.hub.address)
    target.request(sock, wire.encode(commands.Abort(indices=ints(-1))))
    target.check()


def test_a_refused_write_does_not_retype_a_column(unchanged_target: Target) -> None:
    target = unchanged_target
    sock = target.dealer(target.hub.unit_addresses[0])
    retyped = Column.scalar("ids", "float32")
    body = write(ints(300), [retyped], [ArrayHeader("ids", 1, 1)])
    reply, _ = target.request(sock, body, b"abc")  # 3 bytes cannot hold a float32
    assert isinstance(reply, wire.Error)
    target.check()


def test_a_new_commit_of_a_committed_sample_is_refused(unchanged_target: Target) -> None:
    target = unchanged_target
    sock = target.dealer(target.hub.address)
    cells = {c: commands.Cell(ints(8)) for c in ("reward", "flag")}
    reply, _ = target.request(
        sock, wire.encode(commands.Commit(indices=ints(3), cells=cells, new=True, version=7))
    )
    assert isinstance(reply, wire.Error)
    target.check()

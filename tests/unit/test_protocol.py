"""Commands are defined once: the Struct a client builds is what the controller runs,
in-process as it is or after a trip through the wire codec."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler
from flowrl._protocol import codec, commands
from flowrl._schema.columns import Column
from flowrl._transport import wire
from flowrl.errors import TransportError

COMMANDS = [
    commands.Declare(columns=(Column.scalar("x", "int64"),)),
    commands.RegisterTask(task="t", columns=("x",)),
    commands.RegisterTask(task="t", columns=("x",), partition="step-3"),
    commands.UnregisterTask(task="t"),
    commands.Reserve(n=2, timeout=1.5, units=[0], ahead=4, give_back=np.arange(3)),
    commands.Abort(indices=np.arange(2)),
    commands.CheckUpdate(indices=np.arange(2), columns=("x",), ack=commands.LeaseRef("t", 3)),
    commands.Commit(
        indices=np.arange(2),
        cells={"x": commands.Cell(np.full(2, 8), np.ones(2, np.int64))},
        new=True,
        groups=np.zeros(2, np.int64),
        versions=np.array([1, 2]),
        tokens=np.array([3, 4]),
        ack=commands.LeaseRef("t", 1),
        put_id=9,
    ),
    commands.Claim(task="t", n=2, sampler=commands.GroupSpec(group_size=2), columns=("x",)),
    commands.MetaOf(indices=np.arange(2), columns=("x",)),
    commands.Ack(task="t", lease=5, indices=np.arange(1), drop=True),
    commands.Release(task="t", lease=5),
    commands.PublishVersion(version=3),
    commands.EndStream(columns=("x",)),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_survives_the_wire_unchanged(cmd: commands.Command) -> None:
    body = codec.encode(cmd)
    got = wire.decode_request(body)
    assert type(got) is type(cmd)
    assert codec.encode(got) == body  # arrays compare by value through their encoding


def test_arrays_arrive_as_read_only_views_of_the_frame() -> None:
    body = codec.encode(commands.Abort(indices=np.arange(4)))
    got = wire.decode_request(body)
    assert got.indices.dtype == np.int64 and got.indices.tolist() == [0, 1, 2, 3]
    assert not got.indices.flags.writeable
    assert isinstance(got.indices.base, bytes)  # a view of the decoded bytes, no copy


@pytest.mark.parametrize("bad", [b"\x00" * 7, "text", 3])
def test_an_array_that_is_not_whole_int64s_is_refused_naming_its_field(bad: object) -> None:
    body = msgspec.msgpack.encode({"op": "ack", "task": "t", "lease": 1, "indices": bad})
    with pytest.raises(TransportError, match=r"indices"):
        wire.decode_request(body)


def test_the_controller_runs_the_decoded_command_as_it_runs_the_built_one() -> None:
    def run(decode: bool) -> list[int]:
        ctl = Controller(8)
        ctl.add_columns((Column.scalar("x", "int64"),))
        ctl.register_task("t", ("x",))
        with ctl.cond:
            idx, _ = ctl.reserve(3)
            commit = commands.Commit(
                indices=idx, cells={"x": commands.Cell(np.full(3, 8))}, new=True, version=0
            )
            claim = commands.Claim(task="t", n=2)
            if decode:
                commit = wire.decode_request(codec.encode(commit))
                claim = wire.decode_request(codec.encode(claim))
            ctl.commit(commit)
            meta = ctl.try_claim(claim, FifoSampler())
        assert meta is not None
        return meta.indices.tolist()

    assert run(decode=True) == run(decode=False) == [0, 1]

"""Writes carry their column declarations and commit pre-encoded: what a unit decodes of
them, what it remembers, and what it refuses."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from flowrl import Column
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl._transport.frames import ArrayHeader
from flowrl.errors import TransportError

COLUMNS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
HEADERS = [ArrayHeader("ids", 1, 2), ArrayHeader("reward", 1, 1)]
ONE = np.arange(1, dtype=np.int64).tobytes()


def _commit(indices: bytes = ONE, nbytes: int = 1) -> commands.Commit:
    cell = commands.Cell(np.full(nbytes, 8, dtype=np.int64).tobytes())
    return commands.Commit(indices=indices, cells={"ids": cell, "reward": cell}, new=True)


def _sent(msg: wire.Write) -> wire.Write:
    out = wire.decode_request(wire.encode(msg))
    assert isinstance(out, wire.Write)
    return out


def test_a_write_carries_its_declarations_and_the_unit_decodes_them_once() -> None:
    first = _sent(wire.write_request(ONE, COLUMNS, HEADERS))
    again = _sent(wire.write_request(np.arange(1, 2, dtype=np.int64).tobytes(), COLUMNS, HEADERS))
    assert not first.has_commit
    assert wire.columns_of(first) == COLUMNS
    assert wire.columns_of(again) is wire.columns_of(first)  # the same declarations: cached
    other = _sent(wire.write_request(ONE, COLUMNS[:1], HEADERS[:1]))
    assert wire.columns_of(other) == COLUMNS[:1]


@pytest.mark.parametrize(
    "declared",
    [
        [{"name": "1x", "kind": "scalar", "dtype": "int64", "shape": []}],  # not an identifier
        [{"name": "x", "kind": "matrix", "dtype": "int64", "shape": []}],
        [{"name": "x", "kind": "scalar", "dtype": "complex64", "shape": []}],
        {"name": "x"},  # not a list
        "garbage",
    ],
)
def test_malformed_declarations_are_refused(declared: object) -> None:
    msg = wire.Write(
        indices=ONE, columns=msgspec.Raw(msgspec.msgpack.encode(declared)), arrays=HEADERS
    )
    with pytest.raises(TransportError, match="malformed Write request: columns"):
        wire.columns_of(_sent(msg))


def test_the_commit_travels_encoded_and_is_checked_where_it_is_decoded() -> None:
    msg = _sent(
        wire.write_request(ONE, COLUMNS, HEADERS, _commit(), "ipc://controller", b"producer")
    )
    assert msg.has_commit
    # the unit hands it on as it came; the controller decodes it with the rest, once
    handed = wire.decode_request(
        wire.encode(wire.CommitFor(commit=msg.commit, reply_to=msg.reply_to))
    )
    assert isinstance(handed, wire.CommitFor) and isinstance(handed.commit, commands.Commit)
    assert wire.encode(handed.commit) == wire.encode(_commit())  # arrays: by value
    bad = wire.write_request(ONE, COLUMNS, HEADERS, _commit(nbytes=2), "ipc://c", b"producer")
    for commit, problem in [
        (_sent(bad).commit, r"malformed CommitFor request: commit: cells\['ids'\]"),
        (msgspec.Raw(msgspec.msgpack.encode([1])), r"malformed request: .* `\$.commit`"),
    ]:
        frame = wire.encode(wire.CommitFor(commit=commit, reply_to=b"producer"))
        with pytest.raises(TransportError, match=problem):
            wire.decode_request(frame)
        assert wire.reply_to_of(frame) == b"producer"  # who hears of it
    assert wire.reply_to_of(wire.encode(wire.Hello())) is None


@pytest.mark.parametrize(
    ("commit", "controller", "reply_to", "problem"),
    [
        (_commit(indices=np.arange(1, 2, dtype=np.int64).tobytes()), "ipc://c", b"p", "other"),
        (_commit(), "", b"p", "address"),
        (_commit(), "ipc://c", b"", "address"),
    ],
)
def test_a_unit_refuses_a_commit_it_cannot_hand_on(
    commit: commands.Commit, controller: str, reply_to: bytes, problem: str
) -> None:
    body = wire.encode(wire.write_request(ONE, COLUMNS, HEADERS, commit, controller, reply_to))
    with pytest.raises(TransportError, match=problem):
        wire.decode_request(body)

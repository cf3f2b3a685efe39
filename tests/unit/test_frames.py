"""Arrow arrays -> zmq frames -> Arrow arrays, for every column kind, whole and sliced."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl import Column
from flowrl._schema.encode import encode
from flowrl._transport.frames import check_frames, from_frames, to_frames
from flowrl.errors import TransportError

CASES = [
    (Column.scalar("s", "float32"), np.arange(7, dtype=np.float32)),
    (Column.scalar("b", "bool"), np.array([1, 0, 1, 1, 0, 0, 1], dtype=bool)),
    (Column.tensor("t", "int16", (2, 3)), np.arange(42, dtype=np.int16).reshape(7, 2, 3)),
    (Column.ragged("r", "int64"), [np.arange(i, dtype=np.int64) + 10 * i for i in range(7)]),
    (Column.ragged("rb", "bool"), [np.arange(i) % 2 == 0 for i in range(7)]),
    (Column.string("str"), ["", "a", "bé", "ccc", "", "dddd", "é"]),
    (Column.object("o"), [{"k": i} for i in range(7)]),
]


@pytest.mark.parametrize(("column", "values"), CASES, ids=[c.name for c, _ in CASES])
@pytest.mark.parametrize("window", [(0, 7), (2, 4), (3, 0), (6, 1)])
def test_round_trip_sends_only_the_slice(column: Column, values: object, window: tuple) -> None:
    array = encode(column, values, 7, "test").array
    start, length = window
    part = array.slice(start, length)
    header, frames = to_frames(column.name, column, part)
    assert header.length == length
    sent = [bytes(memoryview(f)) for f in frames]  # what a socket would carry
    back = from_frames(column, header, sent)
    assert back.to_pylist() == part.to_pylist()
    if column.kind == "ragged" and column.dtype != "bool":
        nbytes = sum(len(x) for x in part.to_pylist()) * np.dtype(column.dtype).itemsize
        assert len(sent[1]) == nbytes  # the slice's values, not the chunk's


@pytest.mark.parametrize(("column", "values"), CASES, ids=[c.name for c, _ in CASES])
def test_checked_frames_build_over_a_copy_and_wrong_frame_counts_are_refused(
    column: Column, values: object
) -> None:
    array = encode(column, values, 7, "test").array
    header, frames = to_frames(column.name, column, array)
    build = check_frames(column, header, frames)
    copies = [bytearray(memoryview(f)) for f in frames]  # as a unit copies into its arena
    assert build(copies).to_pylist() == array.to_pylist()
    for wrong in ([*frames, b""], frames[:-1]):
        with pytest.raises(TransportError, match="frames for a"):
            check_frames(column, header, wrong)

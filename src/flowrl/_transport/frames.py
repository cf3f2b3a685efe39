"""Arrow arrays ↔ zmq frames without serialisation copies.

An array of one of flowrl's column kinds is sent as a small msgspec header plus its raw
buffers, each buffer its own frame (zmq sends them zero-copy from Arrow memory and the
receiver wraps the received frames as Arrow buffers without copying). Sliced arrays send
only the bytes of their slice. flowrl never stores nulls, so no validity bitmaps travel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._client.batch import LazyColumn
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded, arrow_of_buffers
from flowrl._schema.ragged import RaggedArray, arrow_ragged_parts
from flowrl._schema.small import never_decreasing
from flowrl.errors import TransportError

__all__ = [
    "ZERO_COPY_MIN_BYTES",
    "ArrayHeader",
    "check_frames",
    "encoded_frames",
    "from_frames",
    "split_frames",
    "to_frames",
    "to_frames_all",
    "window_of",
]


_Size = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


#: Payloads smaller than this are copied into zmq messages: for a few kilobytes that is
#: cheaper than zero-copy's per-frame bookkeeping (single-sample puts ~30% faster).
ZERO_COPY_MIN_BYTES = 64 * 1024


class ArrayHeader(msgspec.Struct, frozen=True, array_like=True):
    column: str
    length: _Size
    frames: _Size  # how many buffer frames follow for this array


def to_frames(name: str, column: Column, arr: pa.Array) -> tuple[ArrayHeader, list[Any]]:
    """Header and buffers (memoryview-able) for one array."""
    n = len(arr)
    kind = column.kind
    if kind == "scalar":
        return ArrayHeader(name, n, 1), [_primitive_slice(arr, column)]
    if kind == "tensor":
        storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
        return ArrayHeader(name, n, 1), [_primitive_slice(storage.flatten(), column)]
    if kind == "ragged":
        raw, data, first = arrow_ragged_parts(arr, column.np_dtype)
        start, end = int(raw[0]), int(raw[-1])
        if data is None:
            values = _primitive_slice(arr.values.slice(start, end - start), column)
        else:
            width = column.np_dtype.itemsize
            values = data.slice(first * width, (end - start) * width)
        # the slice's offsets rebased to 0 (a small copy: n+1 int64)
        return ArrayHeader(name, n, 2), [raw - start, values]
    # string / object: offsets + data bytes of the slice
    buffers = arr.buffers()  # validity, offsets, data
    raw = np.frombuffer(buffers[1], dtype=np.int64, count=n + 1, offset=arr.offset * 8)
    start, end = int(raw[0]), int(raw[-1])
    data = buffers[2]
    return ArrayHeader(name, n, 2), [raw - start, data.slice(start, end - start) if data else b""]


def encoded_frames(name: str, encoded: Encoded) -> tuple[ArrayHeader, list[Any]]:
    """Header and buffers of a column a put encoded: the buffers it was encoded to, or
    those of its Arrow array (bools, strings, objects, and parts of a put split across
    units)."""
    if encoded.buffers is None:
        return to_frames(name, encoded.column, encoded.array)
    return ArrayHeader(name, encoded.length, len(encoded.buffers)), encoded.buffers


def to_frames_all(arrays: Iterable[tuple[Column, pa.Array]]) -> tuple[list[ArrayHeader], list[Any]]:
    """Headers and buffers of several arrays, each array's buffers after the previous'."""
    headers: list[ArrayHeader] = []
    frames: list[Any] = []
    for column, arr in arrays:
        header, bufs = to_frames(column.name, column, arr)
        headers.append(header)
        frames.extend(bufs)
    return headers, frames


def split_frames(headers: Sequence[ArrayHeader], frames: Sequence[Any], what: str) -> list[Any]:
    """Each header's own frames, in order; TransportError unless the counts add up."""
    if sum(h.frames for h in headers) != len(frames):
        raise TransportError(f"{what}: frame count does not match its headers")
    out, pos = [], 0
    for header in headers:
        out.append(frames[pos : pos + header.frames])
        pos += header.frames
    return out


def from_frames(column: Column, header: ArrayHeader, frames: Sequence[Any]) -> pa.Array:
    """Rebuild an array from received frames (zero-copy over the frames' memory);
    TransportError if they do not hold the array ``header`` describes."""
    return check_frames(column, header, frames)(frames)


def check_frames(
    column: Column, header: ArrayHeader, frames: Sequence[Any]
) -> Callable[[Sequence[Any]], pa.Array]:
    """Check that ``frames`` hold the array ``header`` describes (TransportError if not);
    returns what builds it, zero-copy, over those bytes or a copy of them.

    A storage unit accepts a write once every column is checked and builds the Arrow
    arrays only then: the first Arrow calls after a pause cost ~100 µs (cold caches), and
    none of them are needed to know that a write is well formed.
    """
    n = header.length
    kind = column.kind
    if len(frames) != (1 if kind in ("scalar", "tensor") else 2):
        raise TransportError(f"column {column.name!r}: {len(frames)} frames for a {kind} array")
    if kind == "scalar":
        _check_values(column, frames[0], n)
        return lambda bufs: arrow_of_buffers(column, n, n, bufs)
    if kind == "tensor":
        size = math.prod(column.shape)
        _check_values(column, frames[0], n * size)
        return lambda bufs: arrow_of_buffers(column, n, n * size, bufs)
    if memoryview(frames[0]).nbytes != (n + 1) * 8:
        raise TransportError(f"column {column.name!r}: offsets frame has the wrong size")
    total = _check_offsets(column, np.frombuffer(frames[0], dtype=np.int64))
    if kind == "ragged":
        _check_values(column, frames[1], total)
        return lambda bufs: arrow_of_buffers(column, n, total, bufs)
    if memoryview(frames[1]).nbytes != total:
        raise TransportError(f"column {column.name!r}: data frame has the wrong size")
    if kind == "string":  # UTF-8: a consumer must be able to decode what it reads
        try:
            _blobs(column, n, frames).validate(full=True)
        except pa.ArrowInvalid as exc:
            raise TransportError(f"column {column.name!r}: malformed frames ({exc})") from None
    return lambda bufs: _blobs(column, n, bufs)


def _check_values(column: Column, frame: Any, count: int) -> None:
    width = column.np_dtype.itemsize
    need = (count + 7) // 8 if column.dtype == "bool" else count * width
    got = memoryview(frame).nbytes
    if got != need:
        raise TransportError(
            f"column {column.name!r}: a {column.dtype} frame of {got} bytes cannot hold "
            f"{count} values"
        )


def _blobs(column: Column, n: int, bufs: Sequence[Any]) -> pa.Array:
    offsets, data = pa.py_buffer(bufs[0]), pa.py_buffer(bufs[1])
    return pa.Array.from_buffers(column.arrow_type, n, [None, offsets, data])


def window_of(
    column: Column, header: ArrayHeader, frames: list[Any], start: int, n: int
) -> LazyColumn | None:
    """Rows ``[start, start + n)`` of a whole chunk received as ``frames`` (``header`` its
    length), as read-only numpy views with their Arrow array built on demand; None for
    the kinds read through Arrow (strings, objects, bools). The rows are checked as
    :func:`from_frames` checks a whole array: right sizes, offsets that never decrease
    and stay inside the values. The caller checks ``start + n <= header.length``."""
    kind = column.kind
    if kind in ("string", "object") or column.dtype == "bool":
        return None
    dtype = column.np_dtype
    width = dtype.itemsize
    if kind == "ragged":
        offsets = np.frombuffer(frames[0], dtype=np.int64)
        window = offsets[start : start + n + 1]
        first, last = int(window[0]), int(window[-1])
        if (
            offsets.size != header.length + 1
            or first < 0
            or last * width > memoryview(frames[1]).nbytes
            or not never_decreasing(window)
        ):
            raise TransportError(f"column {column.name!r}: malformed offsets in a chunk read")
        values = np.frombuffer(frames[1], dtype=dtype, count=last - first, offset=first * width)
        cu = window - first
        values.flags.writeable = cu.flags.writeable = False  # shared with the hub's storage
        rows = ArrayHeader(header.column, n, 2)  # the window as an array of its own
        return LazyColumn(
            RaggedArray._trusted(values, cu), lambda: from_frames(column, rows, [cu, values])
        )
    per_row = math.prod(column.shape) if kind == "tensor" else 1
    if memoryview(frames[0]).nbytes != header.length * per_row * width:
        raise TransportError(f"column {column.name!r}: a data frame of the wrong size")
    view = np.frombuffer(frames[0], dtype=dtype, count=n * per_row, offset=start * per_row * width)
    view.flags.writeable = False
    if kind == "tensor":
        view = view.reshape((n, *column.shape))
    return LazyColumn(view, lambda: from_frames(column, header, frames).slice(start, n))


def _check_offsets(column: Column, offsets: np.ndarray) -> int:
    """Offsets start at 0 and never decrease (readers trust them); returns the last one."""
    if offsets[0] != 0 or not never_decreasing(offsets):
        raise TransportError(f"column {column.name!r}: offsets must start at 0 and never decrease")
    return int(offsets[-1])


def _primitive_slice(arr: pa.Array, column: Column) -> Any:
    """The bytes of an array of ``column``'s values (its dtype, asked of the column: an
    Arrow type comparison costs more than the rest)."""
    if column.dtype == "bool":
        # bit-packed with a possible bit offset: repack (bools are small)
        return np.packbits(arr.to_numpy(zero_copy_only=False), bitorder="little")
    width = column.np_dtype.itemsize
    data = arr.buffers()[1]
    return data.slice(arr.offset * width, len(arr) * width) if data is not None else b""

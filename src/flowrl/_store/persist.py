"""A storage unit's bytes on disk: Arrow IPC stream files, one series of segments per column.

Every chunk a unit stores is appended, as one record batch ``(index, value)``, to the
current segment of its column (``<column>.<segment>.arrows``), written straight to the
operating system so a crashed process loses nothing. A segment is deleted once every
chunk in it was evicted or overwritten; a new one starts when the current one is full
(``SEGMENT_BYTES`` or ``SEGMENT_CHUNKS``) and whenever a unit (re)starts, so a segment
torn by a crash is never appended to. A restarted unit reads back every chunk of its
files, evicted ones included: the chunk bound keeps that to about what is live, however
small the puts (one chunk each) and however long the run.

Evicted indices go to ``evicted.arrows`` so a restarted unit does not bring them back;
the unit rewrites it without the indices below every segment's lowest one (no file
holds them any more) once it has grown past ``EVICTED_REWRITE`` bytes and twice what
was kept, so it follows the segments rather than the run. Token appends to in-progress
samples (partial rollouts) go to ``partial-<column>.arrows``.

The column's declaration travels in each segment's schema metadata, so a unit restarted
alone knows its columns' types again.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._schema.columns import Column
from flowrl._schema.encode import numeric_array
from flowrl.errors import JournalError

__all__ = [
    "ColumnLog",
    "EvictionLog",
    "PartialLog",
    "load_column",
    "load_evicted",
    "load_partial",
    "partial_files",
    "segment_files",
]

SEGMENT_BYTES = 64 << 20
#: Chunks per segment at most: a restart reads about 0.05-0.3 ms per chunk.
SEGMENT_CHUNKS = 1024
#: Bytes appended to the eviction log before it is rewritten (an append of one index
#: takes about 200).
EVICTED_REWRITE = 1 << 20
#: IPC pieces smaller than this are gathered into one OS write; larger ones (a batch's
#: payload buffers) go straight through, uncopied.
WRITE_BUFFER_BYTES = 64 << 10
_SEGMENT = re.compile(r"^(?P<column>\w+)\.(?P<segment>\d+)\.arrows$")
_EVICTED = "evicted.arrows"
_INDEX_SCHEMA = pa.schema([("index", pa.int64())])


class _Segment:
    __slots__ = ("buffered", "chunks", "low", "nbytes", "path", "sink", "writer", "written")

    def __init__(self, path: str, schema: pa.Schema | None) -> None:
        self.path = path
        self.sink = self.buffered = self.writer = None
        if schema is not None:
            self.sink = pa.OSFile(path, mode="w")
            # A batch is many IPC writes (header, each buffer, padding): the small ones are
            # gathered, so a small batch reaches the OS in one write.
            self.buffered = pa.BufferedOutputStream(self.sink, WRITE_BUFFER_BYTES)
            self.writer = pa.ipc.new_stream(self.buffered, schema)
        self.chunks = 0  # live chunks stored in it
        self.written = 0  # chunks ever written to it
        self.low = sys.maxsize  # the lowest index of a chunk written to it (or loaded from it)
        self.nbytes = 0

    def write(self, batch: pa.RecordBatch, fsync: bool) -> None:
        if self.writer is None or self.sink is None or self.buffered is None:
            raise JournalError(f"segment {self.path!r} was loaded; it is never appended to")
        self.writer.write_batch(batch)
        self.buffered.flush()  # in the OS before the write returns (the "write" policy)
        if fsync:
            os.fsync(self.sink.fileno())
        self.nbytes += batch.nbytes
        self.written += 1

    def close(self) -> None:
        if self.writer is not None and self.buffered is not None:
            self.writer.close()
            self.buffered.close()


class ColumnLog:
    """The segments of one column: append chunks, forget dropped ones, delete dead files."""

    def __init__(self, folder: str, column: Column, *, fsync: bool, first_segment: int) -> None:
        self.folder = folder
        self.column = column
        self.fsync = fsync
        self._schema = _declared_schema(
            column, [("index", pa.int64()), ("value", column.arrow_type)]
        )
        self._next_segment = first_segment
        self._current: _Segment | None = None
        self._segment_of: dict[int, _Segment] = {}  # chunk id -> the segment holding it
        self._adopted: dict[str, _Segment] = {}

    def adopt(self, chunk: int, path: str, indices: np.ndarray) -> None:
        """A chunk loaded from an existing segment file (which is never appended to)."""
        seg = self._adopted.get(path)
        if seg is None:
            seg = self._adopted[path] = _Segment(path, None)
        seg.chunks += 1
        seg.low = min(seg.low, int(indices.min(initial=sys.maxsize)))
        self._segment_of[chunk] = seg

    def forget_if_unused(self, path: str) -> None:
        """Delete a loaded segment none of whose chunks survived loading."""
        if path not in self._adopted:
            _unlink(path)

    def append(self, chunk: int, indices: np.ndarray, array: pa.Array) -> None:
        seg = self._current
        if seg is None or seg.nbytes >= SEGMENT_BYTES or seg.written >= SEGMENT_CHUNKS:
            seg = self._rotate()
        seg.write(
            pa.RecordBatch.from_arrays([numeric_array(indices), array], schema=self._schema),
            self.fsync,
        )
        seg.chunks += 1
        seg.low = min(seg.low, int(indices.min(initial=sys.maxsize)))
        self._segment_of[chunk] = seg

    def lowest_index(self) -> int:
        """The lowest sample index in any of the column's files (``sys.maxsize``: none).
        Every segment but the current one holds a live chunk (it is deleted without)."""
        segments = set(self._segment_of.values())
        if self._current is not None:
            segments.add(self._current)
        return min((seg.low for seg in segments), default=sys.maxsize)

    def drop(self, chunk: int) -> None:
        seg = self._segment_of.pop(chunk, None)
        if seg is None:
            return
        seg.chunks -= 1
        if seg.chunks == 0 and seg is not self._current:
            self._delete(seg)

    def close(self) -> None:
        if self._current is not None:
            self._current.close()

    def _rotate(self) -> _Segment:
        old = self._current
        path = os.path.join(self.folder, f"{self.column.name}.{self._next_segment:08d}.arrows")
        self._next_segment += 1
        seg = self._current = _Segment(path, self._schema)
        if old is not None:
            old.close()
            if old.chunks == 0:
                self._delete(old)
        return seg

    def _delete(self, seg: _Segment) -> None:
        self._adopted.pop(seg.path, None)
        _unlink(seg.path)


def _declared_schema(column: Column, fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """A file schema carrying the column's declaration (read back by ``_open_declared``)."""
    return pa.schema(fields, metadata={b"flowrl.column": msgspec.json.encode(column)})


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class EvictionLog:
    """Appends evicted indices so that a restarted unit forgets them again."""

    def __init__(self, folder: str, keep: np.ndarray, *, fsync: bool) -> None:
        path = os.path.join(folder, _EVICTED)
        self._segment = _Segment(path + ".tmp", _INDEX_SCHEMA)
        self.fsync = fsync
        if keep.size:
            self.append(keep)
        self._kept = self._size()
        os.replace(path + ".tmp", path)  # the compacted log replaces the old one atomically

    def append(self, indices: np.ndarray) -> None:
        self._segment.write(
            pa.RecordBatch.from_arrays([numeric_array(indices)], ["index"]), self.fsync
        )

    @property
    def rewrite_due(self) -> bool:
        return self._size() > EVICTED_REWRITE + 2 * self._kept

    def _size(self) -> int:
        sink = self._segment.sink
        return 0 if sink is None else sink.tell()

    def close(self) -> None:
        self._segment.close()


def segment_files(folder: str) -> list[tuple[str, int, str]]:
    """``(column, segment number, path)`` of every segment, in column then write order."""
    found = []
    for name in os.listdir(folder):
        m = _SEGMENT.match(name)
        if m:
            found.append((m["column"], int(m["segment"]), os.path.join(folder, name)))
    return sorted(found)


def load_column(path: str) -> tuple[Column, Iterator[tuple[np.ndarray, pa.Array]]] | None:
    """A segment's column declaration and its ``(indices, values)`` batches, in order.

    A torn last batch (a crash mid-write) ends the iteration; None when the file does not
    even hold a schema (torn before its first batch).
    """
    opened = _open_declared(path)
    if opened is None:
        return None
    column, reader = opened
    return column, ((b.column(0).to_numpy(), b.column(1)) for b in _batches(reader))


def _open_declared(path: str) -> tuple[Column, pa.ipc.RecordBatchStreamReader] | None:
    reader = _open(path)
    if reader is None:
        return None
    meta = (reader.schema.metadata or {}).get(b"flowrl.column")
    if meta is None:
        raise JournalError(f"{path!r} has no flowrl column declaration")
    return msgspec.json.decode(meta, type=Column), reader


def load_evicted(folder: str) -> np.ndarray:
    reader = _open(os.path.join(folder, _EVICTED))
    parts = [] if reader is None else [b.column(0).to_numpy() for b in _batches(reader)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _open(path: str) -> pa.ipc.RecordBatchStreamReader | None:
    """A stream reader over the memory-mapped file (values stay mapped, never copied)."""
    if not os.path.exists(path):
        return None
    try:
        return pa.ipc.open_stream(pa.memory_map(path))
    except (pa.ArrowInvalid, OSError):
        return None  # empty, or torn inside its schema: it holds no batch


def _batches(reader: pa.ipc.RecordBatchStreamReader) -> Iterator[pa.RecordBatch]:
    """The batches of a stream; a torn last batch (a crash mid-write) ends it."""
    while True:
        try:
            yield reader.read_next_batch()
        except (StopIteration, pa.ArrowInvalid, OSError):  # the end, or a torn batch
            return


class PartialLog:
    """Token appends to in-progress values of one ragged column (partial rollouts).

    ``partial-<column>.arrows`` holds batches of ``(index, version, values)`` rows, one row
    per append to a sample; it is rewritten with only the live prefixes when a unit starts
    and whenever it grows past ``SEGMENT_BYTES`` (live prefixes are few: only requests still
    being generated).
    """

    def __init__(self, folder: str, column: Column, *, fsync: bool) -> None:
        self.path = os.path.join(folder, f"partial-{column.name}.arrows")
        self.fsync = fsync
        self._schema = _declared_schema(
            column,
            [("index", pa.int64()), ("version", pa.int64()), ("values", column.arrow_type)],
        )
        self._segment: _Segment | None = None

    def append(self, indices: np.ndarray, versions: np.ndarray, values: pa.Array) -> None:
        if self._segment is None:
            raise JournalError(f"{self.path!r} must be rewritten before it is appended to")
        self._segment.write(self._batch(indices, versions, values), self.fsync)

    @property
    def full(self) -> bool:
        return self._segment is not None and self._segment.nbytes >= SEGMENT_BYTES

    def rewrite(self, indices: np.ndarray, versions: np.ndarray, values: pa.Array) -> None:
        """Replace the file by one holding exactly these rows (atomically)."""
        self.close()
        seg = _Segment(self.path + ".tmp", self._schema)
        if indices.size:
            seg.write(self._batch(indices, versions, values), self.fsync)
        os.replace(seg.path, self.path)
        seg.path = self.path
        self._segment = seg

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _batch(self, indices: np.ndarray, versions: np.ndarray, values: pa.Array) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [numeric_array(indices), numeric_array(versions), values], schema=self._schema
        )


def partial_files(folder: str) -> list[str]:
    return sorted(
        os.path.join(folder, n)
        for n in os.listdir(folder)
        if n.startswith("partial-") and n.endswith(".arrows")
    )


def load_partial(
    path: str,
) -> tuple[Column, Iterator[tuple[np.ndarray, np.ndarray, pa.Array]]] | None:
    """A partial log's column and its ``(indices, versions, values)`` batches, in order."""
    opened = _open_declared(path)
    if opened is None:
        return None
    column, reader = opened
    batches = (
        (b.column(0).to_numpy(), b.column(1).to_numpy(), b.column(2)) for b in _batches(reader)
    )
    return column, batches

"""A storage unit: the data plane. Arrow column chunks, gathered by sample index.

Each put appends one Arrow array per column (a chunk); a per-slot map records which chunk
and row hold a sample's cell. Reads of rows that are contiguous in one chunk (the usual
case: a FIFO claim of what one put wrote) are zero-copy slices; other reads gather with
Arrow's ``take``. A chunk is dropped once every row in it was evicted or overwritten.

Invariants (tests/unit/test_store.py): a read returns exactly the bytes last written for
each requested index, in request order; reading an index that was evicted or never
written raises UnknownIndexError, even after its slot was reused.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

from flowrl._client.config import UnitStats
from flowrl.errors import UnknownColumnError, UnknownIndexError

__all__ = ["StorageUnit"]


class _ColumnStore:
    __slots__ = ("chunk_of", "chunks", "live", "next_chunk", "owner", "row_of")

    def __init__(self, capacity: int) -> None:
        self.owner = np.full(capacity, -1, dtype=np.int64)
        self.chunk_of = np.full(capacity, -1, dtype=np.int64)
        self.row_of = np.zeros(capacity, dtype=np.int64)
        self.chunks: dict[int, pa.Array] = {}
        self.live: dict[int, int] = {}
        self.next_chunk = 0

    def _unref(self, chunk_ids: np.ndarray) -> None:
        chunk_ids = chunk_ids[chunk_ids >= 0]
        if chunk_ids.size == 0:
            return
        if (chunk_ids == chunk_ids[0]).all():  # the usual case: one put's chunk
            ids, counts = chunk_ids[:1], np.array([chunk_ids.size])
        else:
            ids, counts = np.unique(chunk_ids, return_counts=True)
        for cid, cnt in zip(ids.tolist(), counts.tolist(), strict=True):
            left = self.live[cid] - cnt
            if left:
                self.live[cid] = left
            else:
                del self.live[cid], self.chunks[cid]

    def write(self, slots: np.ndarray, indices: np.ndarray, array: pa.Array) -> None:
        # Whatever occupied these slots (an older write of the index, or a stale evicted
        # sample whose evict message has not arrived yet) loses its reference.
        self._unref(np.where(self.owner[slots] >= 0, self.chunk_of[slots], -1))
        cid = self.next_chunk
        self.next_chunk += 1
        self.chunks[cid] = array
        self.live[cid] = int(slots.size)
        self.owner[slots] = indices
        self.chunk_of[slots] = cid
        self.row_of[slots] = np.arange(slots.size)

    def read(self, name: str, slots: np.ndarray, indices: np.ndarray) -> pa.Array:
        bad = self.owner[slots] != indices
        if bad.any():
            raise UnknownIndexError(
                f"column {name!r} holds no data for sample {int(indices[np.argmax(bad)])} "
                "(never written, or evicted)"
            )
        cids = self.chunk_of[slots]
        rows = self.row_of[slots]
        first = int(cids[0])
        if (cids == first).all():
            chunk = self.chunks[first]
            start = int(rows[0])
            if rows[-1] - start == rows.size - 1 and (rows[1:] > rows[:-1]).all():
                return chunk.slice(start, rows.size)  # strictly increasing span: zero-copy
            return chunk.take(pa.array(rows))
        uniq, inverse = np.unique(cids, return_inverse=True)
        arrays = [self.chunks[int(c)] for c in uniq]
        bases = np.cumsum([0] + [len(a) for a in arrays[:-1]])
        return pa.chunked_array(arrays).take(pa.array(bases[inverse] + rows)).combine_chunks()

    def evict(self, slots: np.ndarray, indices: np.ndarray) -> None:
        mine = slots[self.owner[slots] == indices]
        self._unref(self.chunk_of[mine])
        self.owner[mine] = -1
        self.chunk_of[mine] = -1

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.chunks.values())


class StorageUnit:
    """Holds the bytes of the samples the controller placed on it. Thread-safe."""

    def __init__(self, unit_id: int, capacity: int) -> None:
        self.unit_id = unit_id
        self.capacity = capacity
        self._columns: dict[str, _ColumnStore] = {}
        self._newest = np.full(capacity, -1, dtype=np.int64)  # newest index written per slot
        self._lock = threading.Lock()

    def write(self, indices: np.ndarray, arrays: dict[str, pa.Array]) -> None:
        """Store one Arrow array per column for ``indices`` (validated upstream).

        A write for an index older than one already written to its slot is stale (the
        sample was evicted and the slot reused meanwhile): it is rejected as a whole.
        """
        slots = indices % self.capacity
        with self._lock:
            stale = self._newest[slots] > indices
            if stale.any():
                raise UnknownIndexError(
                    f"sample index {int(indices[np.argmax(stale)])} was evicted before this "
                    "write arrived; nothing was written"
                )
            self._newest[slots] = indices
            for name, array in arrays.items():
                store = self._columns.get(name)
                if store is None:
                    store = self._columns[name] = _ColumnStore(self.capacity)
                store.write(slots, indices, array)

    def read(self, indices: np.ndarray, columns: tuple[str, ...]) -> dict[str, pa.Array]:
        slots = indices % self.capacity
        out: dict[str, pa.Array] = {}
        with self._lock:
            for name in columns:
                store = self._columns.get(name)
                if store is None:
                    raise UnknownColumnError(
                        f"storage unit {self.unit_id} holds no column {name!r}"
                    )
                out[name] = store.read(name, slots, indices)
        return out

    def evict(self, indices: np.ndarray) -> None:
        slots = indices % self.capacity
        with self._lock:
            for store in self._columns.values():
                store.evict(slots, indices)

    def discard(self, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        """Undo a write whose commit failed (only the named columns)."""
        slots = indices % self.capacity
        with self._lock:
            for name in columns:
                store = self._columns.get(name)
                if store is not None:
                    store.evict(slots, indices)

    def statistics(self) -> UnitStats:
        with self._lock:
            samples = max((int((s.owner >= 0).sum()) for s in self._columns.values()), default=0)
            chunks = sum(len(s.chunks) for s in self._columns.values())
            nbytes = sum(s.nbytes() for s in self._columns.values())
        return UnitStats(self.unit_id, samples, chunks, nbytes)

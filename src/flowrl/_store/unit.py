"""A storage unit: the data plane. Arrow column chunks, gathered by sample index.

Each put appends one Arrow array per column (a chunk); a per-slot map records which chunk
and row hold a sample's cell. Reads of rows that are contiguous in one chunk (the usual
case: a FIFO claim of what one put wrote) are zero-copy slices; other reads gather with
Arrow's ``take``. A chunk is dropped once every row in it was evicted or overwritten.

Invariants (tests/unit/test_store.py): a read returns exactly the bytes last written for
each requested index, in request order; reading an index that was evicted or never
written raises UnknownIndexError, even after its slot was reused.

A write to samples the unit already holds may be staged (:meth:`StorageUnit.stage`, a put
to existing samples): reads return the values committed before until the controller's
verdict files it (``settle(put_id, True)``) or forgets it, so a put the controller
refuses (an expired lease, a closed column) changes nothing.

With a folder, a unit is persistent (``_store/persist.py``): every chunk is also appended
to Arrow IPC files, and a unit started on the same folder loads them back (memory-mapped,
without copying) and holds exactly what it held before, evictions included.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import pyarrow as pa

from flowrl._config import JournalConfig, UnitStats
from flowrl._folder_lock import FolderLock
from flowrl._schema.columns import Column
from flowrl._schema.encode import numeric_array
from flowrl._schema.small import FEW, SMALL, all_equal, has_negative
from flowrl._store.partial import PartialStore
from flowrl._store.persist import (
    ColumnLog,
    EvictionLog,
    load_column,
    load_evicted,
    segment_files,
)
from flowrl.errors import SchemaError, UnknownColumnError, UnknownIndexError

__all__ = ["Deferred", "StorageUnit"]


class Deferred:
    """An Arrow array a storage unit builds on the first read that needs it: a unit
    server's write of buffers in shared memory, which reads of whole puts name there and
    never build. It answers ``len()`` and ``get_total_buffer_size()`` as the array will."""

    __slots__ = ("_build", "_length", "_nbytes")

    def __init__(self, length: int, nbytes: int, build: Callable[[], pa.Array]) -> None:
        self._length = length
        self._nbytes = nbytes
        self._build = build

    def __len__(self) -> int:
        return self._length

    def get_total_buffer_size(self) -> int:
        return self._nbytes

    def build(self) -> pa.Array:
        return self._build()


#: A column's values of one write: an Arrow array, or one built when first read.
Chunk: TypeAlias = pa.Array | Deferred


def _built(chunk: Chunk) -> pa.Array:
    return chunk.build() if type(chunk) is Deferred else chunk


class _ColumnStore:
    __slots__ = (
        "chunk_of",
        "chunks",
        "first",
        "live",
        "log",
        "nbytes",
        "next_chunk",
        "owner",
        "row_of",
        "tags",
    )

    def __init__(self, capacity: int, log: ColumnLog | None = None) -> None:
        self.log = log
        self.owner = np.full(capacity, -1, dtype=np.int64)
        self.chunk_of = np.full(capacity, -1, dtype=np.int64)
        self.row_of = np.zeros(capacity, dtype=np.int64)
        self.chunks: dict[int, Chunk] = {}
        self.live: dict[int, int] = {}
        # chunk -> its first index, for chunks written for consecutive indices (a put of
        # new samples): while all its rows are live, a read of consecutive indices inside
        # it is a slice found without looking at the per-slot arrays.
        self.first: dict[int, int] = {}
        # chunk -> what its writer tagged it with (a unit server: where its bytes lie in
        # shared memory), handed back by ``tagged_run``
        self.tags: dict[int, object] = {}
        # bytes of the buffers the chunks hold, kept as they come and go (statistics is O(1));
        # Arrow's nbytes of a slice would count less than it keeps alive, and cost more
        self.nbytes = 0
        self.next_chunk = 0

    def _unref(self, chunk_ids: np.ndarray | list[int]) -> None:
        if isinstance(chunk_ids, list) or chunk_ids.size <= SMALL:  # (no numpy calls)
            listed = chunk_ids if isinstance(chunk_ids, list) else chunk_ids.tolist()
            refs: dict[int, int] = {}
            if listed and listed.count(listed[0]) == len(listed):  # one chunk, or free slots
                if listed[0] >= 0:
                    refs[listed[0]] = len(listed)
            else:
                for cid in listed:
                    if cid >= 0:
                        refs[cid] = refs.get(cid, 0) + 1
        else:
            chunk_ids = chunk_ids[chunk_ids >= 0]
            if chunk_ids.size == 0:
                return
            if all_equal(chunk_ids):  # the usual case: one put's chunk
                refs = {int(chunk_ids[0]): int(chunk_ids.size)}
            else:
                ids, counts = np.unique(chunk_ids, return_counts=True)
                refs = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        for cid, cnt in refs.items():
            left = self.live[cid] - cnt
            if left:
                self.live[cid] = left
            else:
                self.nbytes -= self.chunks[cid].get_total_buffer_size()
                del self.live[cid], self.chunks[cid]
                self.first.pop(cid, None)
                self.tags.pop(cid, None)
                if self.log is not None:
                    self.log.drop(cid)

    def write(
        self,
        slots: np.ndarray,
        indices: np.ndarray,
        array: Chunk,
        run: bool,
        loaded_from: str = "",
        tag: object = None,
        logged: int = -1,
        at: slice | np.ndarray | None = None,
    ) -> None:
        """File ``array`` as the rows of ``indices``; ``run``: they are consecutive.
        ``logged``: the chunk id it was logged under already (see :meth:`log_ahead`);
        ``at``: the slots as :func:`_span` gives them."""
        # Whatever occupied these slots (an older write of the index, or a stale evicted
        # sample whose evict message has not arrived yet) loses its reference (a free slot's
        # chunk is -1, as its owner).
        few = slots.size <= FEW
        chunk_of = self.chunk_of
        at = slots if at is None else at
        self._unref([int(chunk_of[slot]) for slot in slots.tolist()] if few else chunk_of[at])
        cid = logged if logged >= 0 else self.log_ahead(indices, array, loaded_from)
        self.chunks[cid] = array
        self.nbytes += array.get_total_buffer_size()  # what the chunk keeps alive
        self.live[cid] = int(slots.size)
        if run:
            self.first[cid] = int(indices[0])
        if tag is not None:
            self.tags[cid] = tag
        if few:
            owner, row_of = self.owner, self.row_of
            for row, (slot, index) in enumerate(zip(slots.tolist(), indices.tolist(), strict=True)):
                owner[slot], chunk_of[slot], row_of[slot] = index, cid, row
        else:
            self.owner[at] = indices
            chunk_of[at] = cid
            self.row_of[at] = _rows(slots.size)

    def log_ahead(self, indices: np.ndarray, array: Chunk, loaded_from: str = "") -> int:
        """A new chunk id, its rows logged (a persistent column) before they are filed."""
        cid = self.next_chunk
        self.next_chunk += 1
        if self.log is not None:
            if loaded_from:
                self.log.adopt(cid, loaded_from, indices)
            else:
                self.log.append(cid, indices, _built(array))
        return cid

    def read(
        self, name: str, slots: np.ndarray, indices: np.ndarray, run: bool = False
    ) -> pa.Array:
        """Rows of ``indices`` (all >= 0: the caller checks, as a free slot's owner is -1);
        ``run``: they are consecutive."""
        if run:
            found = self._run(int(slots[0]), int(indices[0]), indices.size)
            if found is not None:
                return self._array(found[0]).slice(found[1], indices.size)
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
            chunk = self._array(first)
            start = int(rows[0])
            if rows[-1] - start == rows.size - 1 and (rows[1:] > rows[:-1]).all():
                return chunk.slice(start, rows.size)  # strictly increasing span: zero-copy
            return chunk.take(numeric_array(rows))
        uniq, inverse = np.unique(cids, return_inverse=True)
        arrays = [self._array(int(c)) for c in uniq]
        bases = np.cumsum([0] + [len(a) for a in arrays[:-1]])
        return pa.chunked_array(arrays).take(numeric_array(bases[inverse] + rows)).combine_chunks()

    def _array(self, cid: int) -> pa.Array:
        """Chunk ``cid``'s array (built now if it was deferred, once)."""
        chunk = self.chunks[cid]
        if type(chunk) is Deferred:
            chunk = self.chunks[cid] = chunk.build()
        return chunk

    def _run(self, slot: int, index: int, n: int) -> tuple[int, int] | None:
        """(chunk, first row) of the ``n`` consecutive indices from ``index`` (in ``slot``)
        when one chunk written for consecutive indices holds them all, every row of it
        still live (so each of its slots still holds the chunk's index); else None."""
        cid = int(self.chunk_of[slot])
        first = self.first.get(cid)
        if first is None:
            return None
        size = len(self.chunks[cid])
        start = index - first
        if self.live[cid] == size and 0 <= start <= size - n:
            return cid, start
        return None

    def tagged_run(self, slot: int, index: int, n: int) -> tuple[object, int] | None:
        """(tag, first row) of the chunk holding the run, as ``_run``, if it was tagged."""
        found = self._run(slot, index, n)
        if found is None:
            return None
        tag = self.tags.get(found[0])
        return None if tag is None else (tag, found[1])

    def evict(self, slots: np.ndarray, indices: np.ndarray) -> None:
        mine = slots[self.owner[slots] == indices]
        self._unref(self.chunk_of[mine])
        self.owner[mine] = -1
        self.chunk_of[mine] = -1


class StorageUnit:
    """Holds the bytes of the samples the controller placed on it. Thread-safe."""

    def __init__(
        self, unit_id: int, capacity: int, *, folder: str | None = None, fsync: bool = False
    ) -> None:
        self.unit_id = unit_id
        self.capacity = capacity
        self.folder = folder
        self.fsync = fsync
        self._columns: dict[str, _ColumnStore] = {}
        self.declared: dict[str, Column] = {}  # persistent units: the columns they hold
        self._newest = np.full(capacity, -1, dtype=np.int64)  # newest index written per slot
        self._staged: dict[int, _Staged] = {}  # put id -> a write waiting for its commit
        self._staged_on = np.zeros(capacity, dtype=np.int32)  # staged writes per slot
        self._lock = threading.Lock()
        self._evictions: EvictionLog | None = None
        self._partials = PartialStore(folder, fsync=fsync)
        self._folder_lock: FolderLock | None = None
        if folder is not None:
            # one process at a time: a second unit on these files would rewrite them
            self._folder_lock = FolderLock(folder, f"storage unit {unit_id}'s folder")
            try:
                self._load(folder)
                self._partials.load(self._in_progress)
            except BaseException:
                self._folder_lock.release()
                raise

    @classmethod
    def open(cls, unit_id: int, capacity: int, journal: JournalConfig | None) -> StorageUnit:
        """Unit ``unit_id`` of a hub: persistent under the journal's folder when asked."""
        if journal is None or not journal.persist_data:
            return cls(unit_id, capacity)
        folder = os.path.join(journal.path, f"unit{unit_id}")
        return cls(unit_id, capacity, folder=folder, fsync=journal.sync == "fsync")

    def _load(self, folder: str) -> None:
        """Bring back what a previous unit on ``folder`` held (then append to new files)."""
        files = segment_files(folder)
        first = max((seg for _, seg, _ in files), default=-1) + 1
        seen: list[np.ndarray] = []
        for _, _, path in files:
            loaded = load_column(path)
            if loaded is None:
                os.unlink(path)  # torn before its first batch: holds nothing
                continue
            column, batches = loaded
            store = self._store(column.name, column, first)
            for indices, array in batches:
                slots = indices % self.capacity
                keep = indices >= store.owner[slots]  # later writes of a column win
                if not keep.all():
                    indices, slots, array = indices[keep], slots[keep], array.filter(keep)
                if indices.size:
                    store.write(slots, indices, array, _consecutive(indices), loaded_from=path)
                    np.maximum.at(self._newest, slots, indices)
                    seen.append(indices)
            assert store.log is not None
            store.log.forget_if_unused(path)
        evicted = load_evicted(folder)
        if seen and evicted.size:
            evicted = evicted[np.isin(evicted, np.concatenate(seen))]
            self._evict(evicted)
        self._evictions = EvictionLog(folder, evicted, fsync=self.fsync)

    def _store(self, name: str, column: Column | None, first_segment: int = 0) -> _ColumnStore:
        store = self._columns.get(name)
        if store is None:
            log = None
            if self.folder is not None and column is not None:
                log = ColumnLog(self.folder, column, fsync=self.fsync, first_segment=first_segment)
                self.declared[name] = column
            store = self._columns[name] = _ColumnStore(self.capacity, log)
        return store

    def write(
        self,
        indices: np.ndarray,
        arrays: Mapping[str, Chunk] | Callable[[], Mapping[str, Chunk]],
        types: Mapping[str, Column] | None = None,
        on_accepted: Callable[[], None] | None = None,
        tags: Mapping[str, object] | None = None,
    ) -> None:
        """Store one Arrow array per column for ``indices`` (validated upstream).

        ``arrays`` may be a function that builds them (names and lengths checked upstream);
        it is called once, after ``on_accepted`` on a unit without a folder. An array may
        be :class:`Deferred`: built on the first read that needs it.

        A write for an index older than one already written to its slot is stale (the
        sample was evicted and the slot reused meanwhile): it is rejected as a whole.
        A persistent unit needs each column's declaration (``types``) the first time.

        ``on_accepted`` runs once nothing can refuse the write: before the in-memory
        bookkeeping (a unit server hands the commit on there, and reads nothing until the
        write is filed), or after the bytes are logged on a persistent unit.

        ``tags`` maps columns to a value kept with the array (its chunk) and handed back by
        :meth:`read_run` while the chunk is whole.
        """
        slots = indices % self.capacity
        run, at = _span(slots, indices, self.capacity)
        with self._lock:
            types = types or {}
            arrays = self._check_write(at, indices, arrays, types)
            if on_accepted is not None and self.folder is None:
                on_accepted()
            if callable(arrays):
                arrays = arrays()
            self._file(slots, indices, arrays, types, tags or {}, {}, run, at)
            if on_accepted is not None and self.folder is not None:
                on_accepted()

    def _check_write(
        self,
        at: slice | np.ndarray,
        indices: np.ndarray,
        arrays: Mapping[str, Chunk] | Callable[[], Mapping[str, Chunk]],
        types: Mapping[str, Column],
    ) -> Mapping[str, Chunk] | Callable[[], Mapping[str, Chunk]]:
        """Refuse a stale write, or a persistent unit's write of an undeclared column;
        returns ``arrays`` (built, on a persistent unit: its bytes are logged first)."""
        stale = _first_stale(self._newest, at, indices)
        if stale is not None:
            raise UnknownIndexError(
                f"sample index {stale} was evicted before this write arrived; nothing was written"
            )
        if self.folder is not None:
            arrays = arrays() if callable(arrays) else arrays
            for name in arrays:
                if name not in self._columns and name not in types:
                    raise SchemaError(
                        f"storage unit {self.unit_id} is persistent and needs the "
                        f"declaration of new column {name!r}; nothing was written"
                    )
        return arrays

    def _file(
        self,
        slots: np.ndarray,
        indices: np.ndarray,
        arrays: Mapping[str, Chunk],
        types: Mapping[str, Column],
        tags: Mapping[str, object],
        logged: Mapping[str, int],
        run: bool,
        at: slice | np.ndarray,
    ) -> None:
        """Make a checked write visible (``logged``: chunks a persistent unit logged ahead;
        ``run``: its indices are consecutive; ``at``: its slots, as :func:`_span`)."""
        # (checked: none is older than what the slot held)
        if slots.size <= FEW:
            newest = self._newest
            for slot, index in zip(slots.tolist(), indices.tolist(), strict=True):
                newest[slot] = index
        else:
            self._newest[at] = indices
        for name, array in arrays.items():
            store = self._store(name, types.get(name))
            cid = logged.get(name, -1)
            store.write(slots, indices, array, run, tag=tags.get(name), logged=cid, at=at)
            self._partials.clear(name, indices)  # the column is complete now

    # -- writes to existing samples, visible only once committed ------------------------------
    def stage(
        self,
        put_id: int,
        indices: np.ndarray,
        arrays: Mapping[str, Chunk] | Callable[[], Mapping[str, Chunk]],
        types: Mapping[str, Column] | None = None,
        tags: Mapping[str, object] | None = None,
    ) -> None:
        """Hold a write to existing samples until the controller settles its commit.

        Checked as :meth:`write` checks it; reads keep returning the values committed
        before until :meth:`settle` ``(put_id, True)`` files it. ``settle(put_id, False)``
        (the commit was refused: an expired lease, a closed column) forgets it: a refused
        put changes nothing. A persistent unit logs the bytes now, so a committed write
        survives a crash of the unit before its verdict arrives.
        """
        slots = indices % self.capacity
        types = types or {}
        with self._lock:
            if put_id in self._staged:
                raise SchemaError(f"put {put_id} is already staged on unit {self.unit_id}")
            arrays = self._check_write(slots, indices, arrays, types)
            if callable(arrays):
                arrays = arrays()
            logged = {}
            if self.folder is not None:
                for name, array in arrays.items():
                    store = self._store(name, types.get(name))
                    logged[name] = store.log_ahead(indices, array)
            self._staged[put_id] = _Staged(indices, slots, arrays, types, tags or {}, logged)
            _count(self._staged_on, slots, 1)

    def settle(self, put_id: int, committed: bool) -> bool:
        """File (``committed``) or forget a staged write; False if none is staged as
        ``put_id`` (never staged here, or settled already)."""
        with self._lock:
            staged = self._staged.pop(put_id, None)
            if staged is None:
                return False
            indices, slots, arrays, types, tags, logged = staged
            _count(self._staged_on, slots, -1)
            if committed and _first_stale(self._newest, slots, indices) is None:
                run, at = _span(slots, indices, self.capacity)
                self._file(slots, indices, arrays, types, tags, logged, run, at)
            elif logged:
                self._unlog(slots, indices, logged)
        return True

    def _unlog(self, slots: np.ndarray, indices: np.ndarray, logged: Mapping[str, int]) -> None:
        """Undo a refused write's log records: its chunks are dropped from the logs, and the
        values committed before are filed again after them (the last write wins when the
        files are loaded)."""
        for name, cid in logged.items():
            store = self._columns[name]
            assert store.log is not None
            store.log.drop(cid)
            held = store.owner[slots] == indices
            if held.any():
                keep_slots, keep = slots[held], indices[held]
                store.write(keep_slots, keep, store.read(name, keep_slots, keep), False)

    @property
    def has_staged(self) -> bool:
        return bool(self._staged)

    def is_staged(self, put_id: int) -> bool:
        return put_id in self._staged

    def staged(self, indices: np.ndarray) -> bool:
        """Whether a write to any of these samples waits for its commit's verdict."""
        slots = indices % self.capacity
        with self._lock:
            staged_on = self._staged_on
            if slots.size <= FEW:
                return any(staged_on[slot] for slot in slots.tolist())
            return bool(staged_on[slots].any())

    def read(self, indices: np.ndarray, columns: tuple[str, ...]) -> dict[str, pa.Array]:
        if has_negative(indices):
            raise UnknownIndexError(f"sample index {int(indices.min())} does not exist")
        slots = indices % self.capacity
        run = _consecutive(indices)
        out: dict[str, pa.Array] = {}
        with self._lock:
            for name in columns:
                store = self._columns.get(name)
                if store is None:
                    raise UnknownColumnError(
                        f"storage unit {self.unit_id} holds no column {name!r}"
                    )
                out[name] = store.read(name, slots, indices, run)
        return out

    def read_run(self, indices: np.ndarray, columns: tuple[str, ...]) -> list[tuple[object, int]]:
        """For each column, the tag of the one whole chunk holding ``indices`` and the row
        where they start there, when ``indices`` are consecutive and every column's chunk
        was written with a tag and is whole; else ``[]`` (``read`` serves the read)."""
        n = indices.size
        if not n or not _consecutive(indices) or int(indices[0]) < 0:
            return []
        index = int(indices[0])
        slot = index % self.capacity
        out = []
        with self._lock:
            for name in columns:
                store = self._columns.get(name)
                found = None if store is None else store.tagged_run(slot, index, n)
                if found is None:
                    return []
                out.append(found)
        return out

    def evict(self, indices: np.ndarray) -> None:
        with self._lock:
            self._evict(indices)
            if self._evictions is not None:
                self._evictions.append(indices)
                if self._evictions.rewrite_due:
                    self._rewrite_evictions()

    def _rewrite_evictions(self) -> None:
        """Rewrite the eviction log without the indices below every file's lowest one:
        no file holds them, so a restart cannot bring them back."""
        assert self.folder is not None and self._evictions is not None  # (persistent)
        logs = [s.log for s in self._columns.values() if s.log is not None]
        floor = min((log.lowest_index() for log in logs), default=sys.maxsize)
        evicted = load_evicted(self.folder)
        self._evictions.close()
        self._evictions = EvictionLog(self.folder, evicted[evicted >= floor], fsync=self.fsync)

    def _evict(self, indices: np.ndarray) -> None:
        slots = indices % self.capacity
        for store in self._columns.values():
            store.evict(slots, indices)
        self._partials.clear(None, indices)

    # -- partial rollouts -------------------------------------------------------------------
    def append(
        self, indices: np.ndarray, values: Sequence[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]:
        """Append tokens to in-progress values of ragged columns, all of them or (on a bad
        request) none; returns each column's prefix lengths."""
        with self._lock:
            for column, _ in values:
                self._check_in_progress(indices, column)
            return [self._partials.append(indices, c, v, version) for c, v in values]

    def read_partial(self, indices: np.ndarray, column: Column) -> tuple[pa.Array, pa.Array]:
        """The prefixes appended so far (values, per-token versions); empty when none."""
        with self._lock:
            self._check_in_progress(indices, column, completed_ok=True)
            return self._partials.read(indices, column)

    def _check_in_progress(
        self, indices: np.ndarray, column: Column, *, completed_ok: bool = False
    ) -> None:
        slots = indices % self.capacity
        gone = ~self._held(slots, indices)
        if gone.any():
            raise UnknownIndexError(
                f"sample {int(indices[np.argmax(gone)])} is not held by storage unit "
                f"{self.unit_id} (never put, or evicted)"
            )
        if not completed_ok:
            done = self._complete(column.name, slots, indices)
            if done.any():
                raise SchemaError(
                    f"column {column.name!r} of sample {int(indices[np.argmax(done)])} is "
                    "already complete; append() extends values that are still being generated"
                )

    def _held(self, slots: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Which samples this unit holds some column of (put, and not evicted)."""
        held = np.zeros(indices.size, dtype=bool)
        for store in self._columns.values():
            held |= store.owner[slots] == indices
        return held

    def _in_progress(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Which samples may still hold a prefix of ``name``: live, column not complete."""
        slots = indices % self.capacity
        return self._held(slots, indices) & ~self._complete(name, slots, indices)

    def _complete(self, name: str, slots: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Which samples hold column ``name`` (put in full, not appended to)."""
        store = self._columns.get(name)
        if store is None:
            return np.zeros(indices.size, dtype=bool)
        return store.owner[slots] == indices

    def retain(self, live: np.ndarray, below: int) -> None:
        """Evict every sample below index ``below`` that is not in ``live``.

        A recovered controller's live set: the unit may hold bytes of puts it never
        committed. Samples put after the recovery (indices ``>= below``) are kept, so the
        message may arrive late.
        """
        with self._lock:
            held = [s.owner[(s.owner >= 0) & (s.owner < below)] for s in self._columns.values()]
            gone = np.unique(np.concatenate(held)) if held else np.empty(0, dtype=np.int64)
            gone = gone[~np.isin(gone, live)]
        if gone.size:
            self.evict(gone)

    def close(self) -> None:
        """Close a persistent unit's files (what they hold stays on disk)."""
        with self._lock:
            for store in self._columns.values():
                if store.log is not None:
                    store.log.close()
            if self._evictions is not None:
                self._evictions.close()
            self._partials.close()
            self.abandon()

    def abandon(self) -> None:
        """Release the folder without finalising its files, as a process that dies."""
        if self._folder_lock is not None:
            self._folder_lock.release()

    def discard(self, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        """Undo a write whose commit failed (only the named columns)."""
        slots = indices % self.capacity
        with self._lock:
            for name in columns:
                store = self._columns.get(name)
                if store is not None:
                    store.evict(slots, indices)

    def holds(self, indices: np.ndarray) -> bool:
        """Whether a column of every sample of ``indices`` is stored here."""
        slots = indices % self.capacity
        with self._lock:
            owners = [store.owner for store in self._columns.values()]
            if indices.size <= FEW:
                pairs = zip(slots.tolist(), indices.tolist(), strict=True)
                return all(any(owner[slot] == index for owner in owners) for slot, index in pairs)
            held = np.zeros(indices.size, dtype=bool)
            for owner in owners:
                held |= owner[slots] == indices
        return bool(held.all())

    def statistics(self) -> UnitStats:
        with self._lock:
            samples = max((int((s.owner >= 0).sum()) for s in self._columns.values()), default=0)
            chunks = sum(len(s.chunks) for s in self._columns.values())
            nbytes = sum(s.nbytes for s in self._columns.values())
        return UnitStats(self.unit_id, samples, chunks, nbytes)


class _Staged(NamedTuple):
    indices: np.ndarray
    slots: np.ndarray
    arrays: Mapping[str, Chunk]
    types: Mapping[str, Column]
    tags: Mapping[str, object]
    logged: dict[str, int]  # a persistent unit's chunk ids, logged when staged


def _count(counts: np.ndarray, slots: np.ndarray, delta: int) -> None:
    """Add ``delta`` to the count of each of ``slots`` (distinct)."""
    if slots.size <= FEW:
        for slot in slots.tolist():
            counts[slot] += delta
    else:
        counts[slots] += delta


def _span(slots: np.ndarray, indices: np.ndarray, capacity: int) -> tuple[bool, slice | np.ndarray]:
    """Whether ``indices`` are consecutive (a run), and their ``slots`` as a slice when
    they follow each other (a run that does not wrap around the capacity): numpy reads and
    writes a slice without gathering."""
    run = _consecutive(indices)
    first = int(slots[0]) if run else capacity
    return run, slice(first, first + slots.size) if first + slots.size <= capacity else slots


_ROWS = np.arange(1024)
_ROWS.flags.writeable = False


def _rows(n: int) -> np.ndarray:
    """0, 1, ..., n-1: a chunk's rows (a view of one array made once, for most puts)."""
    return _ROWS[:n] if n <= _ROWS.size else np.arange(n)


def _first_stale(newest: np.ndarray, slots: slice | np.ndarray, indices: np.ndarray) -> int | None:
    """The first of ``indices`` whose slot holds a newer index already (its sample was
    evicted and the slot reused), or None (``slots``: an array or a :func:`_span`)."""
    held = newest[slots]
    if indices.size <= SMALL:
        for before, index in zip(held.tolist(), indices.tolist(), strict=True):
            if before > index:
                return index
        return None
    stale = held > indices
    return int(indices[np.argmax(stale)]) if np.count_nonzero(stale) else None


def _consecutive(indices: np.ndarray) -> bool:
    """Whether ``indices`` are i, i+1, ..., i+n-1 (n >= 1)."""
    n = indices.size
    if n == 0 or int(indices[-1]) - int(indices[0]) != n - 1:
        return False
    if n < 3:
        return True
    if n <= SMALL:
        first = int(indices[0])
        return indices.tolist() == list(range(first, first + n))
    return bool((indices[1:] - indices[:-1] == 1).all())

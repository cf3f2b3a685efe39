"""Partial rollouts: tokens appended to a sample's ragged column while it is generated.

A rollout worker appends each sample's new tokens every few decoding steps, tagged with
the policy version that produced them. If the worker is preempted, its lease expires and
the next worker reads the prefix (``hub.partial``) and resumes generating from it instead
of starting over, which would bias training towards short responses. The final ``put``
of the column completes it and drops the prefix.

Invariants (tests/unit/test_partial.py): a prefix is exactly the concatenation of the
appends to it, in order, with one version per token; a completed column or an evicted
sample has no prefix; a persistent unit restarted on its folder has the same prefixes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from flowrl._schema.columns import Column
from flowrl._schema.encode import numeric_array
from flowrl._store.persist import PartialLog, load_partial, partial_files

__all__ = ["VERSIONS", "PartialStore"]

_Piece = tuple[np.ndarray, int]  # values, version
#: How prefixes' per-token policy versions are typed (on the wire and in ``hub.partial``).
VERSIONS = Column.ragged("versions", "int64")


class PartialStore:
    """Per ragged column, per sample index: the appended pieces. Not thread-safe."""

    def __init__(self, folder: str | None, *, fsync: bool) -> None:
        self.folder = folder
        self.fsync = fsync
        self._pieces: dict[str, dict[int, list[_Piece]]] = {}
        self._logs: dict[str, PartialLog] = {}

    def load(self, keep: Callable[[str, np.ndarray], np.ndarray]) -> None:
        """Bring back persisted prefixes for which ``keep(column, indices)`` is True."""
        if self.folder is None:
            return
        for path in partial_files(self.folder):
            loaded = load_partial(path)
            if loaded is None:
                os.unlink(path)
                continue
            column, batches = loaded
            for indices, versions, values in batches:
                for i, piece in enumerate(_rows(values)):
                    self._add(column.name, int(indices[i]), piece, int(versions[i]))
            self.clear(column.name, self._dead(column.name, keep))
            self._log(column)  # compacted: rewritten with the live prefixes only

    def _dead(self, name: str, keep: Callable[[str, np.ndarray], np.ndarray]) -> np.ndarray:
        held = np.fromiter(self._pieces.get(name, {}), dtype=np.int64)
        return held[~keep(name, held)] if held.size else held

    def append(
        self, indices: np.ndarray, column: Column, values: pa.Array, version: int
    ) -> np.ndarray:
        """Append row ``i`` of ``values`` to sample ``indices[i]``; returns the new lengths."""
        log = None if self.folder is None else self._log(column)
        lengths = np.empty(indices.size, dtype=np.int64)
        for i, piece in enumerate(_rows(values)):
            lengths[i] = self._add(column.name, int(indices[i]), piece, version)
        if log is not None:
            if log.full:
                log.rewrite(*self._flat(column))
            else:
                log.append(indices, np.full(indices.size, version, dtype=np.int64), values)
        return lengths

    def read(self, indices: np.ndarray, column: Column) -> tuple[pa.Array, pa.Array]:
        """Prefixes of ``indices`` (empty when none): values and per-token versions."""
        held = self._pieces.get(column.name, {})
        pieces = [held.get(index, []) for index in indices.tolist()]
        lengths = [sum(p.size for p, _ in sample) for sample in pieces]
        flat = [piece for sample in pieces for piece in sample]
        return _ragged(column, lengths, [p for p, _ in flat]), _ragged(
            VERSIONS, lengths, [np.full(p.size, v, dtype=np.int64) for p, v in flat]
        )

    def clear(self, name: str | None, indices: np.ndarray) -> None:
        """Drop prefixes of ``indices`` (of one column, or of every column)."""
        names = list(self._pieces) if name is None else [name]
        for col in names:
            held = self._pieces.get(col)
            if held:
                for index in indices.tolist():
                    held.pop(index, None)

    def close(self) -> None:
        for log in self._logs.values():
            log.close()

    def _add(self, name: str, index: int, piece: np.ndarray, version: int) -> int:
        pieces = self._pieces.setdefault(name, {}).setdefault(index, [])
        pieces.append((piece, version))
        return sum(p.size for p, _ in pieces)

    def _log(self, column: Column) -> PartialLog:
        log = self._logs.get(column.name)
        if log is None:
            assert self.folder is not None
            log = self._logs[column.name] = PartialLog(self.folder, column, fsync=self.fsync)
            log.rewrite(*self._flat(column))
        return log

    def _flat(self, column: Column) -> tuple[np.ndarray, np.ndarray, pa.Array]:
        """Every live piece as one row ``(index, version, values)``, as a log stores them."""
        rows = [
            (index, version, piece)
            for index, pieces in self._pieces.get(column.name, {}).items()
            for piece, version in pieces
        ]
        return (
            np.array([r[0] for r in rows], dtype=np.int64),
            np.array([r[1] for r in rows], dtype=np.int64),
            _ragged(column, [r[2].size for r in rows], [r[2] for r in rows]),
        )


def _ragged(column: Column, lengths: list[int], pieces: list[np.ndarray]) -> pa.Array:
    """A ragged Arrow array of ``len(lengths)`` rows whose values are ``pieces`` in order."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(pieces) if pieces else np.empty(0, dtype=column.np_dtype)
    return pa.LargeListArray.from_arrays(
        numeric_array(offsets), numeric_array(flat.astype(column.np_dtype, copy=False))
    )


def _rows(values: pa.Array) -> list[np.ndarray]:
    """Each row of a ragged Arrow array as its own numpy array (copied: pieces outlive
    the received message they came in)."""
    offsets = values.offsets.to_numpy()
    flat = values.values.to_numpy(zero_copy_only=False)
    return [flat[offsets[i] : offsets[i + 1]].copy() for i in range(len(values))]

"""The (sample, column) metadata table: numpy arrays over a fixed ring of slots.

Invariants (asserted by tests/unit/test_table_properties.py):

* A sample index lives in slot ``index % capacity`` and indices only grow, so an index is
  never reused and a stale index is detected by comparing ``owner[slot]``.
* ``owner[slot] == -1`` iff the slot is free; ``live`` counts the non-free slots.
* Every array is indexed by slot and updated with vectorised numpy operations only.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from flowrl.errors import HubFull, UnknownIndexError

__all__ = ["SampleTable", "all_set", "all_zero", "any_set"]


# A put, claim or ack touches a few samples: searching a mask's bytes costs a fraction of
# numpy's ``.all()`` / ``.any()`` reductions (a bool array holds one byte 0 or 1 each).
def all_set(mask: np.ndarray) -> bool:
    """Whether every entry of the bool array ``mask`` is True."""
    return b"\x00" not in mask.tobytes()


def any_set(mask: np.ndarray) -> bool:
    """Whether some entry of the bool array ``mask`` is True."""
    return b"\x01" in mask.tobytes()


def all_zero(values: np.ndarray) -> bool:
    """Whether every entry of ``values`` is zero (all its bytes are)."""
    raw = values.tobytes()
    return raw.count(0) == len(raw)


_FREE = np.int64(-1).tobytes()  # a free slot's owner
_SIGN = 7 if sys.byteorder == "little" else 0  # the byte of an int64 holding its sign bit


def _no_negative(values: np.ndarray) -> bool:
    """Whether no entry of the int64 array ``values`` is negative (its sign bytes are all
    below 0x80: a few bytes to scan instead of numpy's ``.min()`` reduction)."""
    return max(values.tobytes()[_SIGN::8], default=0) < 0x80


class SampleTable:
    """Per-slot sample metadata and per-column readiness/size cells."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owner = np.full(capacity, -1, dtype=np.int64)
        self.committed = np.zeros(capacity, dtype=bool)  # visible (first put finished)
        self.partition = np.zeros(capacity, dtype=np.int32)
        self.group = np.full(capacity, -1, dtype=np.int64)
        self.version = np.full(capacity, -1, dtype=np.int64)
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.unit = np.zeros(capacity, dtype=np.int16)
        self.created = np.zeros(capacity, dtype=np.float64)
        self.ready: dict[str, np.ndarray] = {}
        self.nbytes: dict[str, np.ndarray] = {}
        self.live = 0
        self.next_index = 0  # the next index to try; indices are allocated in increasing order

    def add_column(self, name: str) -> None:
        if name not in self.ready:
            self.ready[name] = np.zeros(self.capacity, dtype=bool)
            self.nbytes[name] = np.zeros(self.capacity, dtype=np.int64)

    # -- allocation -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.capacity - self.live

    def allocate(self, n: int) -> np.ndarray:
        """Reserve ``n`` new, never-used indices (in increasing order); raises HubFull."""
        if n > self.capacity - self.live:
            raise HubFull(
                f"hub capacity {self.capacity} cannot take {n} more samples "
                f"({self.live} live); consumers must ack first, or raise HubConfig.capacity"
            )
        cap = self.capacity
        start = self.next_index
        s0 = start % cap
        if s0 + n <= cap and self.owner[s0 : s0 + n].tobytes() == _FREE * n:
            # Fastest path (the usual case: FIFO eviction): the next n slots, unwrapped.
            indices = np.arange(start, start + n, dtype=np.int64)
            self._place(indices, slice(s0, s0 + n), start + n)
            return indices
        # Fast path: the next n slots in ring order are free.
        slots = (start + np.arange(n, dtype=np.int64)) % cap
        if not (self.owner[slots] == -1).all():
            free = np.flatnonzero(self.owner == -1)
            # Walk the ring from the cursor: free slots at/after it first, then wrapped ones.
            ordered = np.concatenate([free[free >= s0], free[free < s0]])[:n]
            slots = ordered
        # Index = the smallest value >= start that maps to the slot: monotone, never reused.
        indices = start + (slots - start) % cap
        self.place(indices)
        return indices

    def place(self, indices: np.ndarray) -> None:
        """Occupy the slots of given fresh indices (allocation, or a journal's replay)."""
        self._place(indices, indices % self.capacity, int(indices.max()) + 1)

    def _place(self, indices: np.ndarray, slots: np.ndarray | slice, end: int) -> None:
        """``end``: one past the largest of ``indices``."""
        self.owner[slots] = indices
        self.committed[slots] = False
        for arr in self.ready.values():
            arr[slots] = False
        self.tokens[slots] = 0
        self.created[slots] = time.time()
        self.live += int(indices.size)
        self.next_index = max(self.next_index, end)

    def run_slots(self, indices: np.ndarray) -> slice | np.ndarray:
        """Slots of increasing ``indices`` (an allocation's): a slice when they are
        consecutive and do not wrap around the ring (writing a slice costs less)."""
        n = indices.size
        s0 = int(indices[0]) % self.capacity if n else 0
        if n and s0 + n <= self.capacity and int(indices[-1]) - int(indices[0]) == n - 1:
            return slice(s0, s0 + n)
        return indices % self.capacity

    def slots_of(self, indices: np.ndarray, *, committed: bool = True) -> np.ndarray:
        """Slots of live indices; raises UnknownIndexError naming the first bad index."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise UnknownIndexError(
                f"sample indices must be a 1-D integer array, got {idx.dtype} shape {idx.shape}"
            )
        idx = idx.astype(np.int64, copy=False)
        slots = idx % self.capacity
        # (an index of -1 names a free slot's owner: never committed, but checked if not)
        if self.owner[slots].tobytes() != idx.tobytes() or not (
            all_set(self.committed[slots]) if committed else _no_negative(idx)
        ):
            ok = (idx >= 0) & (self.owner[slots] == idx)
            if committed:
                ok &= self.committed[slots]
            bad = int(idx[np.flatnonzero(~ok)[0]])
            raise UnknownIndexError(
                f"sample index {bad} does not exist (never allocated, not yet put, or evicted)"
            )
        return slots

    def free(self, slots: np.ndarray) -> None:
        self.owner[slots] = -1
        self.committed[slots] = False
        self.live -= int(slots.size)

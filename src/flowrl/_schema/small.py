"""Checks of small int64 arrays on the hub's per-message paths.

A stage round handles one sample at a time, and each numpy reduction (``min``, ``max``,
``all``, ``any``) costs ~1.5 µs of call overhead however few values it sees: a dozen of
them was a tenth of a round's Python. For a few values, Python's own ``min`` and ``max``
over ``tolist()`` cost a tenth of that; larger arrays still go to numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FEW",
    "SMALL",
    "all_equal",
    "bounds",
    "has_negative",
    "never_decreasing",
    "one_if_equal",
]

#: Up to this many values, Python's reductions beat numpy's.
SMALL = 32
#: Up to this many, reading or writing elements one by one beats one fancy-indexing call
#: (``a[slots]``, ``a[slots] += 1``: several µs in a server loop, whose caches are cold).
FEW = 8


def bounds(values: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty 1-D int array, as Python ints."""
    if values.size <= SMALL:
        listed = values.tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def all_equal(values: np.ndarray) -> bool:
    """Whether every value of a non-empty 1-D array equals the first."""
    if values.size <= SMALL:
        listed = values.tolist()
        return listed.count(listed[0]) == len(listed)
    return bool((values == values[0]).all())


def one_if_equal(values: np.ndarray) -> int | np.ndarray:
    """A non-empty 1-D int array as one int when every value is the same (per-sample
    versions that are one version), else the array."""
    return int(values[0]) if all_equal(values) else values


def has_negative(values: np.ndarray) -> bool:
    """Whether a 1-D int array holds a value below 0 (False when empty)."""
    if values.size <= SMALL:
        return min(values.tolist(), default=0) < 0
    return bool(values.min() < 0)


def never_decreasing(values: np.ndarray) -> bool:
    """Whether each value of a 1-D int array is >= the one before (offsets of a put of a
    few samples: a Python pass over them costs a third of numpy's compare and ``any``)."""
    if values.size <= SMALL + 1:
        listed = values.tolist()
        return listed == sorted(listed)  # (timsort checks a sorted list in one pass)
    return not bool((values[1:] < values[:-1]).any())

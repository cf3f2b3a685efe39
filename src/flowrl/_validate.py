"""Small argument checks shared by config objects, samplers and the client."""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np

from flowrl.errors import ConfigError

__all__ = ["check_seconds", "int_in", "is_int"]


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_in(value: Any, low: int, what: str, *, high: int = 2**63 - 1) -> int:
    """``value`` as an int in [low, high]: a Python or numpy integer, never a bool (numpy
    integers come from arrays: ``a.sum()``, ``a[i]``); else ConfigError("what, got ...")."""
    is_integer = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if is_integer and low <= value <= high:
        return int(value)
    raise ConfigError(f"{what}, got {value!r}")


def check_seconds(value: Any, what: str, *, allow_zero: bool) -> float | None:
    """None, or a non-negative number of seconds (infinity allowed, NaN refused) as a
    float; else ConfigError naming ``what``."""
    if value is None:
        return None
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if ok:
        ok = value >= 0 if allow_zero else value > 0  # False for NaN
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{what} must be a number of seconds {bound} or None, got {value!r}")
    return float(value)

"""Small argument checks shared by config objects, samplers and the client."""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = ["is_int"]


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)

"""The flowrl column a DataProto key becomes when no flowrl schema names it.

Keys a DataProto carries that ``to_dataproto`` did not write (a batch verl built, or
fields verl added: ``old_log_probs``, ``advantages``, ``__num_turns__``, ...) become
columns chosen so that ``to_dataproto`` gives back the very same value:

=====================================  ===================================================
DataProto key                          flowrl column
=====================================  ===================================================
tensor ``(n,)`` / ``(n, *shape)``      scalar / tensor of its dtype (padding kept as is)
jagged nested tensor                   ragged of its dtype
numpy ``(n,)`` / ``(n, *shape)``       scalar / tensor (``to_dataproto(non_tensor=...)``
of numbers                             puts it back in ``non_tensor_batch``)
object array of str / ``<U`` array     string (back as an object array of str)
object array of 1-D number arrays      ragged (back in ``non_tensor_batch`` as arrays)
other object array                     object (msgpack: dicts, lists, str, numbers, None)
=====================================  ===================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowrl._schema.columns import Column
from flowrl._schema.encode import infer_column
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import SchemaError

__all__ = ["host", "infer_array", "infer_tensor", "unnest"]

_NUMBER_KINDS = "biuf"


def infer_tensor(name: str, t: Any) -> tuple[Column, Any]:
    """A ``dp.batch`` tensor as a column and the values ``encode`` takes for it."""
    if t.is_nested:
        r = unnest(t)
        return Column.ragged(name, r.values.dtype.name), r
    try:
        values = host(t)
    except TypeError as exc:  # bfloat16 and other dtypes numpy lacks
        raise SchemaError(
            f"from_dataproto(): batch[{name!r}] is {t.dtype}, which numpy (and flowrl) cannot "
            f"hold ({exc}); cast it, e.g. dp.batch[{name!r}] = dp.batch[{name!r}].float()"
        ) from None
    return infer_column(name, values), values


def infer_array(name: str, a: np.ndarray) -> tuple[Column, Any]:
    """A ``dp.non_tensor_batch`` array as a column and the values ``encode`` takes."""
    if a.dtype.kind in _NUMBER_KINDS:
        return infer_column(name, a), a
    if a.dtype.kind == "U":
        return Column.string(name), a.tolist()
    if a.dtype != object or a.ndim != 1:
        raise SchemaError(
            f"from_dataproto(): non_tensor_batch[{name!r}] is a {a.dtype} array of shape "
            f"{a.shape}; flowrl takes numbers, str, or a 1-D object array"
        )
    items = list(a)
    if all(isinstance(v, str) for v in items):
        return Column.string(name), items
    dtypes = {v.dtype for v in items if isinstance(v, np.ndarray) and v.ndim == 1}
    if items and len(dtypes) == 1 and all(isinstance(v, np.ndarray) for v in items):
        dtype = dtypes.pop()
        if dtype.kind in _NUMBER_KINDS:
            return Column.ragged(name, dtype.name), RaggedArray.from_list(items, dtype)
    return Column.object(name), items


def host(t: Any) -> np.ndarray:
    """A tensor's values as numpy, wherever it lives (verl may have moved it to a GPU)."""
    return t.detach().cpu().numpy()


def unnest(t: Any) -> RaggedArray:
    """A jagged nested tensor's rows (a chunk's view may not start at offset 0)."""
    offsets = host(t.offsets())
    start, end = int(offsets[0]), int(offsets[-1])
    return RaggedArray(host(t.values())[start:end], offsets - start)

"""Batch: the columns of a claimed micro-batch, as zero-copy numpy/torch views of Arrow data.

Dense columns come back dense (``(n,)`` or ``(n, *shape)``), ragged columns come back as a
:class:`RaggedArray` (values + ``cu_seqlens``) or padded with a mask on request. Arrays
share memory with the hub's storage and are read-only: copy before modifying in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, final

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._controller.meta import BatchMeta
from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray, arrow_ragged_parts
from flowrl.errors import SchemaError, UnknownColumnError

__all__ = ["Batch", "LazyColumn", "arrow_of"]

_msgpack = msgspec.msgpack.Decoder()


@final
class LazyColumn:
    """A column read as numpy views (``value``: what ``batch[name]`` returns), its Arrow
    array built only when asked for (``build``): an in-place read from a storage unit's
    shared memory hands the views over without making Arrow arrays first."""

    __slots__ = ("build", "value")

    def __init__(self, value: Any, build: Callable[[], pa.Array]) -> None:
        self.value = value
        self.build = build


def arrow_of(column: pa.Array | LazyColumn) -> pa.Array:
    return column.build() if isinstance(column, LazyColumn) else column


@final
class Batch:
    """Data of the samples in ``meta``, in the same order as ``meta.indices``."""

    __slots__ = ("_arrays", "_cache", "_columns", "meta")

    def __init__(
        self,
        meta: BatchMeta,
        arrays: Mapping[str, pa.Array | LazyColumn],
        columns: Mapping[str, Column],
    ) -> None:
        self.meta = meta
        self._arrays = dict(arrays)  # arrow() replaces a LazyColumn by what it builds
        self._columns = columns
        self._cache: dict[str, Any] = {}

    @property
    def indices(self) -> np.ndarray:
        return self.meta.indices

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self._arrays)

    def column(self, name: str) -> Column:
        """The declared :class:`~flowrl.Column` of ``name`` (its kind, dtype and shape)."""
        if name not in self._arrays:
            self.arrow(name)  # raises UnknownColumnError naming the batch's columns
        return self._columns[name]

    def __len__(self) -> int:
        return len(self.meta)

    def __contains__(self, name: object) -> bool:
        return name in self._arrays

    def __repr__(self) -> str:
        return f"Batch(n={len(self)}, columns={list(self._arrays)})"

    def arrow(self, name: str) -> pa.Array:
        try:
            arr = self._arrays[name]
        except KeyError:
            raise UnknownColumnError(
                f"column {name!r} is not in this batch (it has {list(self._arrays)}); "
                "claim or get it"
            ) from None
        if isinstance(arr, LazyColumn):
            arr = self._arrays[name] = arr.build()
        return arr

    def __getitem__(self, name: str) -> Any:
        """numpy array (dense), RaggedArray (ragged), list[str] or list of objects."""
        value = self._cache.get(name)
        if value is None:
            lazy = self._arrays.get(name)
            if isinstance(lazy, LazyColumn):
                value = lazy.value
            else:  # arrow() raises UnknownColumnError for a column not in the batch
                value = _to_python(self._columns[name], self.arrow(name))
            self._cache[name] = value
        return value

    def numpy(self, name: str) -> np.ndarray:
        value = self[name]
        if not isinstance(value, np.ndarray):
            raise SchemaError(
                f"column {name!r} is {self._columns[name].describe()}, not dense; use "
                "batch.packed()/batch.padded() for ragged columns"
            )
        return value

    def torch(self, name: str, *, copy: bool = False) -> Any:
        """A dense column as a torch tensor (shares memory unless ``copy``)."""
        return _torch(self.numpy(name), copy)

    def packed(self, name: str, *, torch: bool = False, copy: bool = False) -> tuple[Any, Any]:
        """A ragged column as ``(values, cu_seqlens)``."""
        r = self.ragged(name)
        if torch:
            return _torch(r.values, copy), _torch(r.cu_seqlens, copy)
        return r.values, r.cu_seqlens

    def padded(
        self,
        name: str,
        *,
        pad_value: Any = 0,
        max_len: int | None = None,
        left: bool = False,
        torch: bool = False,
    ) -> tuple[Any, Any]:
        """A ragged column as ``(padded (n, L), mask (n, L))``."""
        values, mask = self.ragged(name).padded(pad_value, max_len, left)
        if torch:
            return _torch(values, False), _torch(mask, False)
        return values, mask

    def ragged(self, name: str) -> RaggedArray:
        value = self[name]
        if not isinstance(value, RaggedArray):
            raise SchemaError(f"column {name!r} is {self._columns[name].describe()}, not ragged")
        return value

    def to_dict(self) -> dict[str, Any]:
        return {name: self[name] for name in self._arrays}


def _to_python(column: Column, arr: pa.Array) -> Any:
    kind = column.kind
    if kind == "scalar":
        return _primitive_view(arr, column.np_dtype)
    if kind == "tensor":
        flat = _primitive_view(arr.storage.flatten(), column.np_dtype)
        return flat.reshape((len(arr), *column.shape))
    if kind == "ragged":
        dtype = column.np_dtype
        offsets, data, first = arrow_ragged_parts(arr, dtype)
        start, end = int(offsets[0]), int(offsets[-1])
        if data is None:
            values = _primitive_view(arr.values.slice(start, end - start), dtype)
        else:
            values = np.frombuffer(
                data, dtype=dtype, count=end - start, offset=first * dtype.itemsize
            )
            values.flags.writeable = False  # shared with the hub's storage
        if start:
            offsets = offsets - start
        offsets.flags.writeable = False
        return RaggedArray._trusted(values, offsets)
    if kind == "string":
        return arr.to_pylist()
    return [_msgpack.decode(b) for b in arr.to_pylist()]


def _primitive_view(arr: pa.Array, dtype: np.dtype) -> np.ndarray:
    """A read-only numpy view of a null-free primitive Arrow array (bools are unpacked)."""
    if dtype.kind == "b":
        out = arr.to_numpy(zero_copy_only=False)
    elif (data := arr.buffers()[1]) is None:
        out = np.empty(0, dtype=dtype)
    else:
        out = np.frombuffer(data, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
    out.flags.writeable = False  # shared with the hub's storage (and with other tasks)
    return out


def _torch(arr: np.ndarray, copy: bool) -> Any:
    import torch

    if copy or arr.flags.writeable:
        return torch.from_numpy(np.array(arr, copy=True) if copy else arr)
    with warnings.catch_warnings():  # a read-only view: documented, do not modify in place
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)

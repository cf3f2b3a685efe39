"""Validate user data against a column and turn it into an Arrow array (one copy, owned).

Rules: arrays and tensors must match the declared dtype exactly (nothing is silently
cast); plain Python lists are converted to the declared dtype when the conversion is
lossless in kind (ints to floats yes, floats to ints no). Errors name the column, what was
expected, what was got and where, and suggest a fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray, _as_numpy
from flowrl.errors import LengthMismatchError, SchemaError

__all__ = ["Encoded", "arrow_of_buffers", "encode", "infer_column"]

_msgpack = msgspec.msgpack.Encoder()


class Encoded:
    """One column of a write, validated and owned by the hub.

    Numeric columns (bools aside) are kept as the buffers they travel as
    (``_transport/frames.py``): the values of scalars and tensors; offsets from 0 and the
    values of ragged columns. A transport sends those; the Arrow array a storage unit keeps
    is built over them on first use (``array``), so a put to another process builds none.
    Bools, strings and objects are encoded to Arrow arrays (``buffers`` is None).
    """

    __slots__ = ("_array", "buffers", "column", "length", "lengths", "nbytes")

    def __init__(
        self,
        column: Column,
        length: int,
        nbytes: np.ndarray,
        lengths: np.ndarray | None,
        *,
        buffers: list[np.ndarray] | None = None,
        array: pa.Array | None = None,
    ) -> None:
        self.column = column
        self.length = length  # samples
        self.nbytes = nbytes  # int64 bytes per sample
        self.lengths = lengths  # int64 sequence lengths for ragged columns
        self.buffers = buffers
        self._array = array

    @property
    def array(self) -> pa.Array:
        if self._array is None:
            assert self.buffers is not None
            values = self.buffers[-1].size
            self._array = arrow_of_buffers(self.column, self.length, values, self.buffers)
        return self._array

    def take(self, positions: np.ndarray) -> Encoded:
        """The samples at ``positions`` (the part of a write for one storage unit)."""
        return Encoded(
            self.column,
            int(positions.size),
            self.nbytes[positions],
            None if self.lengths is None else self.lengths[positions],
            array=self.array.take(numeric_array(positions)),
        )


def arrow_of_buffers(column: Column, n: int, values: int, buffers: Sequence[Any]) -> pa.Array:
    """The Arrow array of ``n`` samples of a scalar, tensor or ragged ``column`` over its
    buffers as they travel (``_transport/frames.py``): the ``values`` values (bit-packed
    for bools) of scalars and tensors; offsets from 0 and the values of ragged columns.
    Zero-copy and unchecked: the caller made the buffers, or checked them."""
    flat = pa.Array.from_buffers(column.value_type, values, [None, pa.py_buffer(buffers[-1])])
    if column.kind == "scalar":
        return flat
    if column.kind == "tensor":
        storage = pa.FixedSizeListArray.from_arrays(flat, math.prod(column.shape))
        return pa.ExtensionArray.from_storage(column.arrow_type, storage)
    offsets = pa.py_buffer(buffers[0])
    return pa.Array.from_buffers(column.arrow_type, n, [None, offsets], children=[flat])


def encode(column: Column, values: Any, n: int | None, where: str, owned: bool = True) -> Encoded:
    """Validate ``values`` for ``column`` (``n`` samples if given); build an owned Arrow array.

    ``owned=False``: numeric buffers may be views of ``values`` (no copy) where the caller
    copies them before it returns, e.g. a put into a storage unit's memory that waits."""
    if column.kind == "ragged":
        return _encode_ragged(column, values, n, where, owned)
    if column.kind in ("scalar", "tensor"):
        return _encode_dense(column, values, n, where, owned)
    if column.kind == "string":
        return _encode_strings(column, values, n, where)
    return _encode_objects(column, values, n, where)


def infer_column(name: str, values: Any) -> Column:
    """The column a first write declares implicitly."""
    if isinstance(values, RaggedArray):
        return Column.ragged(name, values.dtype.name)
    if isinstance(values, np.ndarray) or _is_tensor(values):
        arr = _as_numpy(values)
        if arr.ndim == 0:
            raise SchemaError(f"column {name!r}: expected one value per sample, got a 0-d array")
        if arr.dtype.kind not in "biuf":
            raise SchemaError(
                f"column {name!r}: cannot infer a column from an array of dtype {arr.dtype}; "
                "declare it with Column.string/Column.object"
            )
        if arr.ndim == 1:
            return Column.scalar(name, arr.dtype.name)
        return Column.tensor(name, arr.dtype.name, tuple(int(d) for d in arr.shape[1:]))
    if isinstance(values, list | tuple) and values:
        first = values[0]
        if isinstance(first, str):
            return Column.string(name)
        if isinstance(first, np.ndarray) or _is_tensor(first):
            return Column.ragged(name, _as_numpy(first).dtype.name)
        if isinstance(first, bool):
            return Column.scalar(name, "bool")
        if isinstance(first, int):
            return Column.scalar(name, "int64")
        if isinstance(first, float):
            return Column.scalar(name, "float64")
        if isinstance(first, list | tuple):
            return Column.ragged(name, np.asarray(first).dtype.name if first else "int64")
        return Column.object(name)
    raise SchemaError(
        f"column {name!r} is not declared and its type cannot be inferred from "
        f"{type(values).__name__}; declare it, e.g. Column.ragged({name!r}, 'int64')"
    )


# -- dense ---------------------------------------------------------------------------------
def _encode_dense(column: Column, values: Any, n: int | None, where: str, owned: bool) -> Encoded:
    shape = column.shape
    arr = _checked_array(column, values, where)
    if arr.ndim != 1 + len(shape) or tuple(arr.shape[1:]) != shape:
        want = "(n,)" if column.kind == "scalar" else f"(n, {', '.join(map(str, shape))})"
        raise SchemaError(
            f"column {column.name!r} expects {column.describe()}, i.e. an array of shape {want}, "
            f"got shape {tuple(arr.shape)} in {where}"
        )
    _check_count(column, arr.shape[0], n, where)
    # A fresh copy costs as much as the put's own copy here (new pages fault one by one).
    arr = np.array(arr, order="C", copy=True) if owned else np.ascontiguousarray(arr)
    count = arr.shape[0]
    nbytes = np.empty(count, dtype=np.int64)
    nbytes.fill(arr.itemsize * math.prod(shape))  # (np.full costs 5x more on one sample)
    if arr.dtype.kind != "b":
        return Encoded(column, count, nbytes, None, buffers=[arr.reshape(-1)])
    if column.kind == "scalar":
        return Encoded(column, count, nbytes, None, array=pa.array(arr, type=pa.bool_()))
    flat = pa.array(arr.reshape(-1), type=pa.bool_())
    storage = pa.FixedSizeListArray.from_arrays(flat, math.prod(shape))
    array = pa.ExtensionArray.from_storage(column.arrow_type, storage)
    return Encoded(column, count, nbytes, None, array=array)


def _checked_array(column: Column, values: Any, where: str) -> np.ndarray:
    want = column.np_dtype
    tensor = type(values) is not np.ndarray and _is_tensor(values)
    if tensor or isinstance(values, np.ndarray):
        if tensor and str(values.dtype) == "torch.bfloat16":
            raise SchemaError(
                f"column {column.name!r} expects {column.describe()}, got a bfloat16 tensor in "
                f"{where}; numpy has no bfloat16: convert with .float() and declare float32"
            )
        arr = _as_numpy(values)
        if arr.dtype != want:
            raise SchemaError(
                f"column {column.name!r} expects {column.describe()}, got {arr.dtype} of shape "
                f"{tuple(arr.shape)} in {where}; cast with .astype({want.name!r}) / "
                f".to(torch.{want.name}) or declare the column as {arr.dtype}"
            )
        return arr
    if isinstance(values, list | tuple):
        try:
            arr = np.asarray(values)
        except ValueError as exc:
            raise SchemaError(
                f"column {column.name!r} expects {column.describe()}; the list given in {where} "
                f"is not rectangular ({exc})"
            ) from None
        if arr.size and not _lossless(arr, want):
            raise SchemaError(
                f"column {column.name!r} expects {column.describe()}, got Python values of "
                f"kind {arr.dtype} in {where} that do not convert to {want} without loss"
            )
        return arr.astype(want, copy=False)
    raise SchemaError(
        f"column {column.name!r} expects {column.describe()} as a numpy array, torch tensor or "
        f"list, got {type(values).__name__} in {where}"
    )


def _lossless(arr: np.ndarray, want: np.dtype) -> bool:
    """Python values convert when the kind allows it and every value fits."""
    if want.kind == "b":
        return arr.dtype.kind == "b"
    if want.kind in "iu":
        if arr.dtype.kind not in "iu":
            return False
        info = np.iinfo(want)
        return bool(info.min <= arr.min() and arr.max() <= info.max)
    if arr.dtype.kind not in "iuf":
        return False
    with np.errstate(over="ignore"):  # a finite value must stay finite (1e300 -> float32)
        return bool((np.isfinite(arr.astype(want)) | ~np.isfinite(arr)).all())


# -- ragged --------------------------------------------------------------------------------
def _encode_ragged(column: Column, values: Any, n: int | None, where: str, owned: bool) -> Encoded:
    want = column.np_dtype
    if isinstance(values, RaggedArray):
        if values.values.dtype != want and values.values.size:
            raise SchemaError(
                f"column {column.name!r} expects {column.describe()}, got "
                f"{values.values.dtype} sequences in {where}; cast with "
                f".astype({column.dtype!r}) or declare the column as {values.values.dtype}"
            )
        _check_count(column, len(values), n, where)
        vals = np.array(values.values, dtype=want, copy=True if owned else None)
        offsets = np.array(values.cu_seqlens, dtype=np.int64, copy=True if owned else None)
    elif isinstance(values, list | tuple):
        _check_count(column, len(values), n, where)
        seqs = [_checked_sequence(column, item, i, want, where) for i, item in enumerate(values)]
        sizes = itertools.accumulate([s.size for s in seqs], initial=0)
        offsets = np.fromiter(sizes, dtype=np.int64, count=len(seqs) + 1)
        # concatenate makes the one owned copy (also of a single sequence)
        vals = np.concatenate(seqs) if seqs else np.empty(0, dtype=want)
    elif isinstance(values, np.ndarray) or _is_tensor(values):
        raise SchemaError(
            f"column {column.name!r} expects {column.describe()}, got a dense array of shape "
            f"{tuple(_as_numpy(values).shape)} in {where}; pass a list of 1-D arrays or "
            "RaggedArray.from_padded(padded, lengths)"
        )
    else:
        raise SchemaError(
            f"column {column.name!r} expects {column.describe()} (a list of 1-D arrays or a "
            f"RaggedArray), got {type(values).__name__} in {where}"
        )
    lengths = offsets[1:] - offsets[:-1]  # np.diff costs ~8x more on a few samples
    count = lengths.size
    if vals.dtype.kind != "b":
        return Encoded(column, count, lengths * vals.itemsize, lengths, buffers=[offsets, vals])
    child = pa.array(vals, type=pa.bool_())
    array = pa.Array.from_buffers(
        column.arrow_type, count, [None, pa.py_buffer(offsets)], children=[child]
    )
    return Encoded(column, count, lengths * vals.itemsize, lengths, array=array)


def _checked_sequence(column: Column, item: Any, i: int, want: np.dtype, where: str) -> np.ndarray:
    """Item ``i`` of a ragged column's list as a 1-D array of the column's dtype."""
    if type(item) is np.ndarray and item.dtype == want and item.ndim == 1:
        return item  # the common case, without the general checks
    if isinstance(item, list | tuple | np.ndarray) or _is_tensor(item):
        seq = _checked_array(column, item, where)
    else:
        raise SchemaError(
            f"column {column.name!r} expects {column.describe()}; item {i} in {where} is "
            f"a {type(item).__name__}, expected a 1-D array, tensor or list"
        )
    if seq.ndim != 1:
        raise SchemaError(
            f"column {column.name!r} expects {column.describe()}; item {i} in {where} "
            f"has shape {seq.shape}, expected a 1-D sequence"
        )
    return seq


# -- strings and objects -------------------------------------------------------------------
def _encode_strings(column: Column, values: Any, n: int | None, where: str) -> Encoded:
    if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
        got = type(values).__name__
        if isinstance(values, list | tuple):
            bad = next(v for v in values if not isinstance(v, str))
            got = f"a list containing {type(bad).__name__}"
        raise SchemaError(f"column {column.name!r} expects a list of str, got {got} in {where}")
    _check_count(column, len(values), n, where)
    try:
        encoded = [v.encode() for v in values]
    except UnicodeEncodeError as exc:
        raise SchemaError(
            f"column {column.name!r}: a str in {where} is not valid Unicode ({exc.reason}); "
            "remove lone surrogates or store the data as bytes in an object column"
        ) from None
    return _blobs(column, encoded, pa.large_string())


def _encode_objects(column: Column, values: Any, n: int | None, where: str) -> Encoded:
    if not isinstance(values, list | tuple):
        raise SchemaError(
            f"column {column.name!r} expects a list of msgpack-encodable objects, got "
            f"{type(values).__name__} in {where}"
        )
    _check_count(column, len(values), n, where)
    try:
        blobs = [_msgpack.encode(v) for v in values]
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise SchemaError(
            f"column {column.name!r}: a value in {where} is not msgpack-encodable ({exc}); "
            "use plain dicts/lists/str/numbers or a msgspec.Struct"
        ) from None
    return _blobs(column, blobs, pa.large_binary())


def _blobs(column: Column, blobs: list[bytes], arrow_type: pa.DataType) -> Encoded:
    """Variable-size values already encoded to bytes (UTF-8 text is viewed, not re-encoded)."""
    array = pa.array(blobs, type=pa.large_binary())
    if arrow_type != array.type:
        array = array.view(arrow_type)
    nbytes = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
    return Encoded(column, len(blobs), nbytes, None, array=array)


def numeric_array(values: np.ndarray) -> pa.Array:
    """A 1-D numeric numpy array as an Arrow array over the same memory. Unlike
    ``pa.array`` it never probes for pandas (whose first import costs ~0.5 s)."""
    values = np.ascontiguousarray(values)
    dtype = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(dtype, values.size, [None, pa.py_buffer(values)])


def _check_count(column: Column, got: int, n: int | None, where: str) -> None:
    if n is not None and got != n:
        raise LengthMismatchError(
            f"column {column.name!r} has {got} samples but {n} were expected in {where}; "
            "every column of one put() must have one entry per sample"
        )


def _is_tensor(x: Any) -> bool:
    return type(x).__module__ == "torch" and hasattr(x, "detach")

"""TensorDict fields to flowrl columns and back (torch and tensordict imported lazily).

What a field becomes, and what reading it gives back (TransferQueue's own return layout):

=====================================  ===============  ====================================
a put field (batch dimension first)    flowrl column    get_data returns
=====================================  ===============  ====================================
tensor ``[B]``                         scalar           dense tensor ``[B]``
tensor ``[B, L]``                      ragged           jagged nested tensor ``[B, j]``
jagged nested tensor ``[B, j]``        ragged           jagged nested tensor ``[B, j]``
tensor ``[B, d1, d2, ...]``            tensor           jagged nested tensor ``[B, j, d2...]``
``NonTensorStack`` of str              string           ``NonTensorStack``
``NonTensorStack`` of other values     object           ``NonTensorStack``
=====================================  ===============  ====================================

Object values are stored as msgpack: numpy scalars in them come back as Python numbers,
tuples as lists.

A ``[B, L]`` tensor is stored one 1-D sequence per sample, so later puts may use another
``L`` (TransferQueue keeps per-sample shapes too). Values read are copies the caller owns.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from flowrl._client.batch import Batch
from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray
from flowrl.errors import SchemaError

__all__ = ["check_tags", "field_columns", "import_tensordict", "read_fields", "single_sample"]

_INSTALL_HINT = (
    "flowrl.compat.transfer_queue returns TensorDicts: install the compat extra "
    "(pip install torch==2.13.0 'flowrl[compat]')"
)


def import_tensordict() -> Any:
    """The tensordict module, or an ImportError saying how to install it."""
    try:
        import tensordict
    except ImportError as e:
        raise ImportError(f"{e}; {_INSTALL_HINT}") from e
    return tensordict


def field_columns(
    fields: Any, where: str, known: Mapping[str, Column]
) -> tuple[int, list[Column], dict[str, Any]]:
    """The batch size, the columns and the values (as flowrl takes them) of a TensorDict.

    A field already ``known`` with another dtype is cast to it when no value changes (a
    float32 mask may come as int64 ones later, as TransferQueue's tutorial writes it).
    """
    td = import_tensordict()
    if not isinstance(fields, td.TensorDictBase):
        raise SchemaError(
            f"{where} expects a TensorDict of fields (batch dimension first), got "
            f"{type(fields).__name__}"
        )
    if len(fields.batch_size) == 0:
        raise SchemaError(f"{where}: the TensorDict has no batch dimension (batch_size=[])")
    n = int(fields.batch_size[0])
    columns: list[Column] = []
    values: dict[str, Any] = {}
    for name in fields.keys():  # noqa: SIM118 (iterating a TensorDict gives rows)
        if not isinstance(name, str):
            raise SchemaError(f"{where}: nested TensorDict keys are not supported, got {name!r}")
        check_field_name(name, where)
        column, value = _to_column(name, fields.get(name), n, where, td)
        declared = known.get(name)
        if declared is not None and declared != column:
            column, value = declared, _cast(declared, column, value, where)
        columns.append(column)
        values[name] = value
    return n, columns, values


def _cast(declared: Column, got: Column, value: Any, where: str) -> Any:
    """``value`` (read as ``got``) in ``declared``'s dtype, if that changes no value."""
    same_layout = declared.kind == got.kind and declared.shape == got.shape
    if same_layout and got.kind in ("scalar", "tensor", "ragged"):
        flat = value.values if isinstance(value, RaggedArray) else value
        cast = flat.astype(declared.np_dtype)
        if np.array_equal(cast.astype(flat.dtype), flat):
            return RaggedArray(cast, value.cu_seqlens) if isinstance(value, RaggedArray) else cast
    raise SchemaError(
        f"{where}: field {declared.name!r} holds {declared.describe()}, got {got.describe()}; "
        "a field keeps the kind and dtype of its first put (cast the values, or use another "
        "field name)"
    )


def check_field_name(name: Any, where: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_tq_"):
        raise SchemaError(
            f"{where}: field name {name!r} is not usable; flowrl column names are Python "
            "identifiers and the prefix '_tq_' is reserved for the compat client's own columns"
        )


def _to_column(name: str, value: Any, n: int, where: str, td: Any) -> tuple[Column, Any]:
    import torch

    if isinstance(value, torch.Tensor):
        dtype = _dtype_name(name, value, where)
        if value.is_nested:
            if value.layout != torch.jagged or value.values().dim() != 1:
                raise SchemaError(
                    f"{where}: field {name!r} is a nested tensor of layout {value.layout} with "
                    f"{value.dim()} dimensions; only jagged [B, j] nested tensors are supported "
                    "(pad it to a dense [B, L, ...] tensor instead)"
                )
            # a jagged tensor's offsets are valid by construction: no re-check
            ragged = RaggedArray._trusted(
                value.values().detach().cpu().numpy(),
                value.offsets().detach().cpu().numpy().astype(np.int64, copy=False),  # type: ignore[attr-defined]
            )
            return _column("ragged", name, dtype), ragged
        arr = value.detach().cpu().numpy()
        if arr.ndim == 1:
            return _column("scalar", name, dtype), arr
        if arr.ndim == 2:
            rows, width = arr.shape
            ragged = RaggedArray._trusted(arr.reshape(-1), _even_offsets(rows, width))
            return _column("ragged", name, dtype), ragged
        return _column("tensor", name, dtype, tuple(int(d) for d in arr.shape[1:])), arr
    items = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(items, list) or len(items) != n:
        raise SchemaError(
            f"{where}: field {name!r} must hold one value per sample ({n}), got "
            f"{type(value).__name__}"
        )
    if all(isinstance(x, str) for x in items):
        return Column.string(name), items
    return Column.object(name), [_plain(x) for x in items]


@functools.lru_cache(maxsize=1024)
def _column(kind: str, name: str, dtype: str, shape: tuple[int, ...] = ()) -> Column:
    """The column a field of this kind and dtype declares (built once: a Column checks its
    dtype when made, which costs more than the rest of a small put's conversion)."""
    if kind == "tensor":
        return Column.tensor(name, dtype, shape)
    return Column.ragged(name, dtype) if kind == "ragged" else Column.scalar(name, dtype)


@functools.lru_cache(maxsize=256)
def _even_offsets(rows: int, width: int) -> np.ndarray:
    """The offsets of ``rows`` sequences of ``width`` (read-only: shared between puts)."""
    offsets = np.arange(rows + 1, dtype=np.int64) * width
    offsets.flags.writeable = False
    return offsets


def _plain(value: Any) -> Any:
    """numpy scalars (a dataset's ``index``, verl's per-sample metadata) as the Python
    numbers msgpack encodes, inside dicts and lists too; anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


_TAG_ENCODER = msgspec.msgpack.Encoder()


def check_tags(tags: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """Tags (``custom_meta``) as the key directory keeps them, numpy scalars as Python
    numbers; a tag msgpack cannot encode is refused here, before anything changes (the
    directory of another process could not be sent it)."""
    plain = []
    for i, tag in enumerate(tags):
        if not isinstance(tag, dict):
            raise SchemaError(f"{where}: tag {i} must be a dict, got {type(tag).__name__}")
        tag = _plain(tag)
        try:
            _TAG_ENCODER.encode(tag)
        except (TypeError, ValueError, OverflowError) as e:
            raise SchemaError(
                f"{where}: tag {i} ({tag!r:.200}) holds a value msgpack cannot encode ({e}); "
                "tags take str, numbers, bools, None, lists and dicts of those (flowrl never "
                "pickles): convert the value, e.g. str(obj) or arr.tolist()"
            ) from e
        plain.append(tag)
    return plain


def _dtype_name(name: str, value: Any, where: str) -> str:
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype in ("bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):
        raise SchemaError(
            f"{where}: field {name!r} is torch.{dtype}, which flowrl columns do not hold; "
            "cast it, e.g. .float(), before the put"
        )
    return dtype


def single_sample(fields: Mapping[str, Any], where: str) -> Any:
    """kv_put's dict of one sample's values as a TensorDict of batch size 1."""
    import torch

    td = import_tensordict()
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise SchemaError(f"{where}: use kv_batch_put for nested tensors ({name!r})")
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = td.NonTensorStack(value)
    return td.TensorDict(batch, batch_size=[1])


def _jagged(values: Any, offsets: np.ndarray) -> Any:
    """A jagged nested tensor over ``values`` split at ``offsets``, knowing its longest and
    shortest row: ``to_padded_tensor`` pads to the longest row (without them torch pads to
    the whole batch's length, quadratic memory for a padded batch).

    torch's own constructor (what ``nested_tensor_from_jagged`` returns, without its view
    bookkeeping: 5x faster here); the public function where that class is not there.
    """
    import torch

    lengths = offsets[1:] - offsets[:-1]  # np.diff costs several times more
    longest, shortest = (int(lengths.max()), int(lengths.min())) if lengths.size else (0, 0)
    offsets_t = torch.from_numpy(np.array(offsets))
    try:
        from torch.nested._internal.nested_tensor import NestedTensor, _store_val_in_tensor
    except ImportError:  # pragma: no cover (a torch without them)
        return torch.nested.nested_tensor_from_jagged(
            values, offsets=offsets_t, max_seqlen=longest, min_seqlen=shortest
        )
    cache = {
        "max_seqlen": _store_val_in_tensor(longest),
        "min_seqlen": _store_val_in_tensor(shortest),
    }
    return NestedTensor(values, offsets_t, _metadata_cache=cache)


def read_fields(batch: Batch, names: Sequence[str], columns: Mapping[str, Column]) -> Any:
    """A flowrl batch as the TensorDict TransferQueue's get_data returns."""
    import torch

    td = import_tensordict()
    n = len(batch)
    out: dict[str, Any] = {}
    for name in names:
        column = columns[name]
        if column.kind == "scalar":
            out[name] = torch.from_numpy(np.array(batch.numpy(name)))
        elif column.kind == "ragged":
            ragged = batch.ragged(name)
            out[name] = _jagged(torch.from_numpy(np.array(ragged.values)), ragged.cu_seqlens)
        elif column.kind == "tensor":
            dense = batch.numpy(name)
            first = column.shape[0]
            rows = np.array(dense).reshape(n * first, *column.shape[1:])
            offsets = np.arange(n + 1, dtype=np.int64) * first
            out[name] = _jagged(torch.from_numpy(rows), offsets)
        else:
            out[name] = td.NonTensorStack(*batch[name])
    # every value was built here with batch dimension n: skip TensorDict's per-value checks
    # (a fifth of a read), where this tensordict has the constructor that does
    unchecked = getattr(td.TensorDict, "_new_unsafe", None)
    return (unchecked or td.TensorDict)(out, batch_size=torch.Size([n]))

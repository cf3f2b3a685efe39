"""Each field of slime's ``Sample`` as hub columns, and back, without loss.

The field list is slime's ``slime/utils/types.py::Sample`` (30 fields; ``group_index`` is
the hub group, not a column). Three encodings:

* **numeric sequences** (``TENSOR_FIELDS``) — a ragged column holding the values flattened,
  plus an object column ``<field>_layout`` holding ``None`` (the field was ``None``) or
  ``[form, dtype, shape]`` with form ``list``, ``ndarray`` or ``tensor``: a torch tensor
  comes back a tensor of its dtype and shape, a nested list the same nested list.
  ``tokens`` is always a flat ``list[int]`` in slime, so it needs no layout.
* **numbers and strings** — scalar and string columns.
* **everything else** — an object column (msgpack) through :func:`to_object`: dicts, lists,
  str, numbers, bool, None and bytes as they are; tuples, numpy arrays and scalars, torch
  tensors and PIL images (raw multimodal inputs) as msgpack extensions of their raw bytes,
  dtype and shape, never pickle. Dataclass fields (``spec_info``, ``prefix_cache_info``)
  travel as their fields and are rebuilt with the field's own class.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import msgspec
import numpy as np

from flowrl._schema.columns import Column
from flowrl.errors import SchemaError

__all__ = [
    "FEED_FIELDS",
    "LAYOUT_SUFFIX",
    "RESULT_FIELDS",
    "SAMPLE_FIELDS",
    "TENSOR_FIELDS",
    "decode_field",
    "encode_field",
    "field_columns",
    "field_of_object",
    "from_object",
    "object_of_field",
    "to_object",
]

#: Set before generation: by slime's dataset and data source, or a custom generate function.
FEED_FIELDS = (
    "index",
    "rollout_id",
    "prompt",
    "tokens",
    "multimodal_inputs",
    "multimodal_train_inputs",
    "multimodal_train_input_id",
    "apply_chat_template_kwargs",
    "label",
    "metadata",
    "generate_function_path",
    "custom_rm_path",
    "train_metadata",
    "session_id",
)
#: Written by the hub's rollout and reward stages; a sample is complete once all are.
RESULT_FIELDS = (
    "response",
    "response_length",
    "reward",
    "loss_mask",
    "weight_versions",
    "rollout_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
    "rollout_routed_experts",
    "remove_sample",
    "teacher_log_probs",
    "status",
    "non_generation_time",
    "spec_info",
    "prefix_cache_info",
)
#: Every ``Sample`` field that is a column (all but ``group_index``).
SAMPLE_FIELDS = FEED_FIELDS + RESULT_FIELDS

#: Numeric sequence fields and the dtype of their ragged column: int32 where slime itself
#: makes int32 tensors, float64 so that Python floats come back exactly.
TENSOR_FIELDS = {
    "loss_mask": "int32",
    "rollout_log_probs": "float64",
    "rollout_top_p_token_ids": "int32",
    "rollout_top_p_token_offsets": "int32",
    "rollout_routed_experts": "int32",
    "teacher_log_probs": "float64",
}
LAYOUT_SUFFIX = "_layout"
_SCALARS = {"response_length": "int64", "remove_sample": "bool", "non_generation_time": "float64"}
_KINDS: dict[str, Callable[[str], Column]] = {
    "tokens": lambda n: Column.ragged(n, "int64"),
    "response": Column.string,
    "status": Column.string,
    **{name: functools.partial(Column.scalar, dtype=d) for name, d in _SCALARS.items()},
    **{name: functools.partial(Column.ragged, dtype=d) for name, d in TENSOR_FIELDS.items()},
}


def field_columns(name: str) -> list[Column]:
    """The hub columns of one ``Sample`` field."""
    columns = [_KINDS.get(name, Column.object)(name)]
    if name in TENSOR_FIELDS:
        columns.append(Column.object(name + LAYOUT_SUFFIX))
    return columns


def encode_field(name: str, values: Sequence[Any]) -> dict[str, Any]:
    """One field of many samples as the data of its columns (:func:`field_columns`)."""
    if name in TENSOR_FIELDS:
        parts = [_flatten(name, v, np.dtype(TENSOR_FIELDS[name])) for v in values]
        return {name: [p[0] for p in parts], name + LAYOUT_SUFFIX: [p[1] for p in parts]}
    if name == "tokens":
        return {name: [np.asarray(v, dtype=np.int64) for v in values]}
    if name == "status":
        return {name: [object_of_field(name, v) for v in values]}
    if name in _SCALARS or name == "response":
        return {name: list(values)}
    return {name: [object_of_field(name, v) for v in values]}


def decode_field(name: str, columns: dict[str, Any], i: int, field: dataclasses.Field) -> Any:
    """Field ``name`` of row ``i`` from the columns a batch returned."""
    value = columns[name][i]
    if name in TENSOR_FIELDS:
        return _unflatten(value, columns[name + LAYOUT_SUFFIX][i])
    if name == "tokens":
        return [int(t) for t in value]
    if isinstance(value, np.generic):
        return value.item()
    return field_of_object(value, field)


# -- numeric sequences ---------------------------------------------------------------------
def _flatten(name: str, value: Any, want: np.dtype) -> tuple[np.ndarray, list[Any] | None]:
    if value is None:
        return np.empty(0, dtype=want), None
    if _is_tensor(value):
        form, dtype = "tensor", str(value.dtype).removeprefix("torch.")
        value = value.detach().cpu()
        arr = (value.float() if dtype == "bfloat16" else value).numpy()
    elif isinstance(value, np.ndarray):
        form, dtype, arr = "ndarray", value.dtype.str, value
    elif isinstance(value, list | tuple):
        form, dtype = "list", ""
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged nesting
            arr = np.asarray(None, dtype=object)
    else:
        raise SchemaError(
            f"slime Sample field {name!r} expects a list, numpy array, torch tensor or None, "
            f"got {type(value).__name__}"
        )
    if arr.dtype.kind not in "biuf" and arr.size:
        raise SchemaError(
            f"slime Sample field {name!r} expects numbers in a rectangular nesting, got "
            f"{value!r:.80}; pad the rows or pass a tensor"
        )
    flat = np.asarray(arr, dtype=want).reshape(-1)
    with np.errstate(invalid="ignore"):
        exact = np.array_equal(flat, arr.reshape(-1), equal_nan=want.kind == "f")
    if not exact:
        raise SchemaError(
            f"slime Sample field {name!r} is kept as {want} values, got {arr.dtype} values "
            f"that do not fit; cast them to {want}"
        )
    return flat, [form, dtype, list(arr.shape)]


def _unflatten(values: np.ndarray, layout: list[Any] | None) -> Any:
    if layout is None:
        return None
    form, dtype, shape = layout
    values = values.reshape(shape)
    if form == "list":
        return values.tolist()
    if form == "ndarray":
        return values.astype(np.dtype(dtype))
    import torch

    return torch.from_numpy(values.copy()).to(getattr(torch, dtype))


# -- objects -------------------------------------------------------------------------------
_PLAIN = (str, int, float, bool, bytes, type(None))
_EXT_TUPLE, _EXT_NDARRAY, _EXT_NUMPY_SCALAR, _EXT_TENSOR, _EXT_IMAGE = 1, 2, 3, 4, 5
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def object_of_field(name: str, value: Any) -> Any:
    """A field's value as msgpack-encodable data; an ``Enum`` (``status``) as its value and a
    dataclass (``spec_info``) as its fields, rebuilt by :func:`field_of_object`."""
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    try:
        return to_object(value)
    except SchemaError as exc:
        raise SchemaError(f"slime Sample field {name!r}: {exc}") from None


def field_of_object(value: Any, field: dataclasses.Field) -> Any:
    """The inverse of :func:`object_of_field`, for the ``Sample`` field ``field``."""
    value = from_object(value)
    factory = field.default_factory
    if isinstance(value, dict) and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory(**value)
    if isinstance(field.default, Enum):
        return type(field.default)(value)
    return value


def to_object(value: Any) -> Any:
    """``value`` as msgpack-encodable data that :func:`from_object` turns back into it."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [to_object(v) for v in value]
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, _PLAIN)), None)
        if bad is not None:
            raise SchemaError(f"dict keys must be str, numbers, bool or None, got {bad!r:.60}")
        return {k: to_object(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return msgspec.msgpack.Ext(_EXT_TUPLE, _encode([to_object(v) for v in value]))
    if isinstance(value, np.ndarray | np.generic):
        return _array_ext(value)
    if _is_tensor(value):
        return _tensor_ext(value)
    if _is_image(value):
        palette = None
        if value.mode in ("P", "PA"):
            palette = [value.palette.mode, value.getpalette(value.palette.mode)]
        return msgspec.msgpack.Ext(
            _EXT_IMAGE, _encode([value.mode, list(value.size), value.tobytes(), palette])
        )
    raise SchemaError(
        f"a {type(value).__module__}.{type(value).__qualname__} cannot be kept losslessly; "
        "use dicts, lists, tuples, str, numbers, bool, None, bytes, numpy arrays, torch "
        "tensors or PIL images"
    )


def from_object(value: Any) -> Any:
    """The inverse of :func:`to_object`."""
    if isinstance(value, list):
        return [from_object(v) for v in value]
    if isinstance(value, dict):
        return {k: from_object(v) for k, v in value.items()}
    if not isinstance(value, msgspec.msgpack.Ext):
        return value
    parts = _decode(value.data)
    if value.code == _EXT_TUPLE:
        return tuple(from_object(v) for v in parts)
    if value.code in (_EXT_NDARRAY, _EXT_NUMPY_SCALAR):
        dtype, shape, raw = parts
        arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        return arr[()] if value.code == _EXT_NUMPY_SCALAR else arr
    if value.code == _EXT_TENSOR:
        import torch

        name, shape, raw = parts
        dtype = getattr(torch, name)
        if not raw:  # frombuffer refuses an empty buffer
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    from PIL import Image

    mode, size, raw, palette = parts
    image = Image.frombytes(mode, tuple(size), raw)
    if palette is not None:
        image.putpalette(palette[1], palette[0])
    return image


def _array_ext(value: np.ndarray | np.generic) -> msgspec.msgpack.Ext:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise SchemaError(f"numpy arrays must be numeric to be kept, got dtype {arr.dtype}")
    code = _EXT_NUMPY_SCALAR if isinstance(value, np.generic) else _EXT_NDARRAY
    return msgspec.msgpack.Ext(code, _encode([arr.dtype.str, list(arr.shape), arr.tobytes()]))


def _tensor_ext(value: Any) -> msgspec.msgpack.Ext:
    tensor = value.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.reshape(-1).view(sys.modules["torch"].uint8).numpy().tobytes()
    return msgspec.msgpack.Ext(_EXT_TENSOR, _encode([dtype, list(tensor.shape), raw]))


def _is_tensor(value: Any) -> bool:
    return type(value).__module__ == "torch" and hasattr(value, "detach")


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes")

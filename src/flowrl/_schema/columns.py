"""Column declarations: a name, a kind and (for numeric kinds) a dtype and shape.

Kinds and their Arrow storage:

=========  ==========================================  ===============================
kind       one sample is                               Arrow type
=========  ==========================================  ===============================
scalar     one number or bool                          primitive (int64, float32, ...)
tensor     a fixed-shape array, e.g. (4, 8)            ``fixed_shape_tensor`` extension
ragged     a 1-D sequence of any length (tokens, ...)  ``large_list<dtype>`` (values + offsets)
string     a str                                       ``large_string``
object     any msgpack-encodable Python value          ``large_binary`` (msgpack bytes)
=========  ==========================================  ===============================
"""

from __future__ import annotations

import functools
from typing import Literal, final

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._validate import is_int
from flowrl.errors import ConfigError

__all__ = ["Column", "ColumnKind"]

ColumnKind = Literal["scalar", "tensor", "ragged", "string", "object"]
_NUMERIC_KINDS = ("scalar", "tensor", "ragged")
_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)


@final
class Column(msgspec.Struct, frozen=True):
    """A declared column; build one with a classmethod, e.g. ``Column.ragged("ids", "int64")``."""

    name: str
    kind: ColumnKind
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(
                f"column name must be a Python identifier, got {self.name!r}; "
                "use letters, digits and underscores"
            )
        if self.kind not in ("scalar", "tensor", "ragged", "string", "object"):
            raise ConfigError(
                f"column {self.name!r}: kind must be scalar|tensor|ragged|string|object, "
                f"got {self.kind!r}"
            )
        if self.kind in _NUMERIC_KINDS:
            if self.dtype not in _DTYPES:
                raise ConfigError(
                    f"column {self.name!r}: dtype must be one of {', '.join(_DTYPES)}, "
                    f"got {self.dtype!r}"
                )
        elif self.dtype:
            raise ConfigError(f"column {self.name!r}: a {self.kind} column takes no dtype")
        if self.kind == "tensor":
            if not self.shape or any(not is_int(d) or d <= 0 for d in self.shape):
                raise ConfigError(
                    f"column {self.name!r}: a tensor column needs a shape of positive ints, "
                    f"got {self.shape!r}"
                )
        elif self.shape:
            raise ConfigError(f"column {self.name!r}: only tensor columns take a shape")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def scalar(cls, name: str, dtype: str) -> Column:
        return cls(name, "scalar", _dtype_name(dtype))

    @classmethod
    def tensor(cls, name: str, dtype: str, shape: tuple[int, ...]) -> Column:
        return cls(name, "tensor", _dtype_name(dtype), tuple(shape))

    @classmethod
    def ragged(cls, name: str, dtype: str) -> Column:
        return cls(name, "ragged", _dtype_name(dtype))

    @classmethod
    def string(cls, name: str) -> Column:
        return cls(name, "string")

    @classmethod
    def object(cls, name: str) -> Column:
        return cls(name, "object")

    # -- derived ----------------------------------------------------------------------------
    @property
    def np_dtype(self) -> np.dtype:
        return _NP_DTYPES.get(self.dtype) or np.dtype(self.dtype)

    @property
    def arrow_type(self) -> pa.DataType:
        return _arrow_type(self.kind, self.dtype, self.shape)

    @property
    def value_type(self) -> pa.DataType:
        """The Arrow type of one element: of the values of a ragged or tensor column."""
        return _arrow_type("scalar", self.dtype, ())

    def describe(self) -> str:
        if self.kind == "scalar":
            return f"{self.dtype} scalars"
        if self.kind == "tensor":
            return f"{self.dtype} tensors of shape {self.shape}"
        if self.kind == "ragged":
            return f"ragged {self.dtype} sequences"
        return f"{self.kind} values"


#: Each numeric dtype once (the data path asks on every message; np.dtype parses a name).
_NP_DTYPES = {name: np.dtype(name) for name in _DTYPES}


@functools.cache
def _arrow_type(kind: str, dtype: str, shape: tuple[int, ...]) -> pa.DataType:
    """Built once per distinct column type: the data path asks for it on every message."""
    if kind in ("string", "object"):
        return pa.large_string() if kind == "string" else pa.large_binary()
    value = pa.from_numpy_dtype(np.dtype(dtype))
    if kind == "tensor":
        return pa.fixed_shape_tensor(value, list(shape))
    return pa.large_list(value) if kind == "ragged" else value


def _dtype_name(dtype: object) -> str:
    """Accept 'float32', np.float32, np.dtype('float32') or torch.float32."""
    spec = dtype
    if str(dtype).startswith("torch."):
        spec = str(dtype).removeprefix("torch.")
    try:
        return np.dtype(spec).name  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}"
        ) from None

"""RaggedArray: a batch of 1-D sequences of different lengths, packed as values + offsets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, final

import numpy as np
import pyarrow as pa

from flowrl.errors import SchemaError

__all__ = ["RaggedArray", "arrow_ragged_parts"]


@final
class RaggedArray:
    """Packed sequences: ``values[cu_seqlens[i]:cu_seqlens[i+1]]`` is sequence ``i``.

    ``cu_seqlens`` is the int64 prefix sum of lengths starting at 0 (the layout flash-attn
    varlen kernels and Arrow list offsets both use), so packing costs nothing.
    """

    __slots__ = ("cu_seqlens", "values")

    def __init__(self, values: np.ndarray, cu_seqlens: np.ndarray) -> None:
        values = _as_numpy(values)
        cu_seqlens = _as_numpy(cu_seqlens)
        if values.ndim != 1:
            raise SchemaError(f"RaggedArray values must be 1-D, got shape {values.shape}")
        if cu_seqlens.ndim != 1 or cu_seqlens.size == 0 or cu_seqlens.dtype.kind not in "iu":
            raise SchemaError(
                "RaggedArray cu_seqlens must be a non-empty 1-D integer array starting at 0, "
                f"got dtype {cu_seqlens.dtype} shape {cu_seqlens.shape}"
            )
        cu_seqlens = cu_seqlens.astype(np.int64, copy=False)
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != values.size or np.any(np.diff(cu_seqlens) < 0):
            raise SchemaError(
                "RaggedArray cu_seqlens must start at 0, be non-decreasing and end at "
                f"len(values)={values.size}, got {cu_seqlens[:4]}...{cu_seqlens[-1:]}"
            )
        self.values = values
        self.cu_seqlens = cu_seqlens

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def _trusted(cls, values: np.ndarray, cu_seqlens: np.ndarray) -> RaggedArray:
        """Wrap arrays known to be valid (Arrow list offsets) without re-checking them."""
        self = cls.__new__(cls)
        self.values = values
        self.cu_seqlens = cu_seqlens
        return self

    @classmethod
    def from_list(cls, seqs: Sequence[Any], dtype: Any = None) -> RaggedArray:
        arrays = [_as_numpy(s) for s in seqs]
        if dtype is None and not arrays:
            dtype = np.int64
        for i, a in enumerate(arrays):
            if a.ndim != 1:
                raise SchemaError(f"sequence {i} must be 1-D, got shape {a.shape}")
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        cu = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        values = np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
        if dtype is not None:
            values = values.astype(dtype, copy=False)
        return cls(values, cu)

    @classmethod
    def from_padded(cls, padded: Any, lengths: Any) -> RaggedArray:
        """From a right-padded ``(B, L)`` array and per-row lengths."""
        padded = _as_numpy(padded)
        lengths = _as_numpy(lengths).astype(np.int64, copy=False)
        if padded.ndim != 2 or lengths.shape != (padded.shape[0],):
            raise SchemaError(
                f"from_padded expects a (B, L) array and B lengths, got {padded.shape} "
                f"and {lengths.shape}"
            )
        if np.any(lengths < 0) or np.any(lengths > padded.shape[1]):
            raise SchemaError(f"lengths must lie in [0, {padded.shape[1]}]")
        mask = np.arange(padded.shape[1]) < lengths[:, None]
        cu = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        return cls(padded[mask], cu)

    # -- views ----------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __len__(self) -> int:
        return self.cu_seqlens.size - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences")
        i %= n
        return self.values[self.cu_seqlens[i] : self.cu_seqlens[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        cu = self.cu_seqlens
        for i in range(len(self)):
            yield self.values[cu[i] : cu[i + 1]]

    def __repr__(self) -> str:
        return f"RaggedArray(n={len(self)}, dtype={self.values.dtype}, tokens={self.values.size})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RaggedArray):
            return NotImplemented
        return np.array_equal(self.cu_seqlens, other.cu_seqlens) and np.array_equal(
            self.values, other.values
        )

    __hash__ = None  # type: ignore[assignment]

    def tolist(self) -> list[list[Any]]:
        return [s.tolist() for s in self]

    def padded(
        self, pad_value: Any = 0, max_len: int | None = None, left: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(B, L)`` values and a boolean mask; right-padded unless ``left``."""
        lengths = self.lengths
        width = int(lengths.max(initial=0)) if max_len is None else max_len
        if max_len is not None and lengths.size and lengths.max() > max_len:
            raise SchemaError(f"max_len={max_len} is shorter than the longest sequence")
        cols = np.arange(width)
        mask = cols >= (width - lengths)[:, None] if left else cols < lengths[:, None]
        out = np.full((len(self), width), pad_value, dtype=self.values.dtype)
        out[mask] = self.values
        return out, mask

    def torch(self) -> tuple[Any, Any]:
        """``(values, cu_seqlens)`` as torch tensors sharing memory with this array."""
        import torch

        return torch.from_numpy(self.values), torch.from_numpy(self.cu_seqlens)


def arrow_ragged_parts(arr: pa.Array, dtype: np.dtype) -> tuple[np.ndarray, pa.Buffer | None, int]:
    """A (possibly sliced) ragged Arrow array's layout, without copying: its n+1 offsets
    (a view into its buffer, not rebased: they start at the slice's first value), the
    values' data buffer and where in it (in values) the slice's first value lies. The
    buffer is None where the values are bit-packed bools or absent: slice ``arr.values``."""
    buffers = arr.buffers()  # validity, offsets, values' validity, values' data
    offsets = np.frombuffer(buffers[1], dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8)
    if dtype.kind == "b" or buffers[3] is None:
        return offsets, None, 0
    return offsets, buffers[3], arr.values.offset + int(offsets[0])


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__ == "torch" and hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)

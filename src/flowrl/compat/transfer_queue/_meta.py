"""TransferQueue's metadata records: ``BatchMeta`` (low-level API) and ``KVBatchMeta`` (KV API).

``BatchMeta`` takes TransferQueue's constructor (a program may build one from global
indexes and read those samples with ``get_data``) and has its methods. What ``get_meta``
and ``put`` return carry, besides, the handle of the flowrl claim (or put) they came from,
so ``get_data`` reads the samples without asking the hub where they are; a ``BatchMeta``
built by hand is located on first read.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import numpy as np

from flowrl._controller.meta import BatchMeta as HubMeta
from flowrl._schema.columns import Column
from flowrl.errors import ConfigError

__all__ = ["BatchMeta", "KVBatchMeta", "field_schema_of"]

_PRODUCED = 1


@final
class BatchMeta:
    """Which samples (``global_indexes``), of which partitions, with which fields.

    As TransferQueue's: ``field_schema`` maps each field to ``dtype``, ``shape``,
    ``is_nested`` and ``is_non_tensor``; ``production_status`` holds 1 per produced sample;
    ``custom_meta`` one dict per sample (fetched from the key directory on first use when
    the batch came from ``get_meta``), which ``put`` or ``set_custom_meta`` stores;
    ``extra_info`` batch-level values.
    """

    __slots__ = (
        "_custom",
        "_custom_backend_meta",
        "_fetch",
        "_handle",
        "extra_info",
        "field_schema",
        "global_indexes",
        "partition_ids",
        "production_status",
    )

    def __init__(
        self,
        global_indexes: Sequence[int],
        partition_ids: Sequence[str],
        field_schema: Mapping[str, Mapping[str, Any]] | None = None,
        production_status: Any = None,
        extra_info: Mapping[str, Any] | None = None,
        custom_meta: Sequence[Mapping[str, Any]] | None = None,
        _custom_backend_meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise ConfigError(
                f"BatchMeta: {n} global_indexes but {len(self.partition_ids)} partition_ids"
            )
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ConfigError(
                    f"BatchMeta: field {name!r} has {len(shapes)} per_sample_shapes for {n} samples"
                )
        status = np.zeros(n, np.int8) if production_status is None else production_status
        self.production_status = np.array(status, dtype=np.int8, copy=True)
        if self.production_status.shape != (n,):
            raise ConfigError(
                f"BatchMeta: production_status must have {n} entries, got shape "
                f"{self.production_status.shape}"
            )
        self.extra_info = dict(extra_info or {})
        self._custom: list[dict[str, Any]] | None = None
        if custom_meta:
            self._custom = _per_sample(custom_meta, n, "custom_meta")
        self._custom_backend_meta: list[dict[str, Any]] | None = None
        if _custom_backend_meta:
            self._custom_backend_meta = _per_sample(_custom_backend_meta, n, "backend")
        self._handle: HubMeta | None = None
        self._fetch: Callable[[list[int]], list[dict[str, Any]]] | None = None

    @classmethod
    def _of(
        cls,
        handle: HubMeta,
        partition_ids: Sequence[str],
        field_schema: dict[str, dict[str, Any]],
        *,
        produced: bool,
        custom_meta: list[dict[str, Any]] | None = None,
        fetch_custom: Callable[[list[int]], list[dict[str, Any]]] | None = None,
        extra_info: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """The record of a flowrl claim or put (its handle kept for ``get_data``), made
        without ``__init__``'s checks: every get_meta and put makes one."""
        meta = cls.__new__(cls)
        meta.global_indexes = handle.indices.tolist()
        meta.partition_ids = list(partition_ids)
        meta.field_schema = field_schema
        meta.production_status = np.full(len(handle), _PRODUCED if produced else 0, np.int8)
        meta.extra_info = dict(extra_info or {})
        meta._custom_backend_meta = None  # made on first use
        meta._handle, meta._custom, meta._fetch = handle, custom_meta, fetch_custom
        return meta

    # -- sizes and fields ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        """Every sample's fields were produced (true of whatever ``get_meta`` returns)."""
        return self.size > 0 and bool((self.production_status == _PRODUCED).all())

    def get_dtypes(self, field_name: str) -> list[Any]:
        return [self._schema(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        meta = self._schema(field_name)
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    def _schema(self, field_name: str) -> dict[str, Any]:
        if field_name not in self.field_schema:
            raise KeyError(f"field {field_name!r} is not in this batch's {self.field_names}")
        return self.field_schema[field_name]

    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> BatchMeta:
        """Record the fields of ``tensor_dict`` (one row per sample) in place."""
        n = int(tensor_dict.batch_size[0])
        if n == 0:
            return self
        if n != self.size:
            raise ConfigError(f"add_fields: the TensorDict has {n} rows, this batch {self.size}")
        self.field_schema.update(_schema_of_tensordict(tensor_dict))
        if set_all_ready:
            self.production_status[:] = _PRODUCED
        return self

    # -- extra_info (batch level) and custom_meta (per sample) --------------------------------
    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: Mapping[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        if self._custom is None:
            fetched = self._fetch(self.global_indexes) if self._fetch and self.size else None
            self._custom = fetched if fetched is not None else [{} for _ in range(self.size)]
        return self._custom

    @custom_meta.setter
    def custom_meta(self, value: Sequence[Mapping[str, Any]]) -> None:
        self._custom = _per_sample(value, self.size, "custom_meta")

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        """Merge one dict per sample into the samples' custom metadata."""
        if custom_meta is None:
            return
        if not isinstance(custom_meta, list) or len(custom_meta) != self.size:
            raise ConfigError(
                f"update_custom_meta expects a list of {self.size} dicts (one per sample), "
                f"got {type(custom_meta).__name__} of length {_length(custom_meta)}"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            if not isinstance(new, dict):
                raise ConfigError(f"update_custom_meta: each entry must be a dict, got {new!r}")
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self._custom = [{} for _ in range(self.size)]

    # -- selecting, splitting, joining -----------------------------------------------------
    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        positions = [int(i) for i in sample_indices]
        if any(not 0 <= i < self.size for i in positions):
            raise ConfigError(f"select_samples: positions must be in [0, {self.size}), got "
                              f"{positions!r:.200}")  # fmt: skip
        return self._rows(positions)

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """This batch with only the named fields (names it does not have are left out)."""
        out = self._rows(list(range(self.size)))
        out.field_schema = {f: out.field_schema[f] for f in field_names if f in out.field_schema}
        return out

    def copy(self) -> BatchMeta:
        return self._rows(list(range(self.size)))

    def __getitem__(self, item: int | slice) -> BatchMeta:
        if isinstance(item, int | np.integer):
            position = int(item) + self.size if item < 0 else int(item)
            if not 0 <= position < self.size:
                raise IndexError(f"BatchMeta index {item} out of range for size {self.size}")
            return self._rows([position])
        if isinstance(item, slice):
            return self._rows(list(range(*item.indices(self.size))))
        raise TypeError(f"BatchMeta indices are ints or slices, got {type(item).__name__}")

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` parts of sizes differing by at most one (larger first)."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"chunk() expects a positive int, got {chunks!r}")
        return [self._rows(p.tolist()) for p in np.array_split(np.arange(self.size), chunks)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One part per partition, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, partition in enumerate(self.partition_ids):
            groups.setdefault(partition, []).append(i)
        return [self._rows(positions) for positions in groups.values()]

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in the order of ``indices`` (a permutation), in place."""
        order = [int(i) for i in indices]
        if sorted(order) != list(range(self.size)):
            raise ConfigError(f"reorder expects a permutation of range({self.size}), got "
                              f"{order!r:.200}")  # fmt: skip
        moved = self._rows(order)
        for slot in self.__slots__:
            setattr(self, slot, getattr(moved, slot))

    def union(self, other: BatchMeta) -> BatchMeta:
        """The same samples with the fields of both (``other``'s win on a name clash)."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes or self.partition_ids != other.partition_ids:
            raise ConfigError(
                "BatchMeta.union: both batches must name the same samples in the same order "
                f"(global_indexes {self.global_indexes[:8]}... vs {other.global_indexes[:8]}...)"
            )
        out = self.copy()
        out.field_schema.update(copy.deepcopy(other.field_schema))
        out.production_status = np.bitwise_and(self.production_status, other.production_status)
        out.extra_info.update(other.extra_info)
        out._custom = [{**a, **b} for a, b in zip(out.custom_meta, other.custom_meta, strict=True)]
        return out

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of the samples of ``data`` in order (empty parts are skipped)."""
        parts = [d for d in data if d and d.size]
        if not parts:
            return cls.empty()
        first = parts[0]
        if validate:
            for i, part in enumerate(parts):
                if part.field_names != first.field_names:
                    raise ConfigError(
                        f"BatchMeta.concat: part {i} has fields {part.field_names}, part 0 has "
                        f"{first.field_names}"
                    )
        extra: dict[str, Any] = {}
        for part in parts:
            for key, value in part.extra_info.items():
                if key in extra and not _same(extra[key], value):
                    raise ConfigError(
                        f"BatchMeta.concat: extra_info {key!r} differs between parts "
                        f"({extra[key]!r} vs {value!r})"
                    )
                extra.setdefault(key, value)
        return cls(
            list(itertools.chain.from_iterable(p.global_indexes for p in parts)),
            list(itertools.chain.from_iterable(p.partition_ids for p in parts)),
            _concat_schemas(parts),
            np.concatenate([p.production_status for p in parts]),
            extra,
            [c for p in parts for c in p.custom_meta],
            [c for p in parts for c in p._backend_meta()],
        )

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> BatchMeta:
        return cls([], [], extra_info=extra_info)

    def _backend_meta(self) -> list[dict[str, Any]]:
        """Per-sample storage metadata (TransferQueue's ``_custom_backend_meta``; empty
        dicts here, kept for the batches a program builds and concatenates)."""
        if self._custom_backend_meta is None:
            self._custom_backend_meta = [{} for _ in range(self.size)]
        return self._custom_backend_meta

    def _rows(self, positions: list[int]) -> BatchMeta:
        """A copy holding the samples at ``positions`` (their handle too, if any)."""
        schema = {}
        for name, meta in self.field_schema.items():
            meta = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in positions]
            schema[name] = meta
        out = BatchMeta(
            [self.global_indexes[i] for i in positions],
            [self.partition_ids[i] for i in positions],
            schema,
            self.production_status[positions],
            copy.deepcopy(self.extra_info),
            None,
            None
            if self._custom_backend_meta is None
            else [copy.deepcopy(self._custom_backend_meta[i]) for i in positions],
        )
        if self._custom is not None:
            out._custom = [copy.deepcopy(self._custom[i]) for i in positions]
        if self._handle is not None:
            out._handle = self._handle.subset(np.asarray(positions, dtype=np.int64))
        out._fetch = self._fetch
        return out

    def __getstate__(self) -> tuple[Any, ...]:
        """Pickled (a DataLoader worker hands batches to its parent) without the client."""
        return tuple(getattr(self, slot) for slot in self.__slots__ if slot != "_fetch")

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for slot, value in zip([s for s in self.__slots__ if s != "_fetch"], state, strict=True):
            setattr(self, slot, value)
        self._fetch = _custom_meta_here

    def __repr__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, partitions={sorted(set(self.partition_ids))})"
        )


def field_schema_of(columns: Mapping[str, Column], names: Sequence[str]) -> dict[str, Any]:
    """TransferQueue's ``field_schema`` of hub columns: a field's dtype (torch's), its shape
    past the batch dimension when fixed, whether it comes back nested or non-tensor."""
    return {name: dict(_field_meta(columns[name])) for name in names}


@functools.lru_cache(maxsize=1024)
def _field_meta(column: Column) -> dict[str, Any]:
    import torch

    tensor = column.kind in ("scalar", "ragged", "tensor")
    return {
        "dtype": getattr(torch, column.dtype) if tensor else None,
        "shape": tuple(column.shape) if column.kind == "tensor" else None,
        "is_nested": column.kind in ("ragged", "tensor"),
        "is_non_tensor": not tensor,
    }


def _schema_of_tensordict(td: Any) -> dict[str, Any]:
    import torch

    schema: dict[str, Any] = {}
    for name, value in td.items():
        tensor = isinstance(value, torch.Tensor)
        nested = tensor and value.is_nested
        rows = value.unbind(0) if nested else None
        schema[name] = {
            "dtype": value.dtype if tensor else None,
            "shape": None if nested or not tensor else tuple(value.shape[1:]),
            "is_nested": nested,
            "is_non_tensor": not tensor,
        }
        if rows is not None:
            schema[name]["per_sample_shapes"] = [tuple(r.shape) for r in rows]
    return schema


def _concat_schemas(parts: Sequence[BatchMeta]) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for name, meta in parts[0].field_schema.items():
        metas = [p.field_schema.get(name, {}) for p in parts]
        nested = any(m.get("is_nested", False) for m in metas)
        schema[name] = {**copy.deepcopy(meta), "is_nested": nested}
        if nested or any(m.get("per_sample_shapes") for m in metas):
            schema[name]["shape"] = None if nested else meta.get("shape")
            schema[name]["per_sample_shapes"] = [
                shape
                for m, p in zip(metas, parts, strict=True)
                for shape in (m.get("per_sample_shapes") or [m.get("shape")] * p.size)
            ]
    return schema


def _per_sample(values: Sequence[Mapping[str, Any]], n: int, what: str) -> list[dict[str, Any]]:
    if len(values) != n:
        raise ConfigError(f"BatchMeta: {what} must have one dict per sample ({n}), got "
                          f"{len(values)}")  # fmt: skip
    return [dict(v) for v in values]


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    if hasattr(a, "equal") and hasattr(a, "dtype"):  # a torch tensor
        return bool(a.equal(b))
    try:
        return bool(a == b)
    except Exception:
        return False


@dataclasses.dataclass
class KVBatchMeta:
    """Keys, their tags, their partition and the fields they all have (the KV API's handle)."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ConfigError(
                f"KVBatchMeta: keys and tags must have the same length, got {len(self.keys)} "
                f"and {len(self.tags)}"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError("KVBatchMeta: duplicated keys")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise ConfigError("KVBatchMeta: duplicated fields")
        # (an empty tag, the usual case, copied without deepcopy's machinery per item)
        self.tags = [{} if type(t) is dict and not t else copy.deepcopy(t) for t in self.tags]
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        position = {k: i for i, k in enumerate(self.keys)}
        unknown = [k for k in keys_to_select if k not in position]
        if unknown:
            raise ConfigError(f"select_keys: keys {unknown} are not in this batch")
        return self._with([position[k] for k in keys_to_select])

    def reorder(self, indexes: list[int]) -> None:
        """Reorder the samples in place."""
        if sorted(indexes) != list(range(self.size)):
            raise ConfigError(
                f"reorder expects a permutation of range({self.size}), got {indexes!r}"
            )
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        if not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"chunk() expects a positive int, got {chunks!r}")
        return [self._with(p.tolist()) for p in np.array_split(np.arange(self.size), chunks)]

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        parts = [d for d in data if d.size]
        if not parts:
            return cls()
        first = parts[0]
        for d in parts[1:]:
            if (
                set(d.fields or ()) != set(first.fields or ())
                or d.partition_id != first.partition_id
            ):
                raise ConfigError(
                    "KVBatchMeta.concat: every part must have the same fields and partition_id"
                )
        return cls(
            keys=[k for d in parts for k in d.keys],
            tags=[t for d in parts for t in d.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=first.extra_info,
        )

    def _with(self, positions: list[int]) -> KVBatchMeta:
        return KVBatchMeta(
            keys=[self.keys[i] for i in positions],
            tags=[self.tags[i] for i in positions],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )


def _custom_meta_here(indices: list[int]) -> list[dict[str, Any]]:
    """custom_meta of samples through this process's client (of an unpickled BatchMeta)."""
    from flowrl.compat.transfer_queue._api import get_client

    return get_client().directory.describe(indices)[0]


def _length(value: Any) -> int | str:
    try:
        return len(value)
    except TypeError:
        return "n/a"

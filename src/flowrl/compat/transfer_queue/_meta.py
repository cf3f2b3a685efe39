"""TransferQueue's metadata records: ``BatchMeta`` (low-level API) and ``KVBatchMeta`` (KV API).

A ``BatchMeta`` here wraps the handle of a flowrl claim (or of samples just put) with what
TransferQueue's carries besides: the partition of each sample, the fields, per-sample
``custom_meta`` and batch-level ``extra_info``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np

from flowrl._controller.meta import BatchMeta as HubMeta
from flowrl.errors import ConfigError

__all__ = ["BatchMeta", "KVBatchMeta"]


@final
class BatchMeta:
    """Which samples (``global_indexes``), of which partition, with which fields.

    ``custom_meta`` (one dict per sample) is fetched from the key directory on first use;
    ``update_custom_meta`` changes the local copy, which ``put`` or ``set_custom_meta``
    stores.
    """

    __slots__ = ("_custom", "_fetch", "_fields", "extra_info", "handle", "partition_ids")

    def __init__(
        self,
        handle: HubMeta,
        partition_ids: Sequence[str],
        fields: Sequence[str],
        *,
        custom_meta: list[dict[str, Any]] | None = None,
        fetch_custom: Callable[[list[int]], list[dict[str, Any]]] | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> None:
        self.handle = handle
        self.partition_ids = list(partition_ids)
        self._fields = sorted(fields)
        self._custom = custom_meta
        self._fetch = fetch_custom
        self.extra_info = dict(extra_info or {})

    @property
    def global_indexes(self) -> list[int]:
        return self.handle.indices.tolist()

    @property
    def size(self) -> int:
        return len(self.handle)

    def __len__(self) -> int:
        return len(self.handle)

    @property
    def field_names(self) -> list[str]:
        return list(self._fields)

    @property
    def is_ready(self) -> bool:
        """Every sample's fields were produced (true of whatever ``get_meta`` returns)."""
        return len(self.handle) > 0

    @property
    def production_status(self) -> np.ndarray:
        return np.full(len(self.handle), int(self.is_ready), dtype=np.int8)

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        if self._custom is None:
            fetched = self._fetch(self.global_indexes) if self._fetch and len(self) else None
            self._custom = fetched if fetched is not None else [{} for _ in range(len(self))]
        return self._custom

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]]) -> None:
        """Merge one dict per sample into the samples' custom metadata."""
        if not isinstance(custom_meta, list) or len(custom_meta) != len(self):
            raise ConfigError(
                f"update_custom_meta expects a list of {len(self)} dicts (one per sample), "
                f"got {type(custom_meta).__name__} of length {_length(custom_meta)}"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            if not isinstance(new, dict):
                raise ConfigError(f"update_custom_meta: each entry must be a dict, got {new!r}")
            mine.update(new)

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        missing = [f for f in field_names if f not in self._fields]
        if missing:
            raise ConfigError(f"select_fields: {missing} not in this batch's fields {self._fields}")
        return self._with(np.arange(len(self)), field_names)

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        return self._with(np.asarray(sample_indices, dtype=np.int64), self._fields)

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` parts of sizes differing by at most one (TransferQueue's)."""
        if not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"chunk() expects a positive int, got {chunks!r}")
        return [
            self._with(part, self._fields) for part in np.array_split(np.arange(len(self)), chunks)
        ]

    def _with(self, positions: np.ndarray, fields: Sequence[str]) -> BatchMeta:
        custom = None if self._custom is None else [self._custom[i] for i in positions]
        return BatchMeta(
            self.handle.subset(positions),
            [self.partition_ids[i] for i in positions],
            fields,
            custom_meta=custom,
            fetch_custom=self._fetch,
            extra_info=self.extra_info,
        )

    def __getstate__(self) -> tuple[Any, ...]:
        """Pickled (a DataLoader worker hands batches to its parent) without the client."""
        return (self.handle, self.partition_ids, self._fields, self._custom, self.extra_info)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.handle, self.partition_ids, self._fields, self._custom, self.extra_info = state
        self._fetch = _custom_meta_here

    def __repr__(self) -> str:
        return (
            f"BatchMeta(size={len(self)}, field_names={self._fields}, "
            f"partitions={sorted(set(self.partition_ids))})"
        )


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
        self.tags = copy.deepcopy(self.tags)
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

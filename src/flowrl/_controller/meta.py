"""BatchMeta: the handle a claim returns. Metadata only, never payload bytes."""

from __future__ import annotations

from typing import final

import msgspec
import numpy as np

__all__ = ["BatchMeta", "WireMeta"]


@final
class BatchMeta:
    """Which samples a claim leased, where their bytes live and how big they are.

    ``lease`` is 0 for a handle that was not claimed (``hub.meta(indices)``); such a handle
    can be read but not acked. Arrays are int64 (``units`` int16) and aligned with
    ``indices``.
    """

    __slots__ = (
        "columns",
        "deadline",
        "dp_rank",
        "groups",
        "indices",
        "lease",
        "nbytes",
        "task",
        "tokens",
        "units",
        "versions",
    )

    def __init__(
        self,
        *,
        task: str,
        lease: int,
        columns: tuple[str, ...],
        indices: np.ndarray,
        units: np.ndarray,
        tokens: np.ndarray,
        versions: np.ndarray,
        groups: np.ndarray,
        nbytes: int,
        deadline: float,
        dp_rank: int = 0,
    ) -> None:
        self.task = task
        self.lease = lease
        self.columns = columns
        self.indices = indices
        self.units = units
        self.tokens = tokens
        self.versions = versions
        self.groups = groups
        self.nbytes = nbytes
        self.deadline = deadline
        self.dp_rank = dp_rank

    def __len__(self) -> int:
        return int(self.indices.size)

    def __repr__(self) -> str:
        return (
            f"BatchMeta(task={self.task!r}, lease={self.lease}, n={len(self)}, "
            f"columns={list(self.columns)}, nbytes={self.nbytes})"
        )

    def subset(self, positions: np.ndarray) -> BatchMeta:
        """The handle restricted to some of its samples (same lease): for partial ack/put.

        ``nbytes`` is kept as an upper bound (per-sample sizes are not carried).
        """
        pos = np.asarray(positions)
        return BatchMeta(
            task=self.task,
            lease=self.lease,
            columns=self.columns,
            indices=self.indices[pos],
            units=self.units[pos],
            tokens=self.tokens[pos],
            versions=self.versions[pos],
            groups=self.groups[pos],
            nbytes=self.nbytes,
            deadline=self.deadline,
            dp_rank=self.dp_rank,
        )

    def to_wire(self) -> WireMeta:
        return WireMeta(
            task=self.task,
            lease=self.lease,
            columns=self.columns,
            indices=self.indices.tobytes(),
            units=self.units.tobytes(),
            tokens=self.tokens.tobytes(),
            versions=self.versions.tobytes(),
            groups=self.groups.tobytes(),
            nbytes=self.nbytes,
            deadline=self.deadline,
            dp_rank=self.dp_rank,
        )

    @classmethod
    def from_wire(cls, w: WireMeta) -> BatchMeta:
        return cls(
            task=w.task,
            lease=w.lease,
            columns=tuple(w.columns),
            indices=np.frombuffer(w.indices, dtype=np.int64),
            units=np.frombuffer(w.units, dtype=np.int16),
            tokens=np.frombuffer(w.tokens, dtype=np.int64),
            versions=np.frombuffer(w.versions, dtype=np.int64),
            groups=np.frombuffer(w.groups, dtype=np.int64),
            nbytes=w.nbytes,
            deadline=w.deadline,
            dp_rank=w.dp_rank,
        )


class WireMeta(msgspec.Struct, frozen=True):
    """BatchMeta on the wire: arrays as raw little-endian bytes."""

    task: str
    lease: int
    columns: tuple[str, ...]
    indices: bytes
    units: bytes
    tokens: bytes
    versions: bytes
    groups: bytes
    nbytes: int
    deadline: float
    dp_rank: int = 0

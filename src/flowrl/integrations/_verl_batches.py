"""DataProtoLoader: verl batches that never trip "only support equal chunk".

verl splits a ``DataProto`` over data-parallel workers with ``chunk(dp_size)``, which
raises unless the batch size is a multiple of ``dp_size``; GRPO needs whole groups. Every
DataProto this loader yields holds whole groups (a :class:`~flowrl.GroupSampler` claim)
and a multiple of ``dp_size`` samples. Invariants, asserted by the tests:

* no batch holds part of a group;
* ``len(dp) % dp_size == 0`` for every batch;
* only the last batch of a stream may be shorter than ``groups_per_batch`` groups; groups
  it cannot fit evenly are left out, acked (never delivered again) and counted in
  ``statistics().trimmed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, final

import msgspec
import numpy as np

from flowrl._client.base import HubClient
from flowrl._pipeline.loader import Loader
from flowrl._validate import is_int
from flowrl.errors import ConfigError
from flowrl.integrations._dataproto import to_dataproto
from flowrl.integrations._verl_compat import require_verl

__all__ = ["DataProtoLoader", "DataProtoLoaderStats"]


@final
class DataProtoLoaderStats(msgspec.Struct, frozen=True, kw_only=True):
    """Batches and samples yielded; ``trimmed``: samples of a stream's tail left out."""

    batches: int
    samples: int
    trimmed: int


@final
class DataProtoLoader:
    """Iterate ``task`` as verl DataProtos of ``groups_per_batch`` whole GRPO groups.

    ``group_size``: samples per group (verl's ``rollout.n``; put them with ``groups=``).
    ``dp_size``: the data-parallel world the batch is chunked over. ``to_dataproto``:
    keyword arguments for :func:`to_dataproto` (``layout``, ``prompt_length``, ...).
    Other keywords go to the underlying :class:`~flowrl.Loader` (``max_staleness``,
    ``timeout``, ``ack``, ``lease_timeout``); ``loader.ack()`` and checkpoints work as there.
    """

    def __init__(
        self,
        hub: HubClient,
        *,
        task: str,
        columns: Sequence[str],
        groups_per_batch: int,
        group_size: int,
        dp_size: int = 1,
        to_dataproto: dict[str, Any] | None = None,
        **loader_options: Any,
    ) -> None:
        require_verl()
        for name, value in (
            ("groups_per_batch", groups_per_batch),
            ("group_size", group_size),
            ("dp_size", dp_size),
        ):
            if not is_int(value) or value < 1:
                raise ConfigError(f"DataProtoLoader {name} must be a positive int, got {value!r}")
        # groups per evenly divisible step: the fewest whole groups whose size dp_size divides
        self.step_groups = dp_size // math.gcd(group_size, dp_size)
        if groups_per_batch % self.step_groups:
            raise ConfigError(
                f"DataProtoLoader: {groups_per_batch} groups of {group_size} samples "
                f"({groups_per_batch * group_size}) cannot be split evenly over "
                f"dp_size={dp_size}; use a multiple of {self.step_groups} groups per batch"
            )
        self.group_size = group_size
        self.dp_size = dp_size
        self.options = dict(to_dataproto or {})
        self.loader = Loader(
            hub,
            task=task,
            columns=columns,
            batch_size=groups_per_batch * group_size,
            groups=group_size,
            **loader_options,
        )
        self._batches = self._samples = self._trimmed = 0

    def __iter__(self) -> DataProtoLoader:
        return self

    def __next__(self) -> Any:
        while True:
            batch = next(self.loader)
            keep = _whole_groups(batch.meta.groups, self.step_groups * self.group_size)
            self._trimmed += len(batch) - keep.size
            if keep.size:
                break
        if keep.size < len(batch):
            batch = self.loader.hub.get(batch.meta.subset(keep), self.loader.columns)
        self._batches += 1
        self._samples += len(batch)
        return to_dataproto(batch, **self.options)

    def ack(self) -> None:
        self.loader.ack()

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> DataProtoLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loader.__exit__(*exc)

    def statistics(self) -> DataProtoLoaderStats:
        return DataProtoLoaderStats(
            batches=self._batches, samples=self._samples, trimmed=self._trimmed
        )


def _whole_groups(groups: np.ndarray, step: int) -> np.ndarray:
    """Positions of the longest run of whole groups (in order of first appearance) whose
    size is a multiple of ``step``; a GroupSampler claim holds whole groups only."""
    uniq, first, counts = np.unique(groups, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    fits = np.flatnonzero(np.cumsum(counts[order]) % step == 0)
    if fits.size == 0:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(np.isin(groups, uniq[order[: fits[-1] + 1]]))

"""The embedded hub: controller and storage units in this process, no servers, no copies.

``Hub`` builds them (recovering from a journal when configured) and plugs the in-process
ports (``flowrl._client.local``) into the client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import final

import numpy as np

from flowrl._client.base import HubClient, _split_by_unit
from flowrl._client.local import LocalControl, LocalData
from flowrl._client.tasks import checked_tasks
from flowrl._config import HubConfig
from flowrl._controller.controller import Controller
from flowrl._controller.journal import attach_journal, lock_journal
from flowrl._schema.columns import Column
from flowrl._schema.schema import Schema
from flowrl._store.unit import StorageUnit
from flowrl.errors import ConfigError

__all__ = ["Hub"]


@final
class Hub(HubClient):
    """The in-process data hub (the default placement).

    >>> hub = Hub(columns=[Column.ragged("ids", "int64"), Column.scalar("reward", "float32")])
    >>> hub.register_task("train", ["ids", "reward"])
    """

    def __init__(
        self,
        columns: Iterable[Column] = (),
        *,
        tasks: Mapping[str, Sequence[str]] | None = None,
        config: HubConfig | None = None,
    ) -> None:
        config = HubConfig() if config is None else config
        if not isinstance(config, HubConfig):
            raise ConfigError(f"config must be a HubConfig, got {type(config).__name__}")
        columns = tuple(columns)
        tasks = checked_tasks(tasks, columns, config)
        infer = config.infer_columns if config.infer_columns is not None else not columns
        self.config = config
        self.schema = Schema(columns, infer=infer)
        self.controller = Controller(config.capacity, config.n_units, config.lease_timeout)
        # The journal folder is taken before anything in it (the units' files) is read.
        lock = None if config.journal is None else lock_journal(config.journal)
        try:
            self.units = [
                StorageUnit.open(u, config.capacity, config.journal) for u in range(config.n_units)
            ]
            self._journal = None if lock is None else attach_journal(self.controller, config, lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self.schema.declare(*self.controller.declared.values())
        if self._journal is not None:
            live = self.controller.live_indices()
            for unit in self.units:
                unit.retain(live, self.controller.table.next_index)
            # The holders of recovered leases died with the process that embedded the hub.
            with self.controller.cond:
                self.controller.expire(now=math.inf)
        self.controller.on_evict = self._evict
        self.controller.add_columns(self.schema.columns())
        self._control = LocalControl(self.controller, self.schema, self.units, self._journal)
        self._data = LocalData(self.units, self._control.check_open, self._control.commit)
        with self.controller.cond:
            self.controller.register_opening_tasks(tasks)

    def _evict(self, indices: np.ndarray, units: np.ndarray) -> None:
        for unit, pos in _split_by_unit(units):
            self.units[unit].evict(indices if pos is None else indices[pos])

    def _abandon(self) -> None:
        """Let go of the hub as its process would by dying (``flowrl.testing.abandon``)."""
        self._closed = True
        with self.controller.cond:
            self.controller.close()
        if self._journal is not None:
            self._journal.abandon()
        for unit in self.units:
            unit.abandon()

"""Typed configuration and statistics records of the hub."""

from __future__ import annotations

from typing import final

import msgspec

from flowrl._validate import is_int
from flowrl.errors import ConfigError

__all__ = ["HubConfig", "HubStats", "TaskStats", "UnitStats"]


@final
class HubConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How big the hub is and how long leases last. Validated at construction.

    ``capacity``: live samples at most (puts block, or ``put_nowait`` raises, beyond it).
    ``n_units``: storage units samples are sharded across.
    ``lease_timeout``: seconds a claim may stay un-acked before its samples return.
    ``infer_columns``: declare unknown columns from their first write (default: only when
    the hub was created without declared columns).
    """

    capacity: int = 65536
    n_units: int = 1
    lease_timeout: float = 300.0
    infer_columns: bool | None = None

    def __post_init__(self) -> None:
        if not is_int(self.capacity) or self.capacity < 1:
            raise ConfigError(f"HubConfig.capacity must be a positive int, got {self.capacity!r}")
        if not is_int(self.n_units) or not 1 <= self.n_units <= 1024:
            raise ConfigError(
                f"HubConfig.n_units must be an int in [1, 1024], got {self.n_units!r}"
            )
        if (
            isinstance(self.lease_timeout, bool)
            or not isinstance(self.lease_timeout, int | float)
            or not self.lease_timeout > 0
        ):
            raise ConfigError(
                f"HubConfig.lease_timeout must be a positive number of seconds, got "
                f"{self.lease_timeout!r}"
            )
        if self.infer_columns is not None and not isinstance(self.infer_columns, bool):
            raise ConfigError(
                f"HubConfig.infer_columns must be True, False or None, got {self.infer_columns!r}"
            )


class TaskStats(msgspec.Struct, frozen=True):
    ready: int
    leased: int
    consumed: int


class UnitStats(msgspec.Struct, frozen=True):
    unit: int
    samples: int
    chunks: int
    nbytes: int


@final
class HubStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the hub's counters (``hub.statistics()``)."""

    capacity: int
    live: int
    reserved: int
    tasks: dict[str, TaskStats]
    leases: int
    version: int
    ended: bool
    events: int
    units: list[UnitStats]

"""Specs of the server processes, passed as JSON on their stdin (a hub key must not show
on a command line, which every user of the machine may read)."""

from __future__ import annotations

import msgspec

from flowrl._config import HubConfig, JournalConfig
from flowrl._schema.columns import Column

__all__ = ["ControllerSpec", "ServerSpec", "UnitSpec"]


class ControllerSpec(msgspec.Struct, frozen=True, tag="controller"):
    address: str
    events_address: str
    unit_addresses: list[str]
    unit_control_addresses: list[str]
    columns: list[Column]
    tasks: dict[str, list[str]]
    config: HubConfig
    restarted: bool = False  # a supervisor restart: clients survived, keep their leases
    key: str | None = None  # the hub key's text: TCP sockets admit only its holders


class UnitSpec(msgspec.Struct, frozen=True, tag="unit"):
    unit_id: int
    capacity: int
    address: str
    control_address: str
    journal: JournalConfig | None = None
    shm_folder: str | None = None  # the unit's shared-memory arena (same-machine readers)
    key: str | None = None  # the hub key's text: TCP sockets admit only its holders


ServerSpec = ControllerSpec | UnitSpec

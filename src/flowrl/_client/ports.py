"""The two ports a :class:`~flowrl._client.base.HubClient` talks through.

``ControlPort``: commands to the controller (metadata only). ``DataPort``: payload bytes
to and from the storage units. Each has an in-process implementation
(``flowrl._client.local``: the controller and units in this process) and a zmq one
(``flowrl._transport.remote_control`` and ``remote_data``). Ports receive validated
input: the client checks every argument first, so a port never sees bad input.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from flowrl._client.batch import LazyColumn
from flowrl._client.future import PutFuture
from flowrl._config import HubStats, UnitStats
from flowrl._controller.eventlog import EventLog
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import Sampler
from flowrl._protocol.commands import (
    Ack,
    CheckUpdate,
    Claim,
    Commit,
    EndStream,
    MetaOf,
    PublishVersion,
    RegisterTask,
    Release,
    UnregisterTask,
)
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded

__all__ = ["ControlPort", "DataPort", "Reservation"]


class Reservation(NamedTuple):
    """Fresh indices for a put, all on storage unit ``unit``. ``pooled``: reserved ahead
    earlier; the controller may have let them go since (the put is then made again)."""

    indices: np.ndarray
    unit: int
    pooled: bool = False


class ControlPort(abc.ABC):
    """Commands to the controller. Blocking ones (reserve, claim) wait up to their timeout."""

    #: Whether a put to existing samples may go straight to the single storage unit a
    #: claim's handle names, the commit checking what ``check_update`` would have.
    trusts_handles = False

    @abc.abstractmethod
    def declare(self, columns: tuple[Column, ...]) -> None:
        """Declare columns to the controller, then to the client's schema."""

    @abc.abstractmethod
    def register_task(self, cmd: RegisterTask) -> None: ...

    @abc.abstractmethod
    def unregister_task(self, cmd: UnregisterTask) -> None: ...

    @abc.abstractmethod
    def reserve(self, n: int, timeout: float | None, streaming: bool = False) -> Reservation:
        """``n`` fresh indices for a new put; ``streaming``: the put does not wait for its
        answer (``put_async``), so a client that reserves ahead may do so for its next
        puts too."""

    def forget_pool(self) -> None:  # noqa: B027 (only a zmq client reserves ahead)
        """Drop this thread's indices reserved ahead (the controller no longer holds them)."""

    @abc.abstractmethod
    def abort(self, indices: np.ndarray) -> None: ...

    @abc.abstractmethod
    def check_update(self, cmd: CheckUpdate) -> np.ndarray:
        """The storage units of the existing samples a put writes to, once checked."""

    @abc.abstractmethod
    def commit(self, cmd: Commit) -> None: ...

    @abc.abstractmethod
    def claim(self, cmd: Claim, sampler: Sampler) -> list[BatchMeta]:
        """The claim's micro-batch, then up to ``cmd.more`` more ready at once."""

    @abc.abstractmethod
    def meta(self, cmd: MetaOf) -> BatchMeta: ...

    @abc.abstractmethod
    def ack(self, cmd: Ack) -> None: ...

    @abc.abstractmethod
    def release(self, cmd: Release) -> None: ...

    @abc.abstractmethod
    def publish_version(self, cmd: PublishVersion) -> None: ...

    @abc.abstractmethod
    def version(self) -> int: ...

    @abc.abstractmethod
    def end_stream(self, cmd: EndStream) -> None: ...

    @abc.abstractmethod
    def events(self) -> EventLog:
        """The log subscribers attach to (the controller's, or a local relay of it)."""

    @abc.abstractmethod
    def flush_events(self, timeout: float | None) -> bool: ...

    @abc.abstractmethod
    def raise_policy_error(self) -> None:
        """Re-raise the exception of a strict (policy) subscriber, if one failed."""

    @abc.abstractmethod
    def statistics(self) -> HubStats:
        """The controller's counters (``units`` left empty)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Refuse further commands (in-process: shut the controller and its journal)."""


class DataPort(abc.ABC):
    """Payload bytes to and from the storage units (``n_units`` of them)."""

    n_units: int
    #: The port copies a put's buffers out of the caller's arrays itself (to another
    #: process; a put_async's before it returns): a put may hand it the caller's arrays as
    #: they are. An in-process hub keeps the arrays it is given.
    copies_puts = False

    @abc.abstractmethod
    def write(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        put_id: int = 0,
    ) -> None:
        """Store bytes on a unit; with a ``put_id`` (a put to existing samples) staged:
        visible once the controller commits the put (see ``StorageUnit.stage``)."""

    @abc.abstractmethod
    def write_commit(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        commit: Commit,
        wait: bool,
        again: Callable[[dict[str, Encoded]], np.ndarray] | None,
    ) -> PutFuture | None:
        """Store and commit; may do both in one round trip, and may return before the
        answer (``wait=False``) with a future of it (None: done). ``again(data)`` makes the
        put again from ``data`` (the port's copy of ``encoded``), should the controller
        have let its pooled indices go."""

    def forget_staged(self, put_id: int, units: Iterable[int]) -> None:  # noqa: B027
        """A put to existing samples failed before its commit was settled: drop what it
        staged, where the port can know that (remote units forget it after a while)."""

    @abc.abstractmethod
    def discard(self, unit: int, indices: np.ndarray, columns: tuple[str, ...]) -> None: ...

    @abc.abstractmethod
    def read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> Sequence[Mapping[str, pa.Array | LazyColumn]]: ...

    @abc.abstractmethod
    def append(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]: ...

    def append_async(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> PutFuture:
        """``append``, answered later where the port can (a future of ``indices``)."""
        self.append(unit, indices, values, version)
        return PutFuture.completed(indices)

    @abc.abstractmethod
    def read_partial(
        self, unit: int, indices: np.ndarray, column: Column
    ) -> tuple[pa.Array, pa.Array]: ...

    @abc.abstractmethod
    def statistics(self) -> list[UnitStats]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def flush(self, timeout: float | None) -> None:  # noqa: B027 (in-process puts never wait)
        """Wait until every put_async of this thread is answered (see ``HubClient.flush``)."""

    def raise_failed_put(self) -> None:  # noqa: B027 (in-process puts never fail late)
        """Raise the first failed put_async of this thread that nobody was told about."""

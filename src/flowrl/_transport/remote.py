"""The hub client over zmq: same API as the embedded hub, servers in other processes.

Metadata goes to the controller; bytes go straight to the storage units, several units
read in parallel. The jobs around it live beside it: the sockets and replies
(``session``), indices reserved ahead (``pools``), put_async requests in flight
(``inflight``) and the event stream (``subscriber``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, final

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._client.base import HubClient
from flowrl._client.config import HubConfig, HubStats
from flowrl._client.future import PutFuture
from flowrl._controller.controller import RESERVATION_MIN_S
from flowrl._controller.eventlog import EventLog
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import Sampler
from flowrl._protocol import commands
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded
from flowrl._schema.schema import Schema
from flowrl._store.batch import LazyColumn
from flowrl._store.partial import VERSIONS
from flowrl._store.shm import ShmMaps, ShmUnavailable
from flowrl._transport import wire
from flowrl._transport.frames import (
    ArrayHeader,
    encoded_frames,
    from_frames,
    split_frames,
    to_frames_all,
    window_of,
)
from flowrl._transport.inflight import PutsInFlight
from flowrl._transport.pools import RESERVE_AHEAD, Pool, Pools
from flowrl._transport.session import RPC_TIMEOUT_S, Session
from flowrl._transport.subscriber import EventRelay
from flowrl.errors import ConfigError, FlowRLError, TransportError, UnknownIndexError

__all__ = ["RPC_TIMEOUT_S", "RemoteHub"]

log = logging.getLogger("flowrl.client")


@final
class RemoteHub(HubClient):
    """A client of a multi-process hub. Get one from ``flowrl.launch_hub``,
    ``flowrl.launch_ray_hub`` or ``flowrl.connect``.

    ``unit_nodes``: the node each storage unit runs on (Ray node ids for a Ray-placed hub)
    and ``node``: the node of this client. New samples then go to a storage unit on the
    client's own node when it has one (data locality); without them, the controller picks.
    """

    def __init__(
        self,
        address: str,
        *,
        rpc_timeout: float = RPC_TIMEOUT_S,
        unit_nodes: Sequence[str] = (),
        node: str = "",
    ) -> None:
        if isinstance(unit_nodes, str) or not all(isinstance(n, str) for n in unit_nodes):
            raise ConfigError(f"unit_nodes must be a list of node ids, got {unit_nodes!r}")
        if not isinstance(node, str):
            raise ConfigError(f"node must be a node id (str), got {node!r}")
        self.address = address
        self._session = Session(address, rpc_timeout)
        self._local = threading.local()  # this thread's pool of indices reserved ahead
        self._puts = PutsInFlight(self._session, self._discard, self._abort)
        self.servers: Any = None  # launch_hub's server processes (None after connect())
        self._on_close: list[Callable[[], None]] = []  # (launch_hub's: stop the servers)
        welcome = self._call(None, wire.Hello())[0]
        self.config: HubConfig = welcome.config
        infer = (
            self.config.infer_columns
            if self.config.infer_columns is not None
            else not welcome.columns
        )
        self.schema = Schema(welcome.columns, infer=infer)
        self.unit_addresses: list[str] = list(welcome.units)
        self._session.unit_addresses = self.unit_addresses
        # Units on this machine (ipc) let reads map their shared memory instead of copying.
        self._shm = [a.startswith("ipc://") for a in self.unit_addresses]
        self._shm_maps = ShmMaps()
        self.events_address: str = welcome.events
        # Every storage unit answers before the client is handed out: a unit process may
        # still be starting (launch_hub waits for the controller only), and a first write
        # that waits for it could outlive its reservation (reservations expire).
        for unit in range(len(self.unit_addresses)):
            self._call(unit, wire.UnitStatsReq())
        self._events: EventRelay | None = None
        # Small puts reserve indices ahead (see _reserve); a pool never holds more than
        # 1/64 of the capacity, so other producers barely notice it.
        self._pool_block = min(RESERVE_AHEAD, self.config.capacity // 64)
        self._pool_ttl = max(self.config.lease_timeout, RESERVATION_MIN_S) / 2
        self._pools = Pools()  # each thread's current pool, given back when it ends
        self.unit_nodes: tuple[str, ...] = tuple(unit_nodes)
        self.node = node
        if self.unit_nodes and len(self.unit_nodes) != len(self.unit_addresses):
            self.close()
            raise ConfigError(
                f"unit_nodes names {len(self.unit_nodes)} nodes, but the hub at {address} has "
                f"{len(self.unit_addresses)} storage units; pass one node id per unit"
            )
        local = [u for u, n in enumerate(self.unit_nodes) if n == node]
        self._local_units = local or None  # puts go to these units (data locality)

    @property
    def rpc_timeout(self) -> float:
        """How long a server may stay silent before it is presumed gone (seconds)."""
        return self._session.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, seconds: float) -> None:
        self._session.rpc_timeout = seconds

    @property
    def max_puts_in_flight(self) -> int:
        """put_async requests a thread may have unanswered; the next waits for the oldest."""
        return self._puts.limit

    @max_puts_in_flight.setter
    def max_puts_in_flight(self, n: int) -> None:
        self._puts.limit = n

    def _call(
        self, unit: int | None, msg: Any, frames: Sequence[Any] = (), wait: float | None = -1.0
    ) -> tuple[Any, list[Any]]:
        return self._session.call(unit, msg, frames, wait)

    # -- put_async ---------------------------------------------------------------------------
    def _raise_failed_put(self) -> None:
        self._puts.raise_failed()

    def flush(self, timeout: float | None = None) -> None:
        self._puts.flush(timeout)

    def _give_back_pools(self) -> None:
        """Free what the threads reserved ahead (a client that dies leaves it to expire,
        or to the controller, which takes it back when the hub is full)."""
        left = self._pools.take_all()
        if left:
            with contextlib.suppress(FlowRLError):
                self._call(None, commands.Abort(indices=np.concatenate(left)), wait=1.0)

    # -- primitives -------------------------------------------------------------------------
    def _declare_columns(self, columns: tuple[Column, ...]) -> None:
        self._call(None, commands.Declare(columns=columns))  # the controller checks first
        self.schema.declare(*columns)

    def _register_task(self, task: str, columns: tuple[str, ...]) -> None:
        self._call(None, commands.RegisterTask(task=task, columns=columns))

    def _reserve(self, n: int, timeout: float | None) -> tuple[np.ndarray, int]:
        """Fresh indices for a put. Small puts take them from this thread's pool, reserved
        ahead in one round trip with an earlier put's: a small put then costs the write's
        round trip alone."""
        pool: Pool | None = getattr(self._local, "pool", None)
        taken = pool.take(n) if pool is not None and time.monotonic() < pool.until else None
        self._local.pooled = taken is not None
        self._local.put_timeout = timeout
        if taken is not None:
            return taken
        ahead = self._pool_block if n < self._pool_block else 0
        # this thread's spent pool, and the pools of this client's threads that ended
        left = self._pools.take_ended() + ([] if pool is None else [pool.rest()])
        give_back = np.concatenate(left) if left else None

        def request(left: float | None) -> commands.Reserve:
            return commands.Reserve(
                n=n, timeout=left, units=self._local_units, ahead=ahead, give_back=give_back
            )

        reply = self._session.call_parked(request, timeout, "a put (waiting for room)")
        indices = wire.ints(reply.indices)
        if reply.units is not None and indices.size > n:
            # used within half the reservation's lifetime, so it never expires under a put
            units = np.frombuffer(reply.units, dtype=np.int16)[n:]
            self._local.pool = Pool(indices[n:], units, time.monotonic() + self._pool_ttl)
            self._pools.hold(self._local, self._local.pool)  # replaces the spent one
        return indices[:n], reply.unit

    def _put_new(self, *args: Any) -> PutFuture:
        try:
            return super()._put_new(*args)
        except UnknownIndexError:
            # Pooled indices the controller no longer holds for us (it restarted from its
            # journal, or the stream ended): nothing was committed; reserve afresh, once.
            if not getattr(self._local, "pooled", False):
                raise
            self._local.pool = None
            return super()._put_new(*args)

    def _abort(self, indices: np.ndarray) -> None:
        self._call(None, commands.Abort(indices=indices))

    def _units_for_update(
        self,
        indices: Any,
        target: np.ndarray,
        columns: tuple[str, ...],
        ack: commands.LeaseRef | None,
    ) -> np.ndarray:
        # A handle (a claim's, above all: a stage's output) names its samples' units: a
        # write to one unit goes there at once, the unit refuses samples it does not hold
        # (evicted) and stages the bytes, and the commit checks what check_update would
        # have (a put refused there changes nothing: its unit forgets the staged bytes).
        units = indices.units if isinstance(indices, BatchMeta) else None
        if units is not None and units.size and (units == units[0]).all():
            return units
        return self._check_update(target, columns, ack)

    def _check_update(
        self, indices: np.ndarray, columns: tuple[str, ...], ack: commands.LeaseRef | None
    ) -> np.ndarray:
        msg = commands.CheckUpdate(indices=indices, columns=columns, ack=ack)
        reply, _ = self._call(None, msg)
        return np.frombuffer(reply.units, dtype=np.int16)

    def _write(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: dict[str, Column],
        put_id: int = 0,
    ) -> None:
        self._call(unit, *_write_request(indices, encoded, types, put_id=put_id))

    def _write_commit(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: dict[str, Column],
        commit: commands.Commit,
        wait: bool,
    ) -> PutFuture | None:
        # The unit hands the commit on once the bytes are stored; the controller answers
        # this thread's controller socket (or the unit, if it refused the write).
        msg, frames = _write_request(
            indices,
            encoded,
            types,
            commit=commit,
            controller=self.address,
            reply_to=self._session.routing_id(),
            put_id=commit.put_id,
        )
        if wait:
            session = self._session
            session.recv(
                unit, session.send(unit, msg, frames), self.rpc_timeout, or_controller=True
            )
            return None
        # Pooled indices may be gone when the put arrives (the stream ended, or the
        # controller restarted): then it is made again, as put() does.
        again = None
        if commit.new and getattr(self._local, "pooled", False):
            timeout = self._local.put_timeout

            def again() -> np.ndarray:
                redo = self._put_new(indices.size, encoded, types, (), commit, timeout, True)
                return redo.indices

        columns = tuple(encoded)
        return self._puts.send(unit, msg, frames, indices, columns, new=commit.new, again=again)

    def _discard(self, unit: int, indices: np.ndarray, columns: tuple[str, ...]) -> None:
        try:
            self._call(unit, wire.Discard(indices=indices.tobytes(), columns=list(columns)))
        except TransportError:
            log.warning("could not discard uncommitted data on storage unit %d", unit)

    def _commit(self, cmd: commands.Commit) -> None:
        self._call(None, cmd)

    def _claim(self, cmd: commands.Claim, sampler: Sampler) -> BatchMeta:
        cmd = msgspec.structs.replace(cmd, sampler=wire.spec_of_sampler(sampler))

        def request(left: float | None) -> commands.Claim:
            return msgspec.structs.replace(cmd, timeout=left)

        reply = self._session.call_parked(request, cmd.timeout, f"a claim by task {cmd.task!r}")
        return BatchMeta.from_wire(reply.meta)

    def _read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> list[dict[str, pa.Array | LazyColumn]]:
        for _, idx in parts:
            if idx.size and idx.min() < 0:  # a tampered handle: no unit holds such a sample
                raise UnknownIndexError(f"sample index {int(idx.min())} does not exist")
        # Send every unit's request first, then collect: units serve in parallel.
        rids = [
            self._session.send(
                unit,
                wire.Read(indices=idx.tobytes(), columns=list(columns), shm=self._shm[unit]),
            )
            for unit, idx in parts
        ]
        out = []
        for (unit, idx), rid in zip(parts, rids, strict=True):
            reply, frames = self._session.recv(unit, rid, self.rpc_timeout)
            try:
                buffers = (
                    [f.buffer for f in frames]
                    if reply.refs is None
                    else self._shm_maps.buffers(reply.refs, frames, unit)
                )
            except ShmUnavailable:  # another machine's (or container's) /dev/shm: frames
                log.info("storage unit %d's shared memory is not visible here", unit)
                self._shm[unit] = False
                return self._read_many(parts, columns)
            arrays: dict[str, pa.Array | LazyColumn] = {}
            reply_of = f"storage unit {unit}'s reply"
            starts = reply.starts  # whole chunks: the rows read start there
            if starts is not None and len(starts) != len(reply.arrays):
                raise TransportError(f"{reply_of} names {len(starts)} starts for its arrays")
            n = idx.size
            for i, (header, bufs) in enumerate(
                zip(reply.arrays, split_frames(reply.arrays, buffers, reply_of), strict=True)
            ):
                start = 0 if starts is None else starts[i]
                if start + n > header.length or (starts is None and header.length != n):
                    raise TransportError(f"storage unit {unit} returned the wrong row count")
                column = self.schema[header.column]
                rows = None if starts is None else window_of(column, header, bufs, start, n)
                if rows is None:
                    arr = from_frames(column, header, bufs)
                    rows = arr if header.length == n else arr.slice(start, n)
                arrays[header.column] = rows
            out.append(arrays)
        return out

    def _append(
        self, unit: int, indices: np.ndarray, values: list[tuple[Column, pa.Array]], version: int
    ) -> list[np.ndarray]:
        headers, frames = to_frames_all(values)
        msg = wire.Append(
            indices=indices.tobytes(),
            columns=[c for c, _ in values],
            version=version,
            arrays=headers,
        )
        reply, _ = self._call(unit, msg, frames)
        lengths = wire.ints(reply.lengths)
        if lengths.size != len(values) * indices.size:
            raise TransportError(f"storage unit {unit} answered an append malformed")
        return list(lengths.reshape(len(values), indices.size))

    def _read_partial(
        self, unit: int, indices: np.ndarray, column: Column
    ) -> tuple[pa.Array, pa.Array]:
        reply, frames = self._call(unit, wire.ReadPartial(indices=indices.tobytes(), column=column))
        if len(reply.arrays) != 2 or any(h.length != indices.size for h in reply.arrays):
            raise TransportError(f"storage unit {unit} answered a partial read malformed")
        values_h, versions_h = reply.arrays
        split = values_h.frames
        return (
            from_frames(column, values_h, [f.buffer for f in frames[:split]]),
            from_frames(VERSIONS, versions_h, [f.buffer for f in frames[split:]]),
        )

    def _meta(self, indices: np.ndarray, columns: tuple[str, ...]) -> BatchMeta:
        reply, _ = self._call(None, commands.MetaOf(indices=indices, columns=columns))
        return BatchMeta.from_wire(reply.meta)

    def _ack(self, task: str, lease: int, indices: np.ndarray | None, drop: bool) -> None:
        self._call(None, commands.Ack(task=task, lease=lease, indices=indices, drop=drop))

    def _release(self, task: str, lease: int) -> None:
        self._call(None, commands.Release(task=task, lease=lease))

    # -- the rest of the API ----------------------------------------------------------------
    def _publish_version(self, version: int) -> None:
        self._call(None, commands.PublishVersion(version=version))

    @property
    def version(self) -> int:
        return self._controller_stats().version

    def end_stream(self, columns: Sequence[str] = ()) -> None:
        cols = self.schema.check_names(columns, "end_stream()")
        self._call(None, commands.EndStream(columns=cols))

    def _event_log(self) -> EventLog:
        if self._events is None:
            self._events = EventRelay(self._session, self.events_address)
        return self._events.log

    def flush_events(self, timeout: float | None = 5.0) -> bool:
        """Wait until subscribers received every event the controller had logged at the call."""
        return True if self._events is None else self._events.flush(timeout)

    def _controller_stats(self) -> HubStats:
        reply, _ = self._call(None, wire.Stats())
        stats: HubStats = reply.stats
        return stats

    def statistics(self) -> HubStats:
        stats = self._controller_stats()
        units = []
        for u in range(len(self.unit_addresses)):
            units.append(self._call(u, wire.UnitStatsReq())[0].stats)
        return HubStats(
            **{**{f: getattr(stats, f) for f in stats.__struct_fields__}, "units": units}
        )

    def _raise_policy_error(self) -> None:
        if self._events is not None:
            self._events.log.check()

    def close(self) -> None:
        if self._session.closed:
            return
        if self._puts.any_pending():  # this thread's unanswered put_async
            try:
                self.flush(timeout=self.rpc_timeout)
            except FlowRLError as exc:
                log.warning("a put_async failed before close(): %s", exc)
        self._give_back_pools()
        self._session.closed = True
        for fn in self._on_close:
            fn()
        if self._events is not None:
            self._events.close()
        self._session.close()
        self._shm_maps.clear()


def _write_request(
    indices: np.ndarray,
    encoded: dict[str, Encoded],
    types: dict[str, Column],
    **commit: Any,
) -> tuple[wire.Write, list[Any]]:
    """A Write and its payload frames (one per buffer)."""
    headers: list[ArrayHeader] = []
    frames: list[Any] = []
    for name, column in encoded.items():
        header, buffers = encoded_frames(name, column)
        headers.append(header)
        frames.extend(buffers)
    msg = wire.write_request(
        indices.tobytes(), [types[name] for name in encoded], headers, **commit
    )
    return msg, frames

"""The hub client over zmq: same API as the embedded hub, servers in other processes.

Each thread gets its own DEALER sockets (zmq sockets are not thread-safe), so a thread
blocked in ``claim`` never delays another thread's ``put``. Metadata goes to the
controller; bytes go straight to the storage units, several units read in parallel.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, final

import msgspec
import numpy as np
import pyarrow as pa
import zmq

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
    ZERO_COPY_MIN_BYTES,
    ArrayHeader,
    encoded_frames,
    from_frames,
    split_frames,
    to_frames_all,
    window_of,
)
from flowrl._transport.sockio import poll_in, recv_parts, send_parts
from flowrl.errors import (
    ConfigError,
    FlowRLError,
    HubClosed,
    Timeout,
    TransportError,
    UnknownIndexError,
)
from flowrl.events import event_decoder

__all__ = ["RemoteHub"]

log = logging.getLogger("flowrl.client")

#: How long a server may stay silent (a reply, or an answer to a ping) before it is
#: presumed gone (``RemoteHub.rpc_timeout``).
RPC_TIMEOUT_S = 30.0
#: A request waiting in the controller (claim, reserve) is checked on after the controller
#: was silent for this share of ``rpc_timeout`` (see ``RemoteHub._call_parked``).
PING_SHARE = 1 / 3
#: Longest single zmq poll while waiting for a reply (then check the deadline and close).
POLL_SLICE_S = 1.0
#: Indices a thread reserves ahead for its next small puts (capped at capacity / 64).
RESERVE_AHEAD = 32
#: put_async requests a thread may have unanswered (``RemoteHub.max_puts_in_flight``).
PUTS_IN_FLIGHT = 64


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
        self.rpc_timeout = rpc_timeout
        self._zctx: zmq.Context = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self._rid = itertools.count(1)
        self._closed = False
        self._on_close: list[Callable[[], None]] = []
        self.servers: Any = None  # launch_hub's server processes (None after connect())
        #: put_async requests a thread may have unanswered; the next waits for the oldest
        self.max_puts_in_flight = PUTS_IN_FLIGHT
        welcome = self._call(None, wire.Hello())[0]
        self.config: HubConfig = welcome.config
        infer = (
            self.config.infer_columns
            if self.config.infer_columns is not None
            else not welcome.columns
        )
        self.schema = Schema(welcome.columns, infer=infer)
        self.unit_addresses: list[str] = list(welcome.units)
        # Units on this machine (ipc) let reads map their shared memory instead of copying.
        self._shm = [a.startswith("ipc://") for a in self.unit_addresses]
        self._shm_maps = ShmMaps()
        self.events_address: str = welcome.events
        # Every storage unit answers before the client is handed out: a unit process may
        # still be starting (launch_hub waits for the controller only), and a first write
        # that waits for it could outlive its reservation (reservations expire).
        for unit in range(len(self.unit_addresses)):
            self._call(unit, wire.UnitStatsReq())
        self._events: EventLog | None = None
        self._sub_thread: threading.Thread | None = None
        self._hello = threading.Condition()
        self._hello_seen = 0
        # Small puts reserve indices ahead (see _reserve); a pool never holds more than
        # 1/64 of the capacity, so other producers barely notice it.
        self._pool_block = min(RESERVE_AHEAD, self.config.capacity // 64)
        self._pool_ttl = max(self.config.lease_timeout, RESERVATION_MIN_S) / 2
        self._pools = _Pools()  # each thread's current pool, given back when it ends
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

    # -- rpc --------------------------------------------------------------------------------
    def _socket(self, unit: int | None) -> zmq.Socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.get(unit)
        if sock is None:
            if unit is not None and not 0 <= unit < len(self.unit_addresses):
                raise UnknownIndexError(
                    f"storage unit {unit} does not exist: this hub has "
                    f"{len(self.unit_addresses)} (is the BatchMeta from another hub?)"
                )
            sock = self._zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if unit is None:  # named, so a storage unit can have the controller answer it
                sock.setsockopt(zmq.ROUTING_ID, b"f" + secrets.token_bytes(15))
            sock.connect(self.address if unit is None else self.unit_addresses[unit])
            socks[unit] = sock
            with self._sockets_lock:
                self._sockets.append(sock)
        return sock

    def _routing_id(self) -> bytes:
        """This thread's id on its controller socket (where handed-on commits answer)."""
        rid: bytes | None = getattr(self._local, "routing_id", None)
        if rid is None:
            rid = self._local.routing_id = bytes(self._socket(None).getsockopt(zmq.ROUTING_ID))
        return rid

    def _send(self, unit: int | None, msg: Any, frames: Sequence[Any] = ()) -> bytes:
        if self._closed:
            raise HubClosed("this hub client was closed")
        rid = next(self._rid).to_bytes(8, "little")
        body = wire.encode(msg)  # raises ConfigError for values msgpack cannot carry
        sock = self._socket(unit)
        try:
            # Zero-copy only pays for payload frames; small control messages are copied.
            small = sum(memoryview(f).nbytes for f in frames) < ZERO_COPY_MIN_BYTES
            send_parts(sock, [rid, body, *frames], copy=small)
        except zmq.ZMQError as exc:
            raise self._socket_error(exc) from None
        return rid

    def _recv(
        self, unit: int | None, rid: bytes, wait: float | None, *, or_controller: bool = False
    ) -> tuple[Any, list[Any]]:
        """The reply to request ``rid`` from ``unit`` (None: the controller). With
        ``or_controller``, from the unit or the controller, whichever answers (a write whose
        commit the unit handed on: the controller answers, or the unit refused the write)."""
        forever = wait is None or math.isinf(wait)
        deadline = math.inf if forever else time.monotonic() + wait  # type: ignore[operator]
        got = self._recv_first(unit, (rid,), deadline, or_controller=or_controller)
        if got is None:
            where = "controller" if unit is None else f"storage unit {unit}"
            raise _NoAnswer(f"the hub's {where} did not answer within {wait:.1f}s; is it running?")
        return got[1], got[2]

    def _recv_first(
        self,
        unit: int | None,
        rids: tuple[bytes, ...],
        deadline: float,
        *,
        or_controller: bool = False,
    ) -> tuple[bytes, Any, list[Any]] | None:
        """(request id, reply, payload frames) of the first reply to one of ``rids``, or
        None at ``deadline`` (monotonic; inf: none). Sockets as for :meth:`_recv`."""
        socks = [self._socket(unit)]
        if or_controller:
            socks.append(self._socket(None))
        controller = self._socket(None) if unit is None or or_controller else None
        while True:
            # Poll in bounded slices: zmq takes int milliseconds (a huge wait overflows)
            # and a slice ends in time to notice that another thread closed the client.
            left = min(POLL_SLICE_S, deadline - time.monotonic())
            try:
                ready = poll_in(socks, int(max(0.0, left) * 1000) + 1)
            except zmq.ZMQError as exc:
                raise self._socket_error(exc) from None
            if not ready:
                if self._closed:
                    raise HubClosed("this hub client was closed while waiting for a reply")
                if time.monotonic() < deadline:
                    continue
                return None
            for sock in ready:
                reply = self._take_reply(sock, rids, payload=sock is not controller)
                if reply is not None:
                    return reply

    def _take_reply(
        self, sock: zmq.Socket, rids: tuple[bytes, ...], payload: bool
    ) -> tuple[bytes, Any, list[Any]] | None:
        """Read one reply; None if it answers none of ``rids`` (a put_async, settled here,
        or a request this thread gave up on). Units reply with payload frames (zero-copy);
        the controller's replies are small."""
        try:
            frames: list[Any] = recv_parts(sock, copy=not payload)
        except zmq.ZMQError as exc:
            raise self._socket_error(exc) from None
        if len(frames) < 2:
            raise TransportError(f"a reply of {len(frames)} frame(s) from the hub")
        got = _bytes(frames[0])
        reply = wire.decode_reply(frames[1].buffer if payload else frames[1])
        error = wire.exception_of(reply) if isinstance(reply, wire.Error) else None
        if got not in rids:
            # The answer to one of this thread's put_async, or to a request it gave up on.
            fut = self._in_flight().pop(got, None)
            if fut is not None:
                self._settle(fut, error)
            return None
        if error is not None:
            raise error
        return got, reply, frames[2:]

    def _call_parked(
        self, request: Callable[[float | None], Any], timeout: float | None, what: str
    ) -> Any:
        """Send a request the controller may park for up to ``timeout`` seconds (a claim, a
        reserve; ``request(seconds left)`` builds it) and return its reply.

        A parked request lives only in the controller's memory. When the controller has
        been silent for ``PING_SHARE`` of ``rpc_timeout``, a ping asks whether it still holds
        the request: a controller restarted from its journal does not, and gets it again
        (with the time left); a controller silent for ``rpc_timeout`` is presumed dead and
        the call raises TransportError, a call without a timeout too.
        """
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        rid = self._send(None, request(_left(deadline)))
        heard = time.monotonic()  # when the controller last answered anything
        ping: bytes | None = None
        while True:
            patience = self.rpc_timeout * (1.0 if ping is not None else PING_SHARE)
            rids = (rid,) if ping is None else (rid, ping)
            got = self._recv_first(None, rids, heard + patience)
            if got is None:
                if ping is not None:
                    raise _NoAnswer(
                        f"the hub's controller did not answer for {self.rpc_timeout:.1f}s while "
                        f"{what} waited in it; is it running?"
                    )
                ping = self._send(None, wire.Ping(rid=rid))
                continue
            heard = time.monotonic()
            answered, reply, _ = got
            if answered == rid:
                return reply
            ping = None
            if not reply.parked:  # a restarted controller: its answer never comes
                log.warning("the hub's controller lost a waiting request (restarted?); resending")
                rid = self._send(None, request(_left(deadline)))
            elif heard > deadline + self.rpc_timeout:  # it should have answered by now
                raise _NoAnswer(f"the hub's controller holds {what} past its timeout")

    # -- put_async ---------------------------------------------------------------------------
    def _in_flight(self) -> dict[bytes, PutFuture]:
        """This thread's unanswered put_async, oldest first."""
        pending: dict[bytes, PutFuture] | None = getattr(self._local, "in_flight", None)
        if pending is None:
            pending = self._local.in_flight = {}
        return pending

    def _refused(self) -> list[PutFuture]:
        """This thread's refused put_async not yet cleaned up or reported."""
        failed: list[PutFuture] | None = getattr(self._local, "failed", None)
        if failed is None:
            failed = self._local.failed = []
        return failed

    def _settle(self, fut: PutFuture, error: FlowRLError | None) -> None:
        """An answered put: done, or refused (its bytes and indices are freed at the next
        safe point, ``_clean_failed``: not here, inside another request's wait)."""
        if error is None:
            fut._succeed()
        else:
            fut._fail(error)
            self._refused().append(fut)

    def _wait_put(self, fut: PutFuture, timeout: float | None) -> None:
        pending = self._in_flight()
        if fut.rid in pending:
            error: FlowRLError | None = None
            try:
                wait = self.rpc_timeout if timeout is None else timeout
                self._recv(fut.unit, fut.rid, wait, or_controller=True)
            except _NoAnswer as exc:
                if timeout is not None:  # the caller's limit: the put stays pending
                    raise Timeout(
                        f"put_async of samples {fut.indices[:4].tolist()}... was not answered "
                        f"within {timeout}s"
                    ) from None
                # Nothing answered this put for rpc_timeout: each other put pending in this
                # thread was sent before the wait began and went unanswered as long. They
                # fail together, not one rpc_timeout after another.
                for other in list(pending.values()):
                    del pending[other.rid]
                    self._settle(other, exc)
                self._clean_failed()
                return
            except FlowRLError as exc:  # the hub refused this put (or the socket failed)
                error = exc
            del pending[fut.rid]
            self._settle(fut, error)
        self._clean_failed()

    def _clean_failed(self) -> None:
        """At a safe point (not inside another request's wait): free what refused puts
        left (bytes a unit stored, indices they reserved); a new put whose pooled indices
        the controller no longer held is made again, synchronously, as ``put`` does."""
        failed = self._refused()
        for fut in failed:  # (a discard's wait may append: it is seen too)
            # An unanswered put may have been committed (by a controller that died after
            # journaling it): its bytes stay, a reservation never committed expires.
            if fut.new and fut.columns and not isinstance(fut._error, _NoAnswer):
                columns, fut.columns = fut.columns, ()  # freed once
                with contextlib.suppress(FlowRLError):
                    self._discard(fut.unit, fut.indices, columns)
                    self._abort(fut.indices)
            again, fut._again = fut._again, None
            if again is not None and isinstance(fut._unobserved_error, UnknownIndexError):
                arrays, types, commit, timeout = again
                try:
                    redo = self._put_new(fut.indices.size, arrays, types, (), commit, timeout, True)
                except FlowRLError as exc:
                    fut._fail(exc)
                else:
                    fut._redone(redo.indices)
        self._local.failed = [f for f in failed if f._unobserved_error is not None]

    def _raise_failed_put(self) -> None:
        self._clean_failed()
        failed, self._local.failed = self._refused(), []
        if failed:
            errors = [f.exception() for f in failed]  # each is reported now, once
            error = errors[0]
            assert error is not None
            more = f"; {len(failed) - 1} later ones failed too" if len(failed) > 1 else ""
            error.add_note(
                f"raised by an earlier put_async (samples {failed[0].indices[:4].tolist()}) "
                f"whose future was not waited for{more}"
            )
            raise error

    def flush(self, timeout: float | None = None) -> None:
        pending = self._in_flight()
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            fut = next(iter(pending.values()))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait_put(fut, left)
        self._raise_failed_put()

    def _give_back_pools(self) -> None:
        """Free what the threads reserved ahead (a client that dies leaves it to expire,
        or to the controller, which takes it back when the hub is full)."""
        left = self._pools.take_all()
        if left:
            with contextlib.suppress(FlowRLError):
                self._call(None, commands.Abort(indices=np.concatenate(left)), wait=1.0)

    def _socket_error(self, exc: zmq.ZMQError) -> Exception:
        if self._closed:
            return HubClosed("this hub client was closed")
        return TransportError(f"zmq socket error talking to the hub: {exc}")

    def _call(
        self, unit: int | None, msg: Any, frames: Sequence[Any] = (), wait: float | None = -1.0
    ) -> tuple[Any, list[Any]]:
        rid = self._send(unit, msg, frames)
        return self._recv(unit, rid, self.rpc_timeout if wait == -1.0 else wait)

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
        pool: _Pool | None = getattr(self._local, "pool", None)
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

        reply = self._call_parked(request, timeout, "a put (waiting for room)")
        indices = wire.ints(reply.indices)
        if reply.units is not None and indices.size > n:
            # used within half the reservation's lifetime, so it never expires under a put
            units = np.frombuffer(reply.units, dtype=np.int16)[n:]
            self._local.pool = _Pool(indices[n:], units, time.monotonic() + self._pool_ttl)
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
            reply_to=self._routing_id(),
            put_id=commit.put_id,
        )
        if wait:
            self._recv(unit, self._send(unit, msg, frames), self.rpc_timeout, or_controller=True)
            return None
        # Pooled indices may be gone when the put arrives (the stream ended, or the
        # controller restarted): then it is made again, as put() does.
        pooled = commit.new and getattr(self._local, "pooled", False)
        again = (encoded, types, commit, self._local.put_timeout) if pooled else None
        pending = self._in_flight()
        while len(pending) >= self.max_puts_in_flight:
            self._wait_put(next(iter(pending.values())), None)
        rid = self._send(unit, msg, frames)
        fut = PutFuture(
            indices, self._wait_put, unit=unit, rid=rid, columns=tuple(encoded), new=commit.new
        )
        fut._again = again
        pending[rid] = fut
        return fut

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

        reply = self._call_parked(request, cmd.timeout, f"a claim by task {cmd.task!r}")
        return BatchMeta.from_wire(reply.meta)

    def _read_many(
        self, parts: list[tuple[int, np.ndarray]], columns: tuple[str, ...]
    ) -> list[dict[str, pa.Array | LazyColumn]]:
        for _, idx in parts:
            if idx.size and idx.min() < 0:  # a tampered handle: no unit holds such a sample
                raise UnknownIndexError(f"sample index {int(idx.min())} does not exist")
        # Send every unit's request first, then collect: units serve in parallel.
        rids = [
            self._send(
                unit,
                wire.Read(indices=idx.tobytes(), columns=list(columns), shm=self._shm[unit]),
            )
            for unit, idx in parts
        ]
        out = []
        for (unit, idx), rid in zip(parts, rids, strict=True):
            reply, frames = self._recv(unit, rid, self.rpc_timeout)
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
            self._events = EventLog()
            self._start_subscriber()
        return self._events

    def flush_events(self, timeout: float | None = 5.0) -> bool:
        """Wait until subscribers received every event the controller had logged at the call.

        A marker sent through the ordered event stream proves every earlier event arrived.
        """
        if self._events is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        token = next(self._rid)
        self._call(None, wire.PublishHello(token=token))
        with self._hello:
            if not self._hello.wait_for(lambda: self._hello_seen >= token, timeout=timeout):
                return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._events.flush(left)

    def _start_subscriber(self) -> None:
        sub = self._zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events_address)
        # PUB/SUB drops messages until the connection is up: handshake before returning.
        token = next(self._rid)
        for _ in range(100):
            self._call(None, wire.PublishHello(token=token))
            if sub.poll(50) and _drain_until_hello(sub, token):
                break
        else:
            sub.close()
            raise TransportError("could not subscribe to the hub's event stream")
        stop = threading.Event()

        def pump() -> None:
            events = self._events
            assert events is not None
            subs = [sub]
            while not stop.is_set():
                if not poll_in(subs, 100):
                    continue
                topic, body = recv_parts(sub)
                if topic == b"e":
                    events.append(event_decoder.decode(body))
                elif topic == b"h":
                    with self._hello:
                        self._hello_seen = max(self._hello_seen, int.from_bytes(body, "little"))
                        self._hello.notify_all()
            sub.close()

        self._sub_thread = threading.Thread(target=pump, name="flowrl-sub", daemon=True)
        self._sub_thread.start()
        self._on_close.append(stop.set)

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
            self._events.check()

    def close(self) -> None:
        if self._closed:
            return
        if getattr(self._local, "in_flight", None):  # this thread's unanswered put_async
            try:
                self.flush(timeout=self.rpc_timeout)
            except FlowRLError as exc:
                log.warning("a put_async failed before close(): %s", exc)
        self._give_back_pools()
        self._closed = True
        for fn in self._on_close:
            fn()
        if self._sub_thread is not None:
            self._sub_thread.join(timeout=2)
        if self._events is not None:
            self._events.close()
        with self._sockets_lock:
            for s in self._sockets:
                s.close(linger=0)
            self._sockets.clear()
        self._shm_maps.clear()


class _NoAnswer(TransportError):
    """No reply within the wait (as opposed to a reply that is an error)."""


class _Pool:
    """Indices a thread reserved ahead for its next small puts, and their storage units."""

    __slots__ = ("first", "free", "indices", "units", "until")

    def __init__(self, indices: np.ndarray, units: np.ndarray, until: float) -> None:
        self.indices = indices
        self.units = units
        self.free = np.ones(indices.size, dtype=bool)
        self.first = 0  # every index before it is taken (takes go mostly in order)
        self.until = until

    def take(self, n: int) -> tuple[np.ndarray, int] | None:
        """``n`` indices on one unit (that of the oldest left), or None if there are not."""
        free, first = self.free, self.first
        while first < free.size and not free[first]:
            first += 1
        self.first = first
        if first == free.size:
            return None
        if n == 1:  # the usual case: a single-sample put, the oldest index left
            free[first] = False
            return self.indices[first : first + 1], int(self.units[first])
        pos = first + np.flatnonzero(free[first:])
        pos = pos[self.units[pos] == self.units[first]][:n]
        if pos.size < n:
            return None
        free[pos] = False
        return self.indices[pos], int(self.units[first])

    def rest(self) -> np.ndarray:
        """Every index left (the pool is empty afterwards)."""
        left = self.indices[self.free]
        self.free[:] = False
        return left


class _Pools:
    """The pool of every thread of a client. A thread's pool is given back when the
    thread ends (its thread-local token is collected: the indices left wait in ``ended``
    for the next reserve of any thread to give them back) or when the client closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, _Pool] = {}  # by thread token
        self._ended: list[np.ndarray] = []
        self._tokens = itertools.count()

    def hold(self, local: threading.local, pool: _Pool) -> None:
        """Make ``pool`` the current one of the thread whose ``local`` this is."""
        token: _Token | None = getattr(local, "pool_token", None)
        if token is None:
            token = local.pool_token = _Token(next(self._tokens))
            weakref.finalize(token, self._thread_ended, token.key)
        with self._lock:
            self._live[token.key] = pool

    def _thread_ended(self, key: int) -> None:
        with self._lock:
            pool = self._live.pop(key, None)
            if pool is not None:
                self._ended.append(pool.rest())

    def take_ended(self) -> list[np.ndarray]:
        """The indices left by threads that ended since the last call."""
        with self._lock:
            ended, self._ended = self._ended, []
        return [i for i in ended if i.size]

    def take_all(self) -> list[np.ndarray]:
        """Every index left, of every pool (the client closes)."""
        with self._lock:
            left = self._ended + [pool.rest() for pool in self._live.values()]
            self._ended, self._live = [], {}
        return [i for i in left if i.size]


class _Token:
    """A thread's key in ``_Pools``; collected with the thread's locals when it ends."""

    __slots__ = ("__weakref__", "key")

    def __init__(self, key: int) -> None:
        self.key = key


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


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def _left(deadline: float) -> float | None:
    """Seconds until a monotonic ``deadline``, as the wire spells a wait (None: for ever)."""
    return None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())


def _drain_until_hello(sub: zmq.Socket, token: int) -> bool:
    want = token.to_bytes(8, "little")
    while sub.poll(0):
        topic, body = sub.recv_multipart()
        if topic == b"h" and body == want:
            return True
    return False

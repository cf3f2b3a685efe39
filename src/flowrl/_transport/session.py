"""A zmq client's session with the hub's servers: sockets, request ids, replies.

Each thread gets its own DEALER sockets (zmq sockets are not thread-safe), so a thread
blocked in ``claim`` never delays another thread's ``put``: one to the controller (named,
so a storage unit can have the controller answer it) and one per storage unit. A reply
that answers none of the requests a thread waits for (a ``put_async``'s, or one the thread
gave up on) goes to ``on_stray``.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from flowrl._transport import wire
from flowrl._transport.frames import ZERO_COPY_MIN_BYTES
from flowrl._transport.sockio import poll_in, recv_parts, send_parts
from flowrl.errors import FlowRLError, HubClosed, TransportError, UnknownIndexError

__all__ = ["RPC_TIMEOUT_S", "NoAnswer", "Session"]

log = logging.getLogger("flowrl.client")

#: How long a server may stay silent (a reply, or an answer to a ping) before it is
#: presumed gone (``RemoteHub.rpc_timeout``).
RPC_TIMEOUT_S = 30.0
#: A request waiting in the controller (claim, reserve) is checked on after the controller
#: was silent for this share of ``rpc_timeout`` (see ``Session.call_parked``).
PING_SHARE = 1 / 3
#: Longest single zmq poll while waiting for a reply (then check the deadline and close).
POLL_SLICE_S = 1.0


class NoAnswer(TransportError):
    """No reply within the wait (as opposed to a reply that is an error)."""


class Session:
    """Requests to the controller (``unit`` None) and to storage units, and their replies."""

    def __init__(self, address: str, rpc_timeout: float) -> None:
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.unit_addresses: list[str] = []  # known once the controller welcomed us
        self.zctx: zmq.Context = zmq.Context.instance()
        self.local = threading.local()
        self.sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self.counter = itertools.count(1)  # request ids (and other tokens) of this client
        self.closed = False
        self.on_stray: Callable[[bytes, FlowRLError | None], None] = _ignore

    def socket(self, unit: int | None) -> zmq.Socket:
        socks = getattr(self.local, "socks", None)
        if socks is None:
            socks = self.local.socks = {}
        sock = socks.get(unit)
        if sock is None:
            if unit is not None and not 0 <= unit < len(self.unit_addresses):
                raise UnknownIndexError(
                    f"storage unit {unit} does not exist: this hub has "
                    f"{len(self.unit_addresses)} (is the BatchMeta from another hub?)"
                )
            sock = self.zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if unit is None:  # named, so a storage unit can have the controller answer it
                sock.setsockopt(zmq.ROUTING_ID, b"f" + secrets.token_bytes(15))
            sock.connect(self.address if unit is None else self.unit_addresses[unit])
            socks[unit] = sock
            with self._lock:
                self.sockets.append(sock)
        return sock

    def routing_id(self) -> bytes:
        """This thread's id on its controller socket (where handed-on commits answer)."""
        rid: bytes | None = getattr(self.local, "routing_id", None)
        if rid is None:
            rid = self.local.routing_id = bytes(self.socket(None).getsockopt(zmq.ROUTING_ID))
        return rid

    def send(self, unit: int | None, msg: Any, frames: Sequence[Any] = ()) -> bytes:
        if self.closed:
            raise HubClosed("this hub client was closed")
        rid = next(self.counter).to_bytes(8, "little")
        body = wire.encode(msg)  # raises ConfigError for values msgpack cannot carry
        sock = self.socket(unit)
        try:
            # Zero-copy only pays for payload frames; small control messages are copied.
            small = sum(memoryview(f).nbytes for f in frames) < ZERO_COPY_MIN_BYTES
            send_parts(sock, [rid, body, *frames], copy=small)
        except zmq.ZMQError as exc:
            raise self.socket_error(exc) from None
        return rid

    def recv(
        self, unit: int | None, rid: bytes, wait: float | None, *, or_controller: bool = False
    ) -> tuple[Any, list[Any]]:
        """The reply to request ``rid`` from ``unit`` (None: the controller). With
        ``or_controller``, from the unit or the controller, whichever answers (a write whose
        commit the unit handed on: the controller answers, or the unit refused the write)."""
        forever = wait is None or math.isinf(wait)
        deadline = math.inf if forever else time.monotonic() + wait  # type: ignore[operator]
        got = self.recv_first(unit, (rid,), deadline, or_controller=or_controller)
        if got is None:
            where = "controller" if unit is None else f"storage unit {unit}"
            raise NoAnswer(f"the hub's {where} did not answer within {wait:.1f}s; is it running?")
        return got[1], got[2]

    def recv_first(
        self,
        unit: int | None,
        rids: tuple[bytes, ...],
        deadline: float,
        *,
        or_controller: bool = False,
    ) -> tuple[bytes, Any, list[Any]] | None:
        """(request id, reply, payload frames) of the first reply to one of ``rids``, or
        None at ``deadline`` (monotonic; inf: none). Sockets as for :meth:`_recv`."""
        socks = [self.socket(unit)]
        if or_controller:
            socks.append(self.socket(None))
        controller = self.socket(None) if unit is None or or_controller else None
        while True:
            # Poll in bounded slices: zmq takes int milliseconds (a huge wait overflows)
            # and a slice ends in time to notice that another thread closed the client.
            left = min(POLL_SLICE_S, deadline - time.monotonic())
            try:
                ready = poll_in(socks, int(max(0.0, left) * 1000) + 1)
            except zmq.ZMQError as exc:
                raise self.socket_error(exc) from None
            if not ready:
                if self.closed:
                    raise HubClosed("this hub client was closed while waiting for a reply")
                if time.monotonic() < deadline:
                    continue
                return None
            for sock in ready:
                reply = self.take_reply(sock, rids, payload=sock is not controller)
                if reply is not None:
                    return reply

    def take_reply(
        self, sock: zmq.Socket, rids: tuple[bytes, ...], payload: bool
    ) -> tuple[bytes, Any, list[Any]] | None:
        """Read one reply; None if it answers none of ``rids`` (a put_async, settled here,
        or a request this thread gave up on). Units reply with payload frames (zero-copy);
        the controller's replies are small."""
        try:
            frames: list[Any] = recv_parts(sock, copy=not payload)
        except zmq.ZMQError as exc:
            raise self.socket_error(exc) from None
        if len(frames) < 2:
            raise TransportError(f"a reply of {len(frames)} frame(s) from the hub")
        got = _bytes(frames[0])
        reply = wire.decode_reply(frames[1].buffer if payload else frames[1])
        error = wire.exception_of(reply) if isinstance(reply, wire.Error) else None
        if got not in rids:
            # The answer to one of this thread's put_async, or to a request it gave up on.
            self.on_stray(got, error)
            return None
        if error is not None:
            raise error
        return got, reply, frames[2:]

    def call_parked(
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
        rid = self.send(None, request(left(deadline)))
        heard = time.monotonic()  # when the controller last answered anything
        ping: bytes | None = None
        while True:
            patience = self.rpc_timeout * (1.0 if ping is not None else PING_SHARE)
            rids = (rid,) if ping is None else (rid, ping)
            got = self.recv_first(None, rids, heard + patience)
            if got is None:
                if ping is not None:
                    raise NoAnswer(
                        f"the hub's controller did not answer for {self.rpc_timeout:.1f}s while "
                        f"{what} waited in it; is it running?"
                    )
                ping = self.send(None, wire.Ping(rid=rid))
                continue
            heard = time.monotonic()
            answered, reply, _ = got
            if answered == rid:
                return reply
            ping = None
            if not reply.parked:  # a restarted controller: its answer never comes
                log.warning("the hub's controller lost a waiting request (restarted?); resending")
                rid = self.send(None, request(left(deadline)))
            elif heard > deadline + self.rpc_timeout:  # it should have answered by now
                raise NoAnswer(f"the hub's controller holds {what} past its timeout")

    def socket_error(self, exc: zmq.ZMQError) -> Exception:
        if self.closed:
            return HubClosed("this hub client was closed")
        return TransportError(f"zmq socket error talking to the hub: {exc}")

    def call(
        self, unit: int | None, msg: Any, frames: Sequence[Any] = (), wait: float | None = -1.0
    ) -> tuple[Any, list[Any]]:
        """Send ``msg`` and wait for its reply (``wait`` -1: ``rpc_timeout``)."""
        rid = self.send(unit, msg, frames)
        return self.recv(unit, rid, self.rpc_timeout if wait == -1.0 else wait)

    def close(self) -> None:
        self.closed = True
        with self._lock:
            for s in self.sockets:
                s.close(linger=0)
            self.sockets.clear()


def _ignore(rid: bytes, error: FlowRLError | None) -> None:
    pass


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def left(deadline: float) -> float | None:
    """Seconds until a monotonic ``deadline``, as the wire spells a wait (None: for ever)."""
    return None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())

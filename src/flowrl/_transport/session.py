"""A zmq client's session with the hub's servers: sockets, request ids, replies.

Each thread gets its own DEALER sockets (zmq sockets are not thread-safe), so a thread
blocked in ``claim`` never delays another thread's ``put``: one to the controller (named,
so a storage unit can have the controller answer it) and one per storage unit; an ended
thread's sockets go to the next new thread (``thread_sockets``). A reply
that answers none of the requests a thread waits for (a ``put_async``'s, or one the thread
gave up on) goes to ``on_stray``.
"""

from __future__ import annotations

import errno
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
from flowrl._transport.auth import HubKey, client_options
from flowrl._transport.frames import ZERO_COPY_MIN_BYTES
from flowrl._transport.sockio import SNDMORE, has_input, poll_in, recv_parts, send_parts
from flowrl._transport.thread_sockets import FDS_NEEDED, ThreadSockets, descriptors_left
from flowrl.errors import (
    HubClosed,
    ResourceExhausted,
    TransportError,
    UnknownIndexError,
)

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
#: Once a server was silent for a whole ``rpc_timeout``, a request to it waits this long at
#: most, until it answers again: calls fail fast one after another against a hung or dead
#: server, yet one that comes back (restarted, or SIGCONTed) is heard at once.
SILENT_WAIT_S = 1.0
#: zmq errors that mean a resource ran out (descriptors, the context's socket limit, memory).
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class NoAnswer(TransportError):
    """No reply within the wait (as opposed to a reply that is an error)."""


#: The note a put's NoAnswer carries: what the caller can and cannot assume.
MAY_HAVE_LANDED = (
    "the put may have been committed (the hub may have stored it and lost only its answer): "
    "sent again it can land twice, unless it carries producer= and seq= "
    "(docs/durability.md, 'Idempotent producers')"
)


class _NoAnswerNoDescriptors(NoAnswer, ResourceExhausted):
    """No reply, in a process out of descriptors: zmq may have failed to connect."""


class Session:
    """Requests to the controller (``unit`` None) and to storage units, and their replies."""

    def __init__(self, address: str, rpc_timeout: float, key: HubKey | None = None) -> None:
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.key = key  # a TCP hub's key (None on ipc)
        self.unit_addresses: list[str] = []  # known once the controller welcomed us
        self.zctx: zmq.Context = zmq.Context.instance()
        self.local = threading.local()
        self.sockets = ThreadSockets(self._open)  # each thread's, handed on when it ends
        self.counter = itertools.count(1)  # request ids (and other tokens) of this client
        self.closed = False
        self.on_stray: Callable[[bytes, Any], None] = _ignore  # (request id, its reply)
        # Servers presumed gone (None: the controller), since when (monotonic): each was
        # silent for rpc_timeout; any message from one clears it.
        self.silent: dict[int | None, float] = {}

    def reply_wait(self, unit: int | None, *, or_controller: bool = False) -> float:
        """How long to wait for a reply from ``unit`` (None: the controller; with
        ``or_controller``, from either): ``rpc_timeout``, or ``SILENT_WAIT_S`` while it is
        presumed gone."""
        silent = unit in self.silent or (or_controller and None in self.silent)
        return min(self.rpc_timeout, SILENT_WAIT_S) if silent else self.rpc_timeout

    def no_answer(self, unit: int | None, wait: float, what: str = "") -> NoAnswer:
        """The error of a request ``unit`` left unanswered for ``wait`` seconds; from now
        on the server is presumed gone (see ``reply_wait``)."""
        where = "controller" if unit is None else f"storage unit {unit}"
        now = time.monotonic()
        since = self.silent.setdefault(unit, now)
        gone = f" (presumed gone for {now - since:.1f}s)" if since < now else ""
        waiting = f" while {what} waited in it" if what else ""
        return self._no_answer(
            f"the hub's {where} did not answer within {wait:.1f}s{waiting}{gone}; is it running?"
        )

    def socket(self, unit: int | None) -> zmq.Socket:
        """This thread's socket to ``unit`` (None: the controller)."""
        if unit is not None and not 0 <= unit < len(self.unit_addresses):
            raise UnknownIndexError(
                f"storage unit {unit} does not exist: this hub has "
                f"{len(self.unit_addresses)} (is the BatchMeta from another hub?)"
            )
        return self.sockets.get(unit)

    def _open(self, unit: int | None) -> zmq.Socket:
        if self.closed:
            raise HubClosed("this hub client was closed")
        left = descriptors_left()
        if left is not None and left < FDS_NEEDED:  # (zmq would fail to connect, silently)
            raise ResourceExhausted(self._out_of_descriptors(f"{max(0, left)} left"))
        try:
            sock = self.zctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise self.socket_error(exc) from None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if unit is None:  # named, so a storage unit can have the controller answer it
                sock.setsockopt(zmq.ROUTING_ID, b"f" + secrets.token_bytes(15))
            address = self.address if unit is None else self.unit_addresses[unit]
            client_options(sock, address, self.key, data=unit is not None)
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise self.socket_error(exc) from None
        return sock

    def _out_of_descriptors(self, what: str) -> str:
        return (
            f"this process ran out of sockets or file descriptors talking to the hub ({what}); "
            f"this client holds {self.sockets.open_count()} sockets (one per live thread and "
            "server). Raise `ulimit -n`, or close clients and files it no longer uses"
        )

    def _no_answer(self, message: str) -> NoAnswer:
        """NoAnswer, or why no answer may come: the process is out of descriptors."""
        left = descriptors_left()
        if left is not None and left < FDS_NEEDED:
            why = f"{max(0, left)} left; {message}"
            return _NoAnswerNoDescriptors(self._out_of_descriptors(why))
        return NoAnswer(message)

    def routing_id(self) -> bytes:
        """This thread's id on its controller socket, where the controller answers the
        commits storage units hand on (the controller holds an answer for a socket whose
        connection it has not seen yet: a new thread's, or any after it restarted)."""
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
            if frames:
                # Zero-copy only pays for payload frames; small control messages are copied.
                small = sum(memoryview(f).nbytes for f in frames) < ZERO_COPY_MIN_BYTES
                send_parts(sock, [rid, body, *frames], copy=small)
            else:
                sock.send(rid, SNDMORE)
                sock.send(body)
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
            if or_controller:  # (either may be the silent one: presume neither gone)
                where = f"storage unit {unit} (or the controller)"
                raise self._no_answer(f"the hub's {where} did not answer within {wait:.1f}s")
            raise self.no_answer(unit, wait)  # type: ignore[arg-type]  # (None: forever)
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
        sock = self.socket(unit)
        socks = [sock]
        controller = sock if unit is None else None
        if or_controller:
            controller = self.socket(None)
            socks.append(controller)
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
            for ready_sock in ready:
                if self.silent:  # it is there
                    self.silent.pop(None if ready_sock is controller else unit, None)
                reply = self.take_reply(ready_sock, rids, payload=ready_sock is not controller)
                if reply is not None:
                    return reply

    def take_ready(self, unit: int | None) -> None:
        """Read the replies already queued on this thread's socket to ``unit`` (None: the
        controller), without waiting: no request waits for them here (``on_stray``)."""
        sock = self.socket(unit)
        while has_input(sock):
            self.take_reply(sock, (), payload=unit is not None)

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
        got = frames[0].bytes if payload else frames[0]
        reply = wire.decode_reply(frames[1].buffer if payload else frames[1])
        if got not in rids:
            # The answer to one of this thread's put_async, or to a request it gave up on.
            self.on_stray(got, reply)
            return None
        if type(reply) is wire.Error:
            raise wire.exception_of(reply)
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
        the call raises TransportError, a call without a timeout too. While it is presumed
        dead, the ping goes at once and the call fails after ``SILENT_WAIT_S``.
        """
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        rid = self.send(None, request(left(deadline)))
        heard = time.monotonic()  # when the controller last answered anything
        # Presumed gone: ask at once whether it is there (and give up after SILENT_WAIT_S).
        ping = self.send(None, wire.Ping(rid=rid)) if None in self.silent else None
        while True:
            patience = self.rpc_timeout * (1.0 if ping is not None else PING_SHARE)
            if None in self.silent:
                patience = min(patience, SILENT_WAIT_S)
            rids = (rid,) if ping is None else (rid, ping)
            got = self.recv_first(None, rids, heard + patience)
            if got is None:
                if ping is not None:
                    raise self.no_answer(None, patience, what)
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
        if exc.errno in _OUT_OF_RESOURCES:
            return ResourceExhausted(self._out_of_descriptors(str(exc)))
        return TransportError(f"zmq socket error talking to the hub: {exc}")

    def call(
        self, unit: int | None, msg: Any, frames: Sequence[Any] = (), wait: float | None = -1.0
    ) -> tuple[Any, list[Any]]:
        """Send ``msg`` and wait for its reply (``wait`` -1: ``reply_wait``)."""
        rid = self.send(unit, msg, frames)
        return self.recv(unit, rid, self.reply_wait(unit) if wait == -1.0 else wait)

    def close(self) -> None:
        self.closed = True
        self.sockets.close()


def _ignore(rid: bytes, reply: Any) -> None:
    pass


def left(deadline: float) -> float | None:
    """Seconds until a monotonic ``deadline``, as the wire spells a wait (None: for ever)."""
    return None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())

"""Multipart send, receive and poll on zmq sockets, for the hub's hot paths.

pyzmq's ``send_multipart``/``recv_multipart``/``Socket.poll`` combine flags as ``IntFlag``
enums (``SNDMORE | flags``, ``getsockopt(RCVMORE)``, a fresh ``Poller`` per poll): a few
microseconds of enum arithmetic per message, a tenth of a metadata round trip on the
hub's small control messages. These helpers call the same public socket methods with
plain ints and read ``Frame.more`` instead of asking the socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

__all__ = ["NOBLOCK", "POLLIN", "SNDMORE", "has_input", "poll_in", "recv_parts", "send_parts"]

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_zmq_poll = zmq.zmq_poll
# The backend's send: pyzmq's Socket.send wraps it in a Python method (for DRAFT sockets'
# routing_id and group) that costs four times the send of a small frame itself.
_send = zmq.backend.Socket.send


def send_parts(sock: zmq.Socket, parts: Sequence[Any], copy: bool = True, flags: int = 0) -> None:
    """``sock.send_multipart(parts, flags, copy=copy)``."""
    more = flags | SNDMORE
    last = len(parts) - 1
    for i, part in enumerate(parts):
        _send(sock, part, more if i < last else flags, copy)


def recv_parts(sock: zmq.Socket, copy: bool = True) -> list[Any]:
    """``sock.recv_multipart(copy=copy)``: bytes, or zmq Frames when not ``copy``."""
    recv = sock.recv
    frame = recv(copy=False)
    parts = [frame.bytes if copy else frame]
    while frame.more:
        frame = recv(copy=False)
        parts.append(frame.bytes if copy else frame)
    return parts


def poll_in(socks: Sequence[zmq.Socket], timeout_ms: int | None) -> list[zmq.Socket]:
    """The sockets of ``socks`` with a message to read, waiting up to ``timeout_ms``
    (None: forever)."""
    ready = _zmq_poll([(s, POLLIN) for s in socks], -1 if timeout_ms is None else timeout_ms)
    return [s for s, events in ready if events & POLLIN]


def has_input(sock: zmq.Socket) -> bool:
    """Whether a message is queued on ``sock`` now (no waiting)."""
    events: int = sock.get(_EVENTS)  # type: ignore[assignment]  # an int option
    return bool(events & POLLIN)

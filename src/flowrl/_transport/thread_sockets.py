"""Each thread's zmq sockets to the hub's servers, handed on when the thread ends.

zmq sockets are not thread-safe, so each thread that talks to the hub has its own: one
to the controller and one per storage unit it talked to. When the thread ends (its
thread-local key is collected), its sockets go back to the client, and the next new
thread takes them over. A client used from any number of short-lived threads thus holds
the sockets of the most threads it ever had alive at once, not of every thread it saw.
A zmq socket may change threads given a memory barrier: the handover's lock is one.

Replies still queued on a handed-on socket answer the ended thread's requests; the next
owner reads them as strays (their request ids are not its own) and drops them.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
import weakref
from collections.abc import Callable

import zmq

__all__ = ["FDS_NEEDED", "IDLE_SETS", "ThreadSockets", "descriptors_left", "on_thread_end"]

#: Socket sets of ended threads kept for the next new threads; more are closed.
IDLE_SETS = 16
#: File descriptors a new socket needs to be sure of: its own two (a mailbox, and the
#: connection zmq's I/O thread opens later, failing silently if it cannot) and a margin
#: for what the process opens meanwhile.
FDS_NEEDED = 2 + 8

#: A thread's sockets, by server (None: the controller; an int: that storage unit).
Sockets = dict[int | None, zmq.Socket]


class _Key:
    """A thread's key, kept in its locals and collected with them when it ends."""

    __slots__ = ("__weakref__",)


def on_thread_end(local: threading.local, callback: Callable[[], None]) -> None:
    """Call ``callback`` (once) when the thread calling this ends: its locals in
    ``local`` are then collected, and with them a key kept there for this call."""
    key = _Key()
    setattr(local, f"end_key_{id(key)}", key)
    weakref.finalize(key, callback)


def descriptors_left() -> int | None:
    """How many more file descriptors this process may open (None: no limit, or unknown
    on this platform)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError as exc:  # (listing needs a descriptor too)
        return 0 if exc.errno in (errno.EMFILE, errno.ENFILE) else None


class ThreadSockets:
    """The sockets of every thread of one client; ``make(server)`` opens a new one."""

    def __init__(self, make: Callable[[int | None], zmq.Socket]) -> None:
        self._make = make
        self._local = threading.local()
        self._lock = threading.Lock()
        self._idle: list[Sockets] = []  # sets of ended threads, for new threads
        self._all: set[zmq.Socket] = set()  # every open socket, closed with the client
        self._closed = False

    def get(self, server: int | None) -> zmq.Socket:
        """The calling thread's socket to ``server`` (opened on first use)."""
        socks: Sockets | None = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = self._adopt()
        sock = socks.get(server)
        if sock is None:
            sock = self._make(server)
            with self._lock:
                self._all.add(sock)
            socks[server] = sock
        return sock

    def _adopt(self) -> Sockets:
        """A new thread's sockets: an ended thread's, else none yet."""
        with self._lock:
            socks = self._idle.pop() if self._idle else {}
        on_thread_end(self._local, lambda: self._ended(socks))
        return socks

    def _ended(self, socks: Sockets) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_SETS:
                self._idle.append(socks)
                return
            for sock in socks.values():
                self._all.discard(sock)
        for sock in socks.values():
            sock.close(linger=0)

    def open_count(self) -> int:
        """How many sockets the client holds open."""
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._all, self._idle = list(self._all), set(), []
        for sock in socks:
            sock.close(linger=0)

"""Put payloads written straight into a storage unit's shared memory (same machine).

A large put over zmq used to cost four copies of its bytes: into the socket, out of it,
into the unit's shared memory (where reads find them in place), and the kernel's in
between. Instead, a unit on this machine lends each client thread a stretch of its
arena (``wire.Grant``, ``GRANT_BYTES`` at a time); the thread copies a put's buffers
there once, in order, and the write names where they lie (``Write.refs``) instead of
carrying them. The unit builds its arrays over those bytes as they are: one copy in all,
and the socket carries a few hundred bytes. A lane locks its segment against reuse
(``shm.lock_lent``): a write into a grant the unit let go lands in bytes no sample uses,
never in a reused segment. The mappings outlive the lanes (``_WriteMaps``): a unit reuses
its segments under new names, and mapping 64 MiB again cost 8-15 ms, plus as much to
unmap it, for every 64 MiB put.

Each lent byte is written once (the thread moves on, and the unit refuses a write naming
bytes before the last one named), so stored arrays never change under a reader. A unit
keeps a client socket's latest grant only, and lets go of one idle for ``GRANT_IDLE_S``
(a dead client's would keep its segment); a client asks anew after half that. The
segments are the unit's: mode 0600, mapped only by processes of the same user, which
could write each other's memory anyway. Where a unit lends nothing (no ``/dev/shm``, no
room, another machine), puts send frames as before.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from flowrl._store.shm import SHM_MIN_BYTES, SegmentGone, ShmUnavailable, lock_lent, map_apart
from flowrl._transport import wire
from flowrl._transport.session import Session

__all__ = ["GRANT_BYTES", "GRANT_IDLE_S", "Lanes", "Lent"]

#: Shared memory a unit lends a client thread at a time (more for a larger put).
GRANT_BYTES = 16 << 20
#: A unit lets go of a grant no write named for this long (its client may be gone: the
#: grant keeps its segment); a client asks for a new one after half of it.
GRANT_IDLE_S = 60.0
#: Segments a client keeps mapped for writing beyond those its lanes use (address space
#: only, and their page tables: 128 KiB for 64 MiB; a unit reuses its handful in turn).
WRITE_MAPS = 16
_ALIGN = 64  # each buffer starts on a cache line


class _Lane:
    """A thread's current grant on one unit: the mapped segment, the bytes left, and the
    descriptor whose lock keeps the unit from reusing the segment (closed with the lane)."""

    __slots__ = ("__weakref__", "end", "grant", "next", "path", "used", "view")

    def __init__(self, grant: wire.Granted, seg: mmap.mmap, lock: int) -> None:
        self.grant = grant.grant
        self.path = grant.path
        self.view = memoryview(seg)
        self.next = grant.offset  # segment offset of the first free byte
        self.end = grant.offset + grant.size
        self.used = time.monotonic()
        weakref.finalize(self, os.close, lock)


class Lent(NamedTuple):
    """A put's buffers copied into lent memory: the Write fields that name them
    (``grant``, ``refs``), the copies (views of the segment), and the lane whose lock keeps
    the unit from reusing the segment: the copies stay the put's bytes while it is held."""

    fields: dict[str, Any]
    copies: list[memoryview]
    lane: _Lane


class _WriteMaps:
    """A client's writable mappings of its units' segments, by file (device, inode), the
    ``WRITE_MAPS`` most recently used kept beyond their lanes. Only a lane's lock keeps a
    unit from reusing a segment; a mapping without a lane is never written through. A
    mapping of a file the unit deleted is let go (it would keep the memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[tuple[int, int], tuple[mmap.mmap, int]] = (
            collections.OrderedDict()
        )

    def of(self, lock: int) -> mmap.mmap:
        """The mapping of the segment open (and locked) at ``lock``."""
        info = os.fstat(lock)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            for old in [k for k, (_, fd) in self._maps.items() if os.fstat(fd).st_nlink == 0]:
                os.close(self._maps.pop(old)[1])
            found = self._maps.get(key)
            if found is not None:
                self._maps.move_to_end(key)
                return found[0]
        seg, fd = map_apart(lock)
        with self._lock:
            self._maps[key] = (seg, fd)
            while len(self._maps) > WRITE_MAPS:  # (a lane still using one keeps it mapped)
                os.close(self._maps.popitem(last=False)[1][1])
        return seg

    def close(self) -> None:
        with self._lock:
            for _, fd in self._maps.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._maps.clear()


class Lanes:
    """Each thread's lanes to the units of a session (``lend``: write a put's buffers
    there, or None where the unit lends nothing)."""

    def __init__(
        self,
        session: Session,
        same_machine: Sequence[bool],
        before_grant: Callable[[], None] = lambda: None,
    ) -> None:
        self._session = session
        self._before_grant = before_grant
        self._usable = list(same_machine)  # per unit: False once it lent nothing
        self._local = threading.local()
        self._maps = _WriteMaps()

    def lend(self, unit: int, buffers: Sequence[Any]) -> Lent | None:
        """Copy ``buffers`` into memory ``unit`` lent this thread: the Write fields that
        name them and the copies; or None: send them as frames (small, or the unit lends
        nothing)."""
        if not self._usable[unit]:
            return None
        views = [_bytes_of(buf) for buf in buffers]
        total = sum(-(-v.nbytes // _ALIGN) * _ALIGN for v in views)
        if total < SHM_MIN_BYTES:
            return None
        lane = self._lane(unit, total)
        if lane is None:
            return None
        refs, copies = [], []
        at, base, dest = lane.next, lane.next, lane.view
        for view in views:
            size = view.nbytes
            copy = dest[at : at + size]
            copy[:] = view
            copies.append(copy)
            refs.append(wire.ShmRef(lane.path, at, size))
            at += -(-size // _ALIGN) * _ALIGN
        lane.next = base + total
        return Lent({"grant": lane.grant, "refs": refs}, copies, lane)

    def close(self) -> None:
        """Unmap every thread's lanes (the client closes: the segments can go)."""
        self._local = threading.local()
        self._usable = [False] * len(self._usable)
        self._maps.close()

    def _lane(self, unit: int, need: int) -> _Lane | None:
        lanes: dict[int, _Lane] | None = getattr(self._local, "lanes", None)
        if lanes is None:
            lanes = self._local.lanes = {}
        lane = lanes.get(unit)
        now = time.monotonic()
        if lane is not None and lane.end - lane.next >= need and now - lane.used < GRANT_IDLE_S / 2:
            lane.used = now
            return lane
        self._before_grant()
        granted = self._session.call(unit, wire.Grant(size=max(GRANT_BYTES, need)))[0]
        if not isinstance(granted, wire.Granted) or granted.grant == 0:
            self._usable[unit] = False  # no shared memory there (or none left): frames
            lanes.pop(unit, None)
            return None
        lanes.pop(unit, None)  # (its lock goes with it)
        try:
            lock = lock_lent(granted.path)
        except SegmentGone:  # let go (and retired) before we locked it: frames this time
            return None
        except ShmUnavailable:  # another machine's (or user's) /dev/shm
            self._usable[unit] = False
            return None
        try:
            seg = self._maps.of(lock)
        except OSError:  # (no /proc to open it anew, no address space): frames
            os.close(lock)
            self._usable[unit] = False
            return None
        lane = lanes[unit] = _Lane(granted, seg, lock)
        return lane


def _bytes_of(buf: Any) -> memoryview:
    """A buffer's bytes, flat."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")

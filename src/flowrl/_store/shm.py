"""A storage unit's shared-memory arena: clients on the same machine read bytes in place.

A unit launched by ``flowrl.launch_hub`` copies each payload buffer it stores (of at least
``SHM_MIN_BYTES``) into the current *segment*: a file in the unit's folder under
``/dev/shm``, mapped in memory and bump-allocated. A read then answers with where the
bytes are (:class:`ShmRef`: segment, offset, size) instead of the bytes, and the client
maps the segment read-only and builds its arrays over it: no copy on either side and
nothing on the socket but the offsets, so a read costs about one small round trip.

Lifetime without reference counting: the arena keeps only the segment it fills; a full
segment is kept alive by the arrays built over it, and when the last of them is gone its
memory is unmapped and its file unlinked (``weakref.finalize``). Segment names carry a
random token of the unit's incarnation and a segment's bytes are never rewritten, so a
name always means the same bytes: a client that still maps an unlinked segment reads the
same samples' old bytes, never another sample's. Without ``/dev/shm``, or without room in
it, buffers stay in the process heap and reads send them over the socket as before.

Leftovers. An arena's ``owner`` file names the process that fills it (pid and start
time, so a reused pid is not taken for it). A unit killed with SIGKILL cannot remove its
arena: the launcher removes it when it sees the unit die (``launch_hub``), and every new
arena first removes those whose owner is gone (:func:`sweep_dead_arenas`), whoever
launched them.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import mmap
import os
import secrets
import shutil
import stat
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from flowrl.errors import TransportError, UnknownIndexError

__all__ = [
    "SHM_MIN_BYTES",
    "SHM_PREFIX",
    "Placed",
    "ShmArena",
    "ShmMaps",
    "ShmUnavailable",
    "map_lent",
    "shm_folder",
    "sweep_dead_arenas",
]

#: Buffers below this travel as zmq frames anyway (a frame is cheaper than a mapping).
SHM_MIN_BYTES = 64 * 1024
#: Every arena lives under this prefix; clients map nothing else.
SHM_PREFIX = "/dev/shm/flowrl-"
#: Segments grow from FIRST_SEGMENT_BYTES by doubling up to SEGMENT_BYTES (a small hub
#: does not reserve 64 MiB of shared memory for its first few reads).
FIRST_SEGMENT_BYTES = 4 << 20
SEGMENT_BYTES = 64 << 20
_ALIGN = 64  # cache-line aligned buffers
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
OWNER_FILE = "owner"  # "<pid> <start time>" of the process filling the arena


def shm_folder(name: str) -> str | None:
    """The arena folder for ``name``, or None where this machine has no ``/dev/shm``."""
    return f"{SHM_PREFIX}{name}" if os.path.isdir("/dev/shm") else None


class Placed(NamedTuple):
    """Bytes copied into an arena: a view of them, and the segment and offset they lie at."""

    view: memoryview
    path: str
    offset: int


class _Segment:
    __slots__ = ("base", "map", "path", "size", "used")

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            self.map = mmap.mmap(fd, size, flags=_MAP_FLAGS)  # pages mapped now, not per write
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.used = 0
        self.base = int(np.frombuffer(self.map, dtype=np.uint8, count=1).ctypes.data)


class ShmArena:
    """Bump-allocated segments in ``folder`` (created, and emptied of a dead incarnation's
    segments). One thread copies in; a segment may be forgotten from any thread (the one
    that drops its last array, e.g. zmq's, after a zero-copy send), hence the lock."""

    def __init__(
        self,
        folder: str,
        segment_bytes: int = SEGMENT_BYTES,
        first_segment_bytes: int = FIRST_SEGMENT_BYTES,
        *,
        spare: bool = False,
    ) -> None:
        if not folder.startswith(SHM_PREFIX):
            raise ValueError(f"an arena folder must start with {SHM_PREFIX!r}, got {folder!r}")
        sweep_dead_arenas()
        shutil.rmtree(folder, ignore_errors=True)  # a dead incarnation's segments
        os.makedirs(folder, mode=0o700)
        _write_owner(folder)
        self.folder = folder
        self.segment_bytes = segment_bytes
        self._next_size = min(first_segment_bytes, segment_bytes)
        self._token = secrets.token_hex(6)
        self._count = 0
        self._current: _Segment | None = None
        self._lock = threading.Lock()
        self._bases: list[int] = []  # sorted start addresses of the live segments
        self._live: dict[int, tuple[str, int]] = {}  # base -> (path, size)
        # With ``spare``, the next segment is made by a thread while this one fills:
        # making one (allocating and mapping every page of up to 64 MiB) took 80-340 ms
        # on a loaded machine, inside the put that found the current segment full.
        self._spare: _Spare | None = _Spare() if spare else None

    def copy_in(self, data: Any) -> Placed | None:
        """A copy of ``data`` in shared memory, and where it lies; None if there is no room."""
        with memoryview(data) as src:
            placed = self.allocate(src.nbytes)
            if placed is not None:
                placed.view[:] = src.cast("B")
        return placed

    def allocate(self, size: int) -> Placed | None:
        """``size`` fresh bytes of one segment, never handed out before (a client on this
        machine writes a put's payload there itself: see ``unit_server``'s grants); None
        if there is no room. The view keeps the segment alive."""
        seg = self._current
        if seg is None or seg.size - seg.used < size:
            seg = self._new_segment(size)
            if seg is None:
                return None
        start = seg.used
        seg.used = -(-(start + size) // _ALIGN) * _ALIGN
        return Placed(memoryview(seg.map)[start : start + size], seg.path, start)

    def locate(self, address: int, size: int) -> tuple[str, int] | None:
        """(segment path, offset) of ``size`` bytes at ``address`` if the arena holds them."""
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            if i < 0:
                return None
            base = self._bases[i]
            path, seg_size = self._live[base]
        offset = address - base
        return (path, offset) if offset + size <= seg_size else None

    def close(self) -> None:
        self._current = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def _new_segment(self, size: int) -> _Segment | None:
        size = max(self._next_size, -(-size // _ALIGN) * _ALIGN)
        seg = None if self._spare is None else self._spare.take(size)
        if seg is None:
            try:
                seg = _Segment(self._next_path(), size)
            except OSError:  # no room in /dev/shm (or it went away): keep bytes in the heap
                return None
        self._next_size = min(2 * self._next_size, self.segment_bytes)
        if self._spare is not None:
            self._spare.make(self._next_path(), self._next_size)
        with self._lock:
            # A dead segment may have been unmapped at this address before its finalizer
            # ran (CPython unmaps first): the new one takes its entry over.
            if seg.base not in self._live:
                bisect.insort(self._bases, seg.base)
            self._live[seg.base] = (seg.path, seg.size)
        weakref.finalize(seg.map, self._forget, seg.base, seg.path)
        self._current = seg  # the arena holds only this one; arrays hold the others
        return seg

    def _next_path(self) -> str:
        self._count += 1
        return f"{self.folder}/{self._token}-{self._count}"

    def _forget(self, base: int, path: str) -> None:
        """The segment's memory is gone (no array uses it any more): drop its file."""
        with self._lock:
            if self._live.get(base, ("",))[0] == path:  # not taken over by a newer one
                del self._live[base]
                self._bases.remove(base)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _Spare:
    """The arena's next segment, made by a thread while the current one fills."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._made: _Segment | None = None

    def make(self, path: str, size: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._make, args=(path, size), name="flowrl-shm-spare", daemon=True
            )
            self._thread.start()

    def _make(self, path: str, size: int) -> None:
        with contextlib.suppress(OSError):  # no room: the arena makes one when it must
            self._made = _Segment(path, size)

    def take(self, size: int) -> _Segment | None:
        """The spare segment if it holds ``size`` bytes (waiting for it: it is further
        along than a new one would be); None if there is none or it is too small."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, made, self._made = None, self._made, None
        if made is not None and made.size < size:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made.path)
            return None
        return made


def sweep_dead_arenas() -> list[str]:
    """Remove the arenas whose owner process is gone (e.g. a unit killed by SIGKILL);
    returns their folders. Arenas without an owner file (being created) are left alone."""
    removed = []
    for folder in glob.glob(SHM_PREFIX + "*"):
        try:
            with open(os.path.join(folder, OWNER_FILE)) as f:
                pid, start = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            continue  # no owner (yet), or not ours to judge
        if not _alive(pid, start):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _write_owner(folder: str) -> None:
    pid = os.getpid()
    tmp = os.path.join(folder, OWNER_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{pid} {_start_time(pid)}")
    os.replace(tmp, os.path.join(folder, OWNER_FILE))  # never seen half written


def _start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot; 0 where /proc is missing),
    -1 for a zombie (killed, not yet reaped: gone for our purpose)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rindex(b")") + 2 :].split()  # from field 3 (state), after "(comm)"
    return -1 if fields[0] == b"Z" else int(fields[19])  # field 22: starttime


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = _start_time(pid)
    return now != -1 and (start == 0 or now in (start, 0))


def map_lent(path: str) -> mmap.mmap:
    """A storage unit's segment mapped for writing: the bytes the unit lent this client
    (``unit_server``'s grants). Only a regular file of this user under ``SHM_PREFIX``;
    ShmUnavailable otherwise (another machine's /dev/shm, another user's unit)."""
    if not path.startswith(SHM_PREFIX) or os.path.normpath(path) != path:
        raise ShmUnavailable(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        raise ShmUnavailable(path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ShmUnavailable(path)
        return mmap.mmap(fd, 0, flags=_MAP_FLAGS)  # pages mapped once, not per write
    except (OSError, ValueError):
        raise ShmUnavailable(path) from None
    finally:
        os.close(fd)


class ShmUnavailable(Exception):
    """The unit's shared memory cannot be mapped here (another container's /dev/shm, or
    another user's unit): read over zmq instead."""


class ShmMaps:
    """A client's read-only mappings of storage units' segments, by path."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def buffers(self, refs: list[Any], frames: list[Any], unit: int) -> list[Any]:
        """The buffers a shm read answered: in place where ``refs`` names one, else the
        next frame's."""
        out: list[Any] = []
        rest = iter(frames)
        for ref in refs:
            if ref is not None:
                out.append(self._view(ref, unit))
                continue
            frame = next(rest, None)
            if frame is None:
                raise TransportError(f"storage unit {unit} sent fewer frames than it named")
            out.append(frame.buffer)
        if next(rest, None) is not None:
            raise TransportError(f"storage unit {unit} sent more frames than it named")
        return out

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()  # arrays still built over a segment keep it mapped

    def _view(self, ref: Any, unit: int) -> memoryview:
        seg = self._maps.get(ref.path)
        if seg is None:
            seg = self._open(ref.path, unit)
        if ref.offset + ref.size > len(seg):
            raise TransportError(f"storage unit {unit} named bytes past the end of {ref.path}")
        return memoryview(seg)[ref.offset : ref.offset + ref.size]

    def _open(self, path: str, unit: int) -> mmap.mmap:
        if not path.startswith(SHM_PREFIX) or os.path.normpath(path) != path:
            raise TransportError(f"storage unit {unit} named {path!r}, not one of its segments")
        try:
            fd = os.open(path, os.O_RDONLY)
        except PermissionError:  # another user's unit (its segments are private)
            raise ShmUnavailable(path) from None
        except FileNotFoundError:
            if not os.path.isdir(os.path.dirname(path)):
                raise ShmUnavailable(path) from None  # not this machine's /dev/shm
            raise UnknownIndexError(
                f"samples read from storage unit {unit} were evicted while being read"
            ) from None
        except OSError as exc:
            raise TransportError(f"cannot open storage unit {unit}'s {path}: {exc}") from None
        try:
            seg = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot map storage unit {unit}'s {path}: {exc}") from None
        finally:
            os.close(fd)
        with self._lock:
            # Forget segments unlinked since (no stored sample uses them any more).
            for gone in [p for p in self._maps if not os.path.exists(p)]:
                del self._maps[gone]
            self._maps[path] = seg
        return seg

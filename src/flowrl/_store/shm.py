"""A storage unit's shared-memory arena: clients on the same machine read bytes in place.

A unit launched by ``flowrl.launch_hub`` copies each payload buffer it stores (of at least
``SHM_MIN_BYTES``) into the current *segment*: a file in the unit's folder under
``/dev/shm``, mapped in memory and bump-allocated. A read then answers with where the
bytes are (:class:`ShmRef`: segment, offset, size) instead of the bytes, and the client
maps the segment read-only and builds its arrays over it: no copy on either side and
nothing on the socket but the offsets, so a read costs about one small round trip.

Lifetime without reference counting: the arena keeps only the segment it fills; a full
segment is kept alive by the arrays built over it (its *epoch*), and when the last of them
is gone it is retired: renamed to a free name, so no client can open it by its old name,
and kept for reuse. Making a segment costs most of a put (allocating, zeroing and mapping
64 MiB took 80-110 ms against 14-20 ms to write it), so the arena reuses a retired one
when no client still maps it, under a new name: each client holds a shared ``flock`` on
every segment it maps (for as long as the mapping lives) and checks after taking it that
the name still means the file it opened; the arena reuses only a segment it can lock
exclusively. A name thus always means the same bytes for whoever maps it: a client that
still maps a retired segment reads the same samples' old bytes, never another sample's.
Free segments beyond ``free_bytes`` are deleted. Without ``/dev/shm``, or without room
in it, buffers stay in the process heap and reads send them over the socket as before.

Leftovers. An arena's ``owner`` file names the process that fills it (pid and start
time, so a reused pid is not taken for it). A unit killed with SIGKILL cannot remove its
arena: the launcher removes it when it sees the unit die (``launch_hub``), and every new
arena first removes those whose owner is gone (:func:`sweep_dead_arenas`), whoever
launched them.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import fcntl
import glob
import itertools
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
    "SegmentGone",
    "ShmArena",
    "ShmMaps",
    "ShmUnavailable",
    "lock_lent",
    "map_apart",
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
#: Retired segments an arena keeps for reuse, in bytes (the rest are deleted).
FREE_BYTES = 1 << 30
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
    """A segment file, mapped; ``fd`` stays open: the arena locks it to reuse the file."""

    __slots__ = ("base", "fd", "map", "path", "size", "used")

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            self.map = mmap.mmap(fd, size, flags=_MAP_FLAGS)  # pages mapped now, not per write
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.fd = fd
        self.path = path
        self.size = size
        self.used = 0
        self.base = int(np.frombuffer(self.map, dtype=np.uint8, count=1).ctypes.data)

    def rename(self, path: str) -> None:
        os.rename(self.path, path)
        self.path = path

    def discard(self) -> None:
        """Delete the file (clients that still map it keep their pages). The map goes with
        the last reference to it: an array dying may still hold it while its epoch's
        finalizer runs."""
        os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ShmArena:
    """Bump-allocated segments in ``folder`` (created, and emptied of a dead incarnation's
    segments). One thread uses it (the unit's); a segment's epoch may end in any thread
    (the one that drops its last array, e.g. zmq's, after a zero-copy send, or a garbage
    collection pass), so retiring takes no lock: it renames the segment and queues it for
    the arena's thread."""

    def __init__(
        self,
        folder: str,
        segment_bytes: int = SEGMENT_BYTES,
        first_segment_bytes: int = FIRST_SEGMENT_BYTES,
        *,
        spare: bool = False,
        free_bytes: int = FREE_BYTES,
    ) -> None:
        if not folder.startswith(SHM_PREFIX):
            raise ValueError(f"an arena folder must start with {SHM_PREFIX!r}, got {folder!r}")
        sweep_dead_arenas()
        shutil.rmtree(folder, ignore_errors=True)  # a dead incarnation's segments
        os.makedirs(folder, mode=0o700)
        _write_owner(folder)
        self.folder = folder
        self.segment_bytes = segment_bytes
        self.free_bytes = free_bytes
        self._next_size = min(first_segment_bytes, segment_bytes)
        self._token = secrets.token_hex(6)
        self._names = itertools.count(1)  # (next() is atomic: retiring threads use it too)
        # The segment being filled and its epoch's view (the arena's reference to it).
        self._current: tuple[_Segment, memoryview] | None = None
        self._closed = False
        self._bases: list[int] = []  # sorted start addresses of the segments in use
        self._live: dict[int, tuple[str, int]] = {}  # base -> (path, size)
        self._retired: collections.deque[_Segment] = collections.deque()  # from any thread
        self._free: list[_Segment] = []  # retired, oldest first
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
        """``size`` bytes of one segment, not handed out in its current epoch (a client on
        this machine writes a put's payload there itself: see ``unit_server``'s grants);
        None if there is no room. The view keeps the segment's epoch alive."""
        current = self._current
        if current is None or current[0].size - current[0].used < size:
            current = self._next_segment(size)
            if current is None:
                return None
        seg, view = current
        start = seg.used
        seg.used = -(-(start + size) // _ALIGN) * _ALIGN
        return Placed(view[start : start + size], seg.path, start)

    def locate(self, address: int, size: int) -> tuple[str, int] | None:
        """(segment path, offset) of ``size`` bytes at ``address`` if the arena holds them."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            return None
        base = self._bases[i]
        path, seg_size = self._live[base]
        offset = address - base
        return (path, offset) if offset + size <= seg_size else None

    def close(self) -> None:
        self._closed = True  # (segments retired from now on are discarded at once)
        self._current = None
        self._take_retired()
        for seg in self._free:
            seg.discard()
        self._free = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def _next_segment(self, size: int) -> tuple[_Segment, memoryview] | None:
        self._take_retired()
        seg = self._reuse(size)
        if seg is None:
            seg = self._new_segment(size)
            if seg is None:
                return None
        if self._spare is not None and not self._free:
            self._spare.make(self._next_path(), self._next_size)
        epoch = np.frombuffer(seg.map, dtype=np.uint8)  # the arrays built from now on
        weakref.finalize(epoch, self._retire, seg)
        bisect.insort(self._bases, seg.base)
        self._live[seg.base] = (seg.path, seg.size)
        self._current = (seg, epoch.data)  # the arena holds only this epoch
        return self._current

    def _reuse(self, size: int) -> _Segment | None:
        """A retired segment of at least ``size`` bytes that no client maps, renamed: the
        newest first (its pages are the likeliest in caches, and clients keep the
        mappings of the few they wrote last)."""
        for i in range(len(self._free) - 1, -1, -1):
            seg = self._free[i]
            if seg.size < size:
                continue
            try:
                fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a client still maps it (and may read it)
            try:
                seg.rename(self._next_path())
            except OSError:
                continue  # (the folder went away: the segment is discarded on close)
            finally:
                fcntl.flock(seg.fd, fcntl.LOCK_UN)
            del self._free[i]
            seg.used = 0
            return seg
        return None

    def _new_segment(self, size: int) -> _Segment | None:
        size = max(self._next_size, -(-size // _ALIGN) * _ALIGN)
        seg = None if self._spare is None else self._spare.take(size)
        if seg is None:
            try:
                seg = _Segment(self._next_path(), size)
            except OSError:  # no room in /dev/shm (or it went away): keep bytes in the heap
                return None
        self._next_size = min(2 * self._next_size, self.segment_bytes)
        return seg

    def _next_path(self) -> str:
        return f"{self.folder}/{self._token}-{next(self._names)}"

    def _retire(self, seg: _Segment) -> None:
        """No array uses the segment any more (its epoch's finalizer, in any thread):
        rename it, so no client opens it by its old name from now on (clients that map
        it let go when they see the name gone), and queue it to be reused."""
        if self._closed:
            seg.discard()
            return
        try:
            seg.rename(f"{self.folder}/free-{next(self._names)}")
        except OSError:
            seg.discard()  # (the arena is closing: its folder went away)
            return
        self._retired.append(seg)

    def _take_retired(self) -> None:
        """Move the segments retired since into the free list (the arena's thread), and
        delete the oldest free ones beyond ``free_bytes``."""
        while self._retired:
            seg = self._retired.popleft()
            del self._live[seg.base]
            self._bases.remove(seg.base)
            if self._closed:
                seg.discard()
            else:
                self._free.append(seg)
        while self._free and sum(s.size for s in self._free) > self.free_bytes:
            self._free.pop(0).discard()


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
            made.discard()
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


def lock_lent(path: str) -> int:
    """A storage unit's segment that it lent this client to write (``unit_server``'s
    grants), open and locked against reuse until the descriptor returned is closed
    (module docstring). Only a regular file of this user under ``SHM_PREFIX``;
    ShmUnavailable otherwise (another machine's /dev/shm, another user's unit),
    SegmentGone if the unit retired it meanwhile (a grant let go before its client
    locked it)."""
    if not path.startswith(SHM_PREFIX) or os.path.normpath(path) != path:
        raise ShmUnavailable(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        if os.path.isdir(os.path.dirname(path)):
            raise SegmentGone(path) from None
        raise ShmUnavailable(path) from None
    except OSError:
        raise ShmUnavailable(path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ShmUnavailable(path)
        _lock_named(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_apart(fd: int) -> tuple[mmap.mmap, int]:
    """A writable mapping of the file open at ``fd`` that does not hold ``fd``'s lock (a
    mapping keeps its descriptor's lock for its life; this one opens the file anew), and
    the descriptor it keeps (``st_nlink`` 0: the unit deleted the file)."""
    apart = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a new open file, whatever its name now
    try:
        return mmap.mmap(apart, 0, flags=_MAP_FLAGS), apart  # pages mapped once, not per write
    except BaseException:
        os.close(apart)
        raise


def _lock_named(fd: int, path: str) -> None:
    """Lock the segment open at ``fd`` against reuse (shared: many clients map it), then
    check ``path`` still names it: an arena renames a segment it retires before it tries
    to reuse it. SegmentGone if not."""
    fcntl.flock(fd, fcntl.LOCK_SH)  # an arena holds it exclusively only while renaming
    try:
        named = os.stat(path)
    except FileNotFoundError:
        raise SegmentGone(path) from None
    opened = os.fstat(fd)
    if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
        raise SegmentGone(path)


class ShmUnavailable(Exception):
    """The unit's shared memory cannot be mapped here (another container's /dev/shm, or
    another user's unit): read over zmq instead."""


class SegmentGone(ShmUnavailable):
    """The unit retired the segment (none of its bytes are stored any more)."""


class ShmMaps:
    """A client's read-only mappings of storage units' segments, by path: each lives as
    long as an array built over it, and the one opened last of each unit (the next read
    likely names it again) until a newer one is opened. A mapping holds its segment's lock
    (module docstring): a client idle between reads keeps no segment from being reused
    but those its arrays use and one per unit."""

    def __init__(self) -> None:
        self._maps: weakref.WeakValueDictionary[str, mmap.mmap] = weakref.WeakValueDictionary()
        self._latest: dict[int, tuple[str, mmap.mmap]] = {}  # per unit
        self._lock = threading.Lock()

    def buffers(self, refs: list[Any], frames: list[Any], unit: int) -> list[Any]:
        """The buffers a shm read answered: in place where ``refs`` names one, else the
        next frame's."""
        self.forget_retired()
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
            self._latest.clear()  # arrays still built over a segment keep it mapped
            self._maps.clear()

    def forget_retired(self) -> None:
        """Let go of the latest segments their unit retired (renamed: no stored sample
        uses them): once no array of ours uses one either, its lock goes."""
        with self._lock:
            for unit in [u for u, (p, _) in self._latest.items() if not os.path.exists(p)]:
                del self._latest[unit]

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
            raise _evicted(unit) from None
        except OSError as exc:
            raise TransportError(f"cannot open storage unit {unit}'s {path}: {exc}") from None
        try:
            _lock_named(fd, path)
            seg = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except SegmentGone:
            raise _evicted(unit) from None
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot map storage unit {unit}'s {path}: {exc}") from None
        finally:
            os.close(fd)  # the map holds a duplicate, and with it the lock
        with self._lock:
            self._maps[path] = seg
            self._latest[unit] = (path, seg)
        return seg


def _evicted(unit: int) -> UnknownIndexError:
    return UnknownIndexError(f"samples read from storage unit {unit} were evicted while being read")

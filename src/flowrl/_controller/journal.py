"""The controller's write-ahead journal: its event log, appended to a file.

Each record is a little-endian ``uint32`` length followed by one msgpack-encoded event
(:mod:`flowrl.events`), in ``seq`` order. Records are written with one ``os.write`` each,
so an event is in the operating system's hands before the call that caused it returns:
a crashed process loses nothing. A record torn by a crash mid-write (or a power loss) is
detected on reading by its length or its decoding, and cut off.

``journal.json`` beside it records the table's shape; a hub refuses to recover a journal
written with another capacity or number of storage units.

Compaction. Once the log holds ``JournalConfig.compact_bytes`` (and an eighth of the last
snapshot: ``_SNAPSHOT_SHARE``), :meth:`Journal.compact` writes the controller's state to
``snapshot.msgpack`` (``flowrl._controller.snapshot``; written aside, fsynced, renamed over
the old one) and then replaces the log by an empty one the same way. Recovery restores
the snapshot and replays the events after it; a crash between the two renames leaves a
log whose events the snapshot already holds, and they are skipped by their ``seq``. The
controller's owner calls ``compact`` between two operations (``compaction_due`` says when).

One process at a time owns a journal folder: a ``FolderLock`` (``flowrl._folder_lock``)
holds an exclusive ``flock`` on its ``lock`` file from before recovery until the journal
is closed, or the process dies. A second opener is refused with the folder and the
holder's pid: two controllers on one journal would each deliver its samples.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec

from flowrl._config import HubConfig, JournalConfig
from flowrl._controller.snapshot import restore, snapshot_of
from flowrl._folder_lock import FolderLock
from flowrl.errors import ConfigError, JournalError
from flowrl.events import Event, event_decoder, event_encoder

if TYPE_CHECKING:
    from flowrl._controller.controller import Controller

__all__ = [
    "Journal",
    "JournalHeader",
    "attach_journal",
    "lock_journal",
    "read_journal",
]

_LEN = struct.Struct("<I")
EVENTS_FILE = "events.log"
HEADER_FILE = "journal.json"
SNAPSHOT_FILE = "snapshot.msgpack"
#: Replaying a byte of log costs 50-100x restoring a byte of snapshot (benchmarks/journal.py
#: ``restart``), so the log may grow to only this fraction of the snapshot before the next
#: one: a restart stays short even for a big live state, while each snapshot's cost is
#: spread over the operations that wrote the log (a few percent of the controller's time).
_SNAPSHOT_SHARE = 8


class JournalHeader(msgspec.Struct, frozen=True):
    capacity: int
    n_units: int
    format: int = 1


class Journal:
    """Appends events to ``<path>/events.log`` under a sync policy; owns the folder's lock."""

    def __init__(self, config: JournalConfig, header: JournalHeader, lock: FolderLock) -> None:
        os.makedirs(config.path, exist_ok=True)
        _check_header(config.path, header)
        self.config = config
        self.lock = lock
        self._events = os.path.join(config.path, EVENTS_FILE)
        self._fd = os.open(self._events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._logged = os.fstat(self._fd).st_size  # bytes of log since the last snapshot
        snapshot = os.path.join(config.path, SNAPSHOT_FILE)
        self._snapshot_bytes = os.path.getsize(snapshot) if os.path.exists(snapshot) else 0
        self.compactions = 0
        self._dirty = False
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if config.sync == "write":
            self._syncer = threading.Thread(
                target=self._sync_loop, name="flowrl-journal", daemon=True
            )
            self._syncer.start()

    def append(self, event: Event) -> None:
        if self._fd < 0:  # never write to a descriptor number the OS may have reused
            raise JournalError(f"the journal in {self.config.path!r} is closed")
        payload = event_encoder.encode(event)
        os.write(self._fd, _LEN.pack(len(payload)) + payload)
        self._logged += _LEN.size + len(payload)
        if self.config.sync == "fsync":
            os.fsync(self._fd)
        else:
            self._dirty = True

    @property
    def compaction_due(self) -> bool:
        return self._logged >= max(
            self.config.compact_bytes, self._snapshot_bytes // _SNAPSHOT_SHARE
        )

    def compact(self, controller: Controller) -> None:
        """Replace the log by a snapshot of ``controller`` (under its lock, between two
        operations: see the module docstring)."""
        if self._fd < 0:
            raise JournalError(f"the journal in {self.config.path!r} is closed")
        data = snapshot_of(controller)
        _replace_durably(os.path.join(self.config.path, SNAPSHOT_FILE), data)
        fd = _replace_durably(self._events, b"", keep_open=True)
        old, self._fd = self._fd, fd
        os.close(old)
        self._logged = 0
        self._snapshot_bytes = len(data)
        self.compactions += 1

    def close(self) -> None:
        """Sync and close the file, then release the folder (idempotent)."""
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join(timeout=5)
        if self._fd >= 0:
            os.fsync(self._fd)
        self.abandon()

    def abandon(self) -> None:
        """Close the file and release the folder without syncing, as a process dies."""
        self._stop.set()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self.lock.release()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.config.fsync_interval):
            if self._dirty and self._fd >= 0:
                self._dirty = False
                with contextlib.suppress(OSError):  # closed meanwhile
                    os.fsync(self._fd)


def lock_journal(config: JournalConfig) -> FolderLock:
    """Take the journal folder for this process (before anything in it is read)."""
    return FolderLock(config.path, "the journal folder")


def attach_journal(
    controller: Controller, config: HubConfig, lock: FolderLock | None = None
) -> Journal:
    """Recover ``controller`` from ``config.journal`` (if it holds one), then journal it.

    ``lock``: the folder's lock if the caller took it already (``lock_journal``)."""
    if config.journal is None:
        raise ConfigError("attach_journal() needs a HubConfig with a journal")
    lock = lock or lock_journal(config.journal)
    try:
        header = JournalHeader(config.capacity, config.n_units)
        path = config.journal.path
        snapshot = os.path.join(path, SNAPSHOT_FILE)
        done = 0
        if os.path.exists(snapshot):
            _check_header(path, header)
            with open(snapshot, "rb") as f:
                done = restore(controller, f.read(), repr(snapshot))
        controller.recover(e for e in read_journal(path, header) if e.seq > done)
        journal = Journal(config.journal, header, lock)
    except BaseException:
        lock.release()
        raise
    controller.log.sinks.append(journal.append)
    return journal


def read_journal(path: str, header: JournalHeader) -> Iterator[Event]:
    """The events journaled under ``path`` (none if there is no journal yet).

    A torn last record is cut off the file, so appending can resume after it.
    """
    file = os.path.join(path, EVENTS_FILE)
    if not os.path.exists(file):
        return
    _check_header(path, header)
    with open(file, "rb") as f:
        data = f.read()
    view = memoryview(data)
    pos = 0
    good = 0
    while pos + _LEN.size <= len(data):
        (size,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + size
        if end > len(data):
            break
        try:
            event = event_decoder.decode(view[pos + _LEN.size : end])
        except msgspec.DecodeError as exc:
            if end == len(data):
                break  # a torn last record
            raise JournalError(
                f"record at byte {pos} of {file!r} is not a flowrl event ({exc}); the journal "
                "is corrupt or was written by an incompatible flowrl version"
            ) from None
        pos = good = end
        yield event
    if good < len(data):
        with open(file, "r+b") as f:
            f.truncate(good)


def _replace_durably(path: str, data: bytes, *, keep_open: bool = False) -> int:
    """Write ``data`` aside, fsync it, rename it over ``path`` and fsync the folder: after
    a crash the file holds the old content or the new, never a mix. ``keep_open``: return
    the new file's descriptor, opened for appending (else -1)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    if keep_open:
        return fd
    os.close(fd)
    return -1


def _check_header(path: str, header: JournalHeader) -> None:
    file = os.path.join(path, HEADER_FILE)
    if not os.path.exists(file):
        tmp = file + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(header))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
        return
    with open(file, "rb") as f:
        found = msgspec.json.decode(f.read(), type=JournalHeader)
    if found != header:
        raise ConfigError(
            f"the journal in {path!r} was written by a hub with capacity={found.capacity}, "
            f"n_units={found.n_units}; this hub has capacity={header.capacity}, "
            f"n_units={header.n_units}: start it with the same HubConfig or another path"
        )

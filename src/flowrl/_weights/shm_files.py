"""The files of a shared-memory weight channel: private to the user, reclaimed after a crash.

``/dev/shm`` is one folder for every user of the machine, so a channel's names carry the
user's id, and its files are opened so that nobody else's can stand in for them::

    flowrl-weights-u<uid>-<channel>.lock                 held by the live publisher
    flowrl-weights-u<uid>-<channel>.header               the newest version (msgspec)
    flowrl-weights-u<uid>-<channel>.<token>-<n>.arena    the tensors of one version
    flowrl-weights-u<uid>-<channel>.header.<token>.tmp   a header being written

A channel name has no ``.``, so the part before the first ``.`` names the channel
exactly. Files are created exclusively (``O_EXCL``) with mode 0600 and opened without
following links (``O_NOFOLLOW``); before a file is read or mapped its owner is checked
on the open descriptor (``fstat``), so a file another user planted is refused with a
:class:`~flowrl.errors.TransportError` naming it, never loaded.

Crash recovery: the publisher holds an exclusive ``flock`` on the channel's lock file for
its lifetime; the kernel drops it when the process dies, however it dies. A new publisher
that gets the lock therefore knows that every arena of the channel it did not make
belongs to a dead predecessor and removes them (:meth:`ChannelFiles.sweep`), keeping only
the one the header names until it publishes a version of its own (subscribers go on
reading the last version meanwhile).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from typing import final

from flowrl.errors import ConfigError, TransportError

__all__ = ["ChannelFiles", "open_private"]

PREFIX = "flowrl-weights-"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
#: what opening a name someone else took fails with: a link (ELOOP), another user's file
_SQUATTED = {errno.ELOOP, errno.EACCES, errno.EPERM, errno.EEXIST}


def open_private(path: str, flags: int, *, what: str) -> int:
    """Open ``path`` (never through a link) and check it is a regular file of this user;
    returns the descriptor. ``FileNotFoundError`` passes through."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno not in _SQUATTED:
            raise
        raise TransportError(
            f"weight channel {what} {path!r} cannot be opened ({exc.strerror}); a link or a "
            "file of another user stands there: remove it or use another channel name"
        ) from None
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TransportError(
            f"weight channel {what} {path!r} belongs to uid {info.st_uid}, expected a "
            f"regular file of uid {os.geteuid()} (this process); another user planted it: "
            "remove it (as its owner or root) or use another channel name"
        )
    return fd


@final
class ChannelFiles:
    """The paths of channel ``name`` of this user in ``folder``."""

    def __init__(self, name: str, folder: str) -> None:
        self.name = name
        self.folder = folder = os.path.abspath(folder)
        self.base = os.path.join(folder, f"{PREFIX}u{os.geteuid()}-{name}")
        self.header = f"{self.base}.header"
        self.lock = f"{self.base}.lock"
        stem = re.escape(os.path.basename(self.base))
        self._arena = re.compile(stem + r"\.[0-9a-f]+-[0-9]+\.arena")
        self._draft = re.compile(stem + r"\.header\.[0-9a-f]+\.tmp")

    def arena(self, token: str, count: int) -> str:
        return f"{self.base}.{token}-{count}.arena"

    def tmp_header(self, token: str) -> str:
        return f"{self.header}.{token}.tmp"

    def is_arena(self, path: str) -> bool:
        """Whether ``path`` names an arena of this channel (what a header may name)."""
        head, tail = os.path.split(path)
        return head == self.folder and self._arena.fullmatch(tail) is not None

    def lock_publisher(self) -> int:
        """Take the channel's publisher lock; returns its descriptor (held until
        :meth:`unlock_publisher`). Raises :class:`ConfigError` while another publisher of
        the channel is alive."""
        while True:
            fd = open_private(self.lock, os.O_RDWR | os.O_CREAT, what="lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ConfigError(
                    f"weight channel {self.name!r} already has a live publisher (pid {holder}, "
                    f"holding {self.lock!r}); close it first or use another channel name"
                ) from None
            # The previous holder may have unlinked the file between our open and our lock:
            # then we locked a file nobody else will find. Lock the one at the path.
            try:
                same = os.stat(self.lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                return fd
            os.close(fd)

    def unlock_publisher(self, fd: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock)  # (still locked: a new publisher retries on the new file)
        os.close(fd)

    def sweep(self, keep: str | None) -> int:
        """Remove this user's arenas and header drafts of the channel but ``keep`` (call
        it holding the publisher lock: their publisher is dead); returns how many."""
        removed = 0
        for entry in os.scandir(self.folder):
            path = entry.path
            if path == keep or not (
                self._arena.fullmatch(entry.name) or self._draft.fullmatch(entry.name)
            ):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_uid == os.geteuid():
                    os.unlink(path)
                    removed += 1
        return removed

"""An exclusive, per-process lock on a folder of durable state (a journal, a unit's files).

``flock`` on ``<folder>/lock``, the holder's pid written in it. The OS releases it when
the holder closes it or dies (SIGKILL included), so a supervisor's restart of a dead
server takes it again at once; a second live opener is refused with the holder's pid.
"""

from __future__ import annotations

import fcntl
import os

from flowrl.errors import JournalError

__all__ = ["FolderLock"]

LOCK_FILE = "lock"


class FolderLock:
    """An exclusive lock on a folder, held by this process until :meth:`release`."""

    def __init__(self, folder: str, what: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalError(
                f"{what} {folder!r} is in use by process {holder}; two hubs on one folder "
                "would each deliver its samples. Close that hub (or let its process end), or "
                "give this one another JournalConfig.path"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Let go (idempotent); the lock file stays, empty of meaning."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # closing the descriptor releases the flock

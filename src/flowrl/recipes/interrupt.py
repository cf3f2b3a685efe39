"""Ctrl-C that cannot be lost.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives. If
that is inside a finalizer (``__del__``, a ``weakref.finalize`` callback: numpy, torch,
mmap and the hub's shared memory run them as garbage goes), Python prints "Exception
ignored" and the run goes on (the likely cause of a fresh-clone CI run whose GRPO job
kept training for two minutes after its Ctrl-C). :class:`CtrlC` also remembers the
signal, and a loop that calls :meth:`CtrlC.check` between steps stops there.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["CtrlC"]


class CtrlC:
    """While entered (in the main thread; elsewhere it does nothing), SIGINT is recorded
    and raises ``KeyboardInterrupt`` as usual; :meth:`check` raises it again if it was
    swallowed. The previous handler is restored on exit."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if SIGINT arrived since entering."""
        if self.received.is_set():
            raise KeyboardInterrupt

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.received.set()
        raise KeyboardInterrupt

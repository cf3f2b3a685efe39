"""The controller's waiters: its lock, the conditions waiting calls sleep on, whom to wake.

In-process, a put waiting for room waits on ``cond`` and a claim on its task's
``claim_cond``, all on one lock. A change wakes only the waiters it may let proceed
(``flowrl._controller.wake``): what changed is read off the event log since the last
notification, plus a counter of the changes that append no event (room freed by an abort
or an expired reservation, a close). The zmq server, which parks requests instead of
threads, reads the same with :meth:`Waiters.mark` / :meth:`Waiters.woken_since`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from itertools import islice

from flowrl._controller.eventlog import EventLog
from flowrl._controller.tasks import TaskState
from flowrl._controller.wake import EVERYONE, NOBODY, Wake, woken

__all__ = ["Waiters"]


class Waiters:
    """Wakes the threads waiting on one controller (``tasks``: its task states, kept up
    to date by it)."""

    def __init__(self, log: EventLog, tasks: Mapping[str, TaskState]) -> None:
        self._log = log
        self._tasks = tasks
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # puts waiting for room
        self._claim_conds: dict[str, threading.Condition] = {}  # per task, on the lock
        self._eventless = 0  # changes that appended no event
        self._notified = self.mark()  # where the waiters were last notified

    def claim_cond(self, task: str) -> threading.Condition:
        """The condition an in-process claim of ``task`` waits on (under ``cond``'s lock)."""
        cond = self._claim_conds.get(task)
        if cond is None:
            cond = self._claim_conds[task] = threading.Condition(self.lock)
        return cond

    def forget(self, task: str, ended: bool) -> None:
        """A task was unregistered: wake its waiting claims (they learn it is gone) and
        drop its condition."""
        self.notify(ended)
        self._claim_conds.pop(task, None)

    def mark(self) -> tuple[int, int]:
        """Where the controller's state is now, for :meth:`woken_since`."""
        return self._log.seq, self._eventless

    def woken_since(self, mark: tuple[int, int], ended: bool) -> Wake:
        """Which waiters the changes since ``mark`` may let proceed (``ended``: whether the
        stream ended)."""
        seq, eventless = mark
        new = self._log.seq - seq
        if new == 0 and eventless == self._eventless:
            return NOBODY
        if eventless != self._eventless or ended or new > len(self._log.history):
            return EVERYONE  # once the stream ended, any change may end anyone's wait
        events = islice(reversed(self._log.history), new)
        return woken(events, {name: state.columns for name, state in self._tasks.items()})

    def notify(self, ended: bool, *, everyone: bool = False) -> None:
        """Wake the waiters the changes since the last call may let proceed;
        ``everyone``: a change that appended no event (the zmq server learns of it too)."""
        if everyone:
            self._eventless += 1
        wake = EVERYONE if not self._claim_conds else self.woken_since(self._notified, ended)
        self._notified = self.mark()
        if wake.room:
            self.cond.notify_all()
        for task, cond in self._claim_conds.items():
            if wake.claim(task):
                cond.notify_all()

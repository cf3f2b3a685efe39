"""Which waiting requests a batch of events may let proceed.

A claim waits for samples to become ready for its task; a reserve waits for room. Trying
every waiter again after every event makes a put cost O(waiters), though most events
concern one task: a put can only make samples ready for the tasks that read one of its
columns, and a lease's claim, ack, release or expiry changes only its own task's queue.
Anything else (a published version, end of stream, a new task) may let anyone proceed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from flowrl.events import Acked, Claimed, Event, Evicted, LeaseExpired, LeaseTaken, Put, Released

__all__ = ["EVERYONE", "NOBODY", "Wake", "woken"]

_TASK_EVENTS = (Claimed, LeaseTaken, Acked, Released, LeaseExpired)


class Wake(NamedTuple):
    """The waiters worth trying again: claims of ``tasks`` (None: of every task), and
    reserves if ``room`` may have been freed."""

    tasks: frozenset[str] | None
    room: bool

    def claim(self, task: str) -> bool:
        return self.tasks is None or task in self.tasks


EVERYONE = Wake(None, True)
NOBODY = Wake(frozenset(), False)


def woken(events: Iterable[Event], task_columns: Mapping[str, Collection[str]]) -> Wake:
    """The waiters that ``events`` may let proceed (``task_columns``: what each task reads).

    Only for a stream that has not ended: once it has, a claim's answer (end of stream)
    depends on every task's leases and on uncommitted puts, so everyone must be tried."""
    tasks: set[str] = set()
    room = False
    for event in events:
        if isinstance(event, Put):
            tasks.update(
                task
                for task, columns in task_columns.items()
                if not set(event.columns).isdisjoint(columns)
            )
        elif isinstance(event, _TASK_EVENTS):
            tasks.add(event.task)
        elif isinstance(event, Evicted):
            room = True
        else:
            return EVERYONE
    return Wake(frozenset(tasks), room)

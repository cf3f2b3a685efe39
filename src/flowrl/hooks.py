"""Hooks on the hub's event stream.

An :class:`Observer` has one optional no-op method per event kind; override the ones you
need and pass the observer to ``hub.subscribe``. Observers fail soft: one that raises is
logged and unsubscribed, and the hub goes on. A plain callable ``f(event)`` works too.
Policies that must not fail silently subscribe with ``strict=True``: their exception is
re-raised by the hub's next call (or by ``Pipeline.run``).
"""

from __future__ import annotations

from flowrl.events import (
    Acked,
    Claimed,
    ColumnsDeclared,
    Event,
    Evicted,
    IndexWatermark,
    LeaseExpired,
    LeaseTaken,
    Put,
    Released,
    StreamEnded,
    TaskRegistered,
    TaskUnregistered,
    VersionPublished,
)

__all__ = ["Observer"]


class Observer:
    """Base class for event observers; every method is an optional no-op."""

    def __call__(self, event: Event) -> None:
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            getattr(self, handler)(event)

    def on_put(self, event: Put) -> None:
        """Columns became ready on samples."""

    def on_claim(self, event: Claimed) -> None:
        """A task leased samples."""

    def on_ack(self, event: Acked) -> None:
        """A task consumed samples."""

    def on_release(self, event: Released) -> None:
        """A lease was given back."""

    def on_lease_expired(self, event: LeaseExpired) -> None:
        """A lease timed out; its samples are claimable again."""

    def on_evict(self, event: Evicted) -> None:
        """Samples were freed after every task acked them."""

    def on_version(self, event: VersionPublished) -> None:
        """A new policy version was published."""

    def on_stream_end(self, event: StreamEnded) -> None:
        """The stream was ended."""

    def on_task(self, event: TaskRegistered) -> None:
        """A consuming task was registered."""

    def on_task_unregistered(self, event: TaskUnregistered) -> None:
        """A task was forgotten."""

    def on_lease_taken(self, event: LeaseTaken) -> None:
        """A rank took the part of a balanced claim reserved for it."""

    def on_columns(self, event: ColumnsDeclared) -> None:
        """Columns were declared."""

    def on_watermark(self, event: IndexWatermark) -> None:
        """Indices up to a mark were set aside for producers (journal bookkeeping)."""


_HANDLERS: dict[type, str] = {
    Put: "on_put",
    Claimed: "on_claim",
    Acked: "on_ack",
    Released: "on_release",
    LeaseExpired: "on_lease_expired",
    Evicted: "on_evict",
    VersionPublished: "on_version",
    StreamEnded: "on_stream_end",
    TaskRegistered: "on_task",
    TaskUnregistered: "on_task_unregistered",
    LeaseTaken: "on_lease_taken",
    ColumnsDeclared: "on_columns",
    IndexWatermark: "on_watermark",
}

"""Typed events: every state change of the hub's controller, in the order it happened.

The controller is event-sourced: each mutation appends exactly one of these frozen
structs to its log, with a strictly increasing ``seq``. Observers and policies subscribe
to that stream (``hub.subscribe``); the multi-process transport ships the same structs on
the wire, and the simulator (``flowrl.sim``) emits them too, so hooks cannot tell a
simulated cluster from a real one.

``t`` is wall-clock time (``time.time()``) so events from several processes on one
machine share a time axis. Index lists are tuples of ints (cheap for micro-batches and
msgpack-encodable).
"""

from __future__ import annotations

import typing

import msgspec

from flowrl._schema.columns import Column

__all__ = [
    "EVENT_TYPES",
    "Acked",
    "Claimed",
    "ColumnsDeclared",
    "Event",
    "Evicted",
    "IndexWatermark",
    "LeaseExpired",
    "LeaseTaken",
    "Put",
    "Released",
    "StreamEnded",
    "TaskRegistered",
    "TaskUnregistered",
    "VersionPublished",
    "event_decoder",
    "event_encoder",
]


class _EventBase(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True, gc=False):
    seq: int
    t: float


class Put(_EventBase, frozen=True, tag="put"):
    """Columns became ready on samples; ``new`` says the samples were created by it.

    ``version``: the samples' policy version (the oldest one when the put gave one per
    sample, -1 when an update left versions unchanged); ``versions``: one per sample when
    the put gave them so, else empty. ``groups`` (empty when the put gave none) and
    ``nbytes`` (per column, then per sample) complete the record so that a journal of
    events can rebuild the table exactly.
    """

    indices: tuple[int, ...]
    columns: tuple[str, ...]
    new: bool = False
    partition: str = ""
    version: int = -1
    tokens: tuple[int, ...] = ()
    unit: int = 0
    producer: str = ""
    groups: tuple[int, ...] = ()
    nbytes: tuple[int, ...] = ()
    versions: tuple[int, ...] = ()
    producer_seq: int = -1  # the put's number among the producer's (-1: not idempotent)


class Claimed(_EventBase, frozen=True, tag="claim"):
    """A task leased samples for processing.

    A balanced claim leases one part per data-parallel rank at once: ``round`` is the lease
    id of the round's first part (0 outside balanced rounds) and ``reserved`` marks the
    parts held for ranks that have not claimed yet (see :class:`LeaseTaken`).
    """

    task: str
    lease: int
    indices: tuple[int, ...]
    consumer: str = ""
    deadline: float = 0.0
    dp_rank: int = 0
    round: int = 0
    reserved: bool = False


class LeaseTaken(_EventBase, frozen=True, tag="lease_taken"):
    """A rank took the part of a balanced round reserved for it; its deadline restarts."""

    task: str
    lease: int
    deadline: float


class Acked(_EventBase, frozen=True, tag="ack"):
    """A task finished samples; they will never be delivered to it again.

    ``dropped``: the samples were discarded for every task that had not leased them yet.
    """

    task: str
    lease: int
    indices: tuple[int, ...]
    dropped: bool = False


class Released(_EventBase, frozen=True, tag="release"):
    """A lease was given back voluntarily; its samples are claimable again."""

    task: str
    lease: int
    indices: tuple[int, ...]


class LeaseExpired(_EventBase, frozen=True, tag="lease_expired"):
    """A lease's deadline passed before ack; its samples are claimable again."""

    task: str
    lease: int
    indices: tuple[int, ...]


class Evicted(_EventBase, frozen=True, tag="evict"):
    """Every registered task acked these samples; their storage was freed."""

    indices: tuple[int, ...]


class VersionPublished(_EventBase, frozen=True, tag="version"):
    """The trainer published a new policy version."""

    version: int


class StreamEnded(_EventBase, frozen=True, tag="end"):
    """No new samples will be created; ``columns`` lists columns that are final too."""

    columns: tuple[str, ...] = ()


class ColumnsDeclared(_EventBase, frozen=True, tag="columns"):
    """Columns were added to the hub's schema."""

    columns: tuple[Column, ...]


class IndexWatermark(_EventBase, frozen=True, tag="watermark"):
    """Sample indices below ``next`` may have been handed out (so never hand them out again).

    Reservations themselves are not events; this mark, logged once per ``capacity``
    allocations, lets a recovered controller skip every index a producer may still hold.
    """

    next: int


class TaskRegistered(_EventBase, frozen=True, tag="task"):
    """A consuming task was registered with the columns it needs; ``partition``: the one
    partition whose samples it reads (None: every partition's)."""

    task: str
    columns: tuple[str, ...]
    partition: str | None = None


class TaskUnregistered(_EventBase, frozen=True, tag="untask"):
    """A task was forgotten; samples only it had not consumed were evicted (``Evicted``)."""

    task: str


Event = (
    Put
    | Claimed
    | LeaseTaken
    | Acked
    | Released
    | LeaseExpired
    | Evicted
    | VersionPublished
    | StreamEnded
    | TaskRegistered
    | TaskUnregistered
    | ColumnsDeclared
    | IndexWatermark
)

#: Every event class (what ``Event`` is the union of).
EVENT_TYPES: tuple[type[msgspec.Struct], ...] = typing.get_args(Event)

event_encoder = msgspec.msgpack.Encoder()
event_decoder: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(Event)

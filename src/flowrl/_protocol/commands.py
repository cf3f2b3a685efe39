"""Every command a client sends the controller, defined once (see the package docstring).

Commands are frozen, tagged by ``op``. Fields hold what the controller needs and nothing
of the transport: a zmq client sends them as they are; the in-process client hands them
to the controller. New fields must get defaults (schema evolution). Commands holding
arrays compare by identity (``eq=False``): compare their encodings instead.
"""

from __future__ import annotations

import msgspec
import numpy as np

from flowrl._protocol.codec import Count, Int64, Int64s, NonNeg, PositiveSeconds, Seconds
from flowrl._schema.columns import Column

__all__ = [
    "Abort",
    "Ack",
    "BalancedSpec",
    "Cell",
    "CheckUpdate",
    "Claim",
    "Command",
    "Commit",
    "Declare",
    "EndStream",
    "FifoSpec",
    "GroupSpec",
    "LeaseRef",
    "MetaOf",
    "PublishVersion",
    "RegisterTask",
    "Release",
    "Reserve",
    "SamplerSpec",
    "StalenessSpec",
    "UnregisterTask",
]


class Command(msgspec.Struct, frozen=True, tag_field="op", kw_only=True):
    """A request to the controller (the tag ``op`` names it on the wire)."""


# -- samplers, as a claim names them -------------------------------------------------------
class FifoSpec(Command, frozen=True, tag="fifo"):
    pass


class GroupSpec(Command, frozen=True, tag="group"):
    group_size: Count


class StalenessSpec(Command, frozen=True, tag="stale"):
    max_staleness: NonNeg
    inner: FifoSpec | GroupSpec | StalenessSpec | BalancedSpec = FifoSpec()


class BalancedSpec(Command, frozen=True, tag="balanced"):
    dp_size: Count
    inner: FifoSpec | GroupSpec | StalenessSpec = FifoSpec()


SamplerSpec = FifoSpec | GroupSpec | StalenessSpec | BalancedSpec


# -- columns and tasks ---------------------------------------------------------------------
class Declare(Command, frozen=True, tag="declare"):
    columns: tuple[Column, ...]


class RegisterTask(Command, frozen=True, tag="task"):
    task: str
    columns: tuple[str, ...]
    partition: str | None = None  # the one partition the task reads (None: every one)


class UnregisterTask(Command, frozen=True, tag="untask"):
    task: str


# -- producers -----------------------------------------------------------------------------
class Reserve(Command, frozen=True, tag="reserve", eq=False):
    """Fresh indices for ``n`` new samples, invisible until committed."""

    n: Count
    timeout: Seconds | None = None  # how long the put may wait for room (None: for ever)
    units: list[NonNeg] | None = None  # storage units to put on (the producer's node's)
    ahead: NonNeg = 0  # reserve up to this many more for the producer's next puts
    give_back: Int64s | None = None  # unused indices reserved ahead earlier: abort them first


class Abort(Command, frozen=True, tag="abort", eq=False):
    """Give back a reservation whose data never arrived."""

    indices: Int64s


class LeaseRef(msgspec.Struct, frozen=True, array_like=True):
    """A claim, named by its task and lease id (what a put acks with its commit)."""

    task: str
    lease: Int64


class CheckUpdate(Command, frozen=True, tag="check", eq=False):
    """Check a put to existing samples before any byte moves; answered with their units."""

    indices: Int64s
    columns: tuple[str, ...]
    ack: LeaseRef | None = None  # the claim the put acks (checked first)


class Cell(msgspec.Struct, frozen=True, array_like=True, eq=False):
    """What the controller learns about one column of a put: sizes, never bytes."""

    nbytes: Int64s  # per sample
    lengths: Int64s | None = None  # per sample, for ragged columns


class Commit(Command, frozen=True, tag="commit", eq=False):
    """Make stored columns visible: the moment a put's samples become claimable.

    ``version`` (one for the put) or ``versions`` (one per sample), not both; neither:
    new samples get the hub's current version, updated ones keep theirs. ``ack``: a claim
    holding these samples, acked in the same step. ``put_id``: a put to existing samples
    whose bytes its units staged; they file them once the commit succeeds. ``seq``: the
    put's sequence number among ``producer``'s puts, which makes it idempotent (a commit
    of a ``(producer, seq)`` committed before is refused with ``DuplicatePut``).
    """

    indices: Int64s
    cells: dict[str, Cell]
    new: bool
    partition: str = ""
    groups: Int64s | None = None
    version: NonNeg | None = None
    versions: Int64s | None = None
    tokens: Int64s | None = None
    producer: str = ""
    ack: LeaseRef | None = None
    put_id: NonNeg = 0
    seq: NonNeg | None = None

    def policy_version(self) -> int | np.ndarray | None:
        """The version the put gives its samples: one, one per sample, or None."""
        return self.version if self.versions is None else self.versions


# -- consumers -----------------------------------------------------------------------------
class Claim(Command, frozen=True, tag="claim"):
    """Lease up to ``n`` samples ready for ``task``.

    ``sampler`` names a built-in sampler over the wire; the in-process hub hands the
    controller the Sampler object itself (custom ones included) beside the command.
    """

    task: str
    n: Count
    sampler: SamplerSpec = FifoSpec()
    columns: tuple[str, ...] | None = None
    min_n: Count | None = None
    timeout: Seconds | None = None  # how long the claim may wait (None: for ever)
    dp_rank: NonNeg = 0
    lease_timeout: PositiveSeconds | None = None
    consumer: str = ""
    more: NonNeg = 0  # then up to this many more micro-batches ready at once, each its own lease


class MetaOf(Command, frozen=True, tag="meta", eq=False):
    """An unleased handle on given samples."""

    indices: Int64s
    columns: tuple[str, ...]


class Ack(Command, frozen=True, tag="ack", eq=False):
    """Mark a claim, or some of its samples, consumed (``drop``: for every task)."""

    task: str
    lease: Int64
    indices: Int64s | None = None
    drop: bool = False


class Release(Command, frozen=True, tag="release"):
    """Give a claim back unprocessed."""

    task: str
    lease: Int64


# -- versions and the stream's end ---------------------------------------------------------
class PublishVersion(Command, frozen=True, tag="publish"):
    version: NonNeg


class EndStream(Command, frozen=True, tag="end"):
    columns: tuple[str, ...] = ()

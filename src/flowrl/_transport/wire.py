"""Wire protocol: tagged msgspec Structs, msgpack-encoded; arrays travel as raw bytes.

Every request frame decodes to one ``Request`` variant; every reply to one ``Reply``
variant. Storage payloads follow the header frame as separate buffer frames (see
frames.py). Nothing is pickled. New fields must get defaults (schema evolution).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from flowrl import errors
from flowrl._config import HubConfig, HubStats, UnitStats
from flowrl._controller.meta import WireMeta
from flowrl._controller.samplers import (
    BalancedSampler,
    FifoSampler,
    GroupSampler,
    Sampler,
    StalenessSampler,
)
from flowrl._protocol.codec import NonNeg, decoder, encode
from flowrl._protocol.commands import (
    Abort,
    Ack,
    BalancedSpec,
    CheckUpdate,
    Claim,
    Commit,
    Declare,
    EndStream,
    FifoSpec,
    GroupSpec,
    MetaOf,
    PublishVersion,
    RegisterTask,
    Release,
    Reserve,
    SamplerSpec,
    StalenessSpec,
    UnregisterTask,
)
from flowrl._schema.columns import Column
from flowrl._schema.small import SMALL, has_negative
from flowrl._transport.frames import ArrayHeader

__all__ = [
    "Malformed",
    "columns_of",
    "decode_request",
    "encode",
    "exception_of",
    "sampler_from_spec",
    "spec_of_sampler",
    "write_request",
]


class _Msg(msgspec.Struct, frozen=True, tag_field="op", kw_only=True):
    pass


class Malformed(errors.TransportError):
    """A frame that is not a well-formed request: a server logs one line and answers it
    with this error (a client sees a TransportError)."""


#: What msgspec raises on bytes that are not a message of the expected type: invalid
#: msgpack or types, strings that are not UTF-8, nesting deeper than Python's stack.
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
#: The byte of a native int64 that holds its sign bit.
_SIGN = 7 if sys.byteorder == "little" else 0


_FIFO_SPEC = FifoSpec()


def spec_of_sampler(sampler: Sampler) -> SamplerSpec:
    if isinstance(sampler, FifoSampler):
        return _FIFO_SPEC
    if isinstance(sampler, GroupSampler):
        return GroupSpec(group_size=sampler.group_size)
    if isinstance(sampler, StalenessSampler):
        return StalenessSpec(
            max_staleness=sampler.max_staleness, inner=spec_of_sampler(sampler.inner)
        )  # type: ignore[arg-type]
    if isinstance(sampler, BalancedSampler):
        return BalancedSpec(dp_size=sampler.dp_size, inner=spec_of_sampler(sampler.inner))  # type: ignore[arg-type]
    raise errors.ConfigError(
        f"sampler {sampler!r} is a custom class: custom samplers run only on the in-process "
        "hub; over processes use FifoSampler/GroupSampler/StalenessSampler/BalancedSampler"
    )


def sampler_from_spec(spec: SamplerSpec) -> Sampler:
    if isinstance(spec, FifoSpec):
        return FifoSampler()
    if isinstance(spec, GroupSpec):
        return GroupSampler(spec.group_size)
    if isinstance(spec, StalenessSpec):
        return StalenessSampler(spec.max_staleness, sampler_from_spec(spec.inner))
    return BalancedSampler(spec.dp_size, sampler_from_spec(spec.inner))


# -- session requests to the controller (its commands: flowrl._protocol.commands) ------------
class Hello(_Msg, frozen=True, tag="hello"):
    pass


#: What a CommitFor carries: the encoded commit (a unit hands it on as the write carried
#: it), or the Commit itself (the controller decodes it with the rest, in one pass).
C = TypeVar("C", msgspec.Raw, Commit)


class CommitFor(_Msg, Generic[C], frozen=True, tag="commit_for"):
    """A commit a storage unit hands on once it stored the bytes, sent under the producer's
    request id; the controller answers the producer (its routing id ``reply_to``), also
    with the error of a malformed commit (see :func:`reply_to_of`)."""

    commit: C
    reply_to: bytes
    reserve_next: NonNeg = 0  # (as the Write asked)
    reserve_units: list[NonNeg] | None = None


class Stats(_Msg, frozen=True, tag="stats"):
    pass


class Ping(_Msg, frozen=True, tag="ping"):
    """Does the controller still hold this client's parked request ``rid`` (a claim or a
    reserve waiting in it)? A restarted controller does not: the client sends it again."""

    rid: bytes


class PublishHello(_Msg, frozen=True, tag="pub_hello"):
    token: NonNeg


class Shutdown(_Msg, frozen=True, tag="shutdown"):
    pass


# -- storage requests ----------------------------------------------------------------------
#: msgpack's nil: the ``commit`` of a write that carries none
NO_COMMIT = msgspec.Raw(b"\xc0")


class ShmRef(msgspec.Struct, frozen=True, array_like=True):
    """Where a buffer lies in a storage unit's shared memory (``flowrl._store.shm``)."""

    path: str
    offset: NonNeg
    size: NonNeg


class Write(_Msg, frozen=True, tag="write"):
    """Build one with :func:`write_request`.

    The column declarations and the commit travel encoded (``msgspec.Raw``): a unit
    decodes the declarations through a cache (every write of a producer repeats them, and
    validating them cost more than decoding the rest of the header) and hands the commit
    on to the controller without decoding it.
    """

    indices: bytes
    columns: msgspec.Raw  # list[Column]: see columns_of
    arrays: list[ArrayHeader]
    # With a commit, the unit stores the bytes, then hands the commit to the controller
    # at ``controller``, which answers the producer's socket ``reply_to`` (its routing id).
    commit: msgspec.Raw = NO_COMMIT
    controller: str = ""
    reply_to: bytes = b""
    # A put to existing samples: the unit refuses it (UnknownIndexError, nothing stored)
    # unless it holds every one of them, else stages the bytes under this id until the
    # controller settles the commit (Settle); 0: stored at once (new samples).
    put_id: NonNeg = 0
    # A write whose payload the producer wrote into the unit's shared memory itself, in
    # the bytes the unit lent it (``Grant``): where each buffer lies, in frame order; no
    # payload frames follow.
    grant: NonNeg = 0
    refs: list[ShmRef] | None = None
    # With a commit: the controller reserves this many indices for the producer's next
    # put with it (on ``reserve_units``, None: any), as room allows, and answers Reserved.
    reserve_next: NonNeg = 0
    reserve_units: list[NonNeg] | None = None

    @property
    def has_commit(self) -> bool:
        return self.commit != NO_COMMIT


class Grant(_Msg, frozen=True, tag="grant"):
    """Lend ``size`` bytes of the unit's shared memory to the asking client (same machine,
    same user): it writes put payloads there itself, in order, and names them in
    ``Write.refs`` instead of sending frames. Answered with :class:`Granted`."""

    size: NonNeg


class Read(_Msg, frozen=True, tag="read"):
    indices: bytes
    columns: list[str]
    shm: bool = False  # the reader maps the unit's shared memory (same machine)


class Evict(_Msg, frozen=True, tag="evict"):
    indices: bytes


class Settle(_Msg, frozen=True, tag="settle"):
    """The controller's verdict on a put whose bytes a unit staged (``Write.put_id``):
    file them (``committed``) or forget them."""

    put_id: NonNeg
    committed: bool


class Append(_Msg, frozen=True, tag="append"):
    """Tokens for in-progress values of ragged columns, appended together; the frames of
    each column's ArrayHeader follow in order. Answered with the prefix lengths, column
    after column."""

    indices: bytes
    columns: list[Column]
    version: NonNeg
    arrays: list[ArrayHeader]


class ReadPartial(_Msg, frozen=True, tag="read_partial"):
    indices: bytes
    column: Column


class Retain(_Msg, frozen=True, tag="retain"):
    """Evict every sample below index ``below`` that is not in ``indices`` (the live set
    of a recovered controller; samples put after its recovery are all ``>= below``)."""

    indices: bytes
    below: int


class Discard(_Msg, frozen=True, tag="discard"):
    indices: bytes
    columns: list[str]


class UnitStatsReq(_Msg, frozen=True, tag="unit_stats"):
    pass


Request = (
    Hello
    | Declare
    | RegisterTask
    | UnregisterTask
    | Reserve
    | Abort
    | CheckUpdate
    | Commit
    | CommitFor[Commit]
    | Claim
    | MetaOf
    | Ack
    | Release
    | PublishVersion
    | EndStream
    | Stats
    | PublishHello
    | Ping
    | Shutdown
    | Write
    | Grant
    | Read
    | Evict
    | Settle
    | Retain
    | Append
    | ReadPartial
    | Discard
    | UnitStatsReq
)


# -- replies -------------------------------------------------------------------------------
class Done(_Msg, frozen=True, tag="done"):
    pass


class Error(_Msg, frozen=True, tag="error"):
    type: str
    message: str
    indices: list[int] | None = None  # a DuplicatePut's: the first put's samples


class Welcome(_Msg, frozen=True, tag="welcome"):
    columns: list[Column]
    config: HubConfig
    units: list[str]
    events: str
    version: int


class Reserved(_Msg, frozen=True, tag="reserved"):
    indices: bytes
    unit: int  # of the n indices asked for
    units: bytes | None = None  # int16 per index, when indices were reserved ahead


class Granted(_Msg, frozen=True, tag="granted"):
    """Bytes a unit lent (``Grant``): ``size`` at ``offset`` of segment ``path``; grant 0:
    none (the unit has no shared memory, or no room in it)."""

    grant: NonNeg
    path: str = ""
    offset: NonNeg = 0
    size: NonNeg = 0


class Pong(_Msg, frozen=True, tag="pong"):
    parked: bool  # the request a Ping named waits in the controller


class Units(_Msg, frozen=True, tag="units"):
    units: bytes


class MetaReply(_Msg, frozen=True, tag="meta_reply"):
    meta: WireMeta
    more: list[WireMeta] = []  # a claim's further micro-batches (``Claim.more``)


class StatsReply(_Msg, frozen=True, tag="stats_reply"):
    stats: HubStats


class UnitStatsReply(_Msg, frozen=True, tag="unit_stats_reply"):
    stats: UnitStats


class Arrays(_Msg, frozen=True, tag="arrays"):
    arrays: list[ArrayHeader]
    # For a shm read: one entry per buffer of the arrays, in order; a ShmRef for a buffer
    # read in place, None for one sent as the next frame.
    refs: list[ShmRef | None] | None = None
    # For a shm read of one whole chunk per column: each array is the chunk (its header's
    # length is the chunk's), and the rows read start at starts[i] of array i.
    starts: list[NonNeg] | None = None


class Lengths(_Msg, frozen=True, tag="lengths"):
    lengths: bytes


Reply = (
    Done
    | Error
    | Welcome
    | Reserved
    | Granted
    | Pong
    | Units
    | MetaReply
    | StatsReply
    | UnitStatsReply
    | Arrays
    | Lengths
)

_request_decoder = decoder(Request)
_reply_decoder = decoder(Reply)


def write_request(
    indices: bytes,
    columns: list[Column],
    arrays: list[ArrayHeader],
    commit: Commit | None = None,
    controller: str = "",
    reply_to: bytes = b"",
    put_id: int = 0,
    **lent: Any,
) -> Write:
    """A :class:`Write` of ``arrays`` (declared as ``columns``), with its commit if any
    (``lent``: ``grant``/``refs``, ``reserve_next``/``reserve_units``); ConfigError for a
    value msgpack cannot carry, as :func:`encode`."""
    return Write(
        indices=indices,
        columns=msgspec.Raw(encode(columns)),
        arrays=arrays,
        commit=NO_COMMIT if commit is None else msgspec.Raw(encode(commit)),
        controller=controller,
        reply_to=reply_to,
        put_id=put_id,
        **lent,
    )


_columns_decoder = msgspec.msgpack.Decoder(list[Column])
_known_columns: dict[bytes, list[Column]] = {}
_KNOWN_COLUMNS_MAX = 1024  # distinct declaration lists a unit remembers (it forgets all)


def columns_of(msg: Write) -> list[Column]:
    """A write's column declarations; TransportError if they are malformed."""
    raw = bytes(msg.columns)
    columns = _known_columns.get(raw)
    if columns is None:
        try:
            columns = _columns_decoder.decode(raw)
        except _UNDECODABLE as exc:
            raise Malformed(f"malformed Write request: columns: {_reason(exc)}") from None
        if len(_known_columns) >= _KNOWN_COLUMNS_MAX:
            _known_columns.clear()
        _known_columns[raw] = columns
    return columns


_handed_decoder = msgspec.msgpack.Decoder(CommitFor[msgspec.Raw])


def reply_to_of(frame: Any) -> bytes | None:
    """Whom a malformed request answers: the producer a storage unit named in a
    :class:`CommitFor` (whose commit, not the unit, is at fault); None for other requests."""
    try:
        return _handed_decoder.decode(frame).reply_to
    except _UNDECODABLE:
        return None


class _CommitIndices(msgspec.Struct, frozen=True, tag="commit", tag_field="op"):
    indices: bytes  # (the decoder skips a commit's other fields)


_commit_indices_decoder = msgspec.msgpack.Decoder(_CommitIndices)


def _commit_indices(raw: msgspec.Raw) -> bytes | None:
    try:
        return _commit_indices_decoder.decode(raw).indices
    except _UNDECODABLE:
        return None


def decode_request(frame: Any) -> Any:
    """The request in ``frame``; TransportError if it is malformed (nothing was done)."""
    return _decode_checked(_request_decoder, frame, "request")


def _decode_checked(dec: msgspec.msgpack.Decoder[Any], frame: Any, what: str) -> Any:
    try:
        msg = dec.decode(frame)
    except _UNDECODABLE as exc:
        raise Malformed(f"malformed {what}: {_reason(exc)}") from None
    problem = _check_request(msg)
    if problem:
        raise Malformed(f"malformed {type(msg).__name__} request: {problem}")
    return msg


def _reason(exc: BaseException) -> str:
    """Why bytes did not decode, in one short line."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _check_request(msg: Any) -> str:
    """What the decoder's types cannot say about a request: raw int64 arrays are whole
    numbers of int64s (commands' arrays are checked by their decoder) and agree in
    length. Returns the problem, or "" if none."""
    check = _CHECKS.get(type(msg))
    return "" if check is None else check(msg)


def _check_unit_request(msg: Any) -> str:
    """A request naming samples on a storage unit, which trusts their indices to be >= 0."""
    n, rest = divmod(len(msg.indices), 8)
    if rest:
        return "indices is not a whole number of int64s"
    if n and _negative(msg.indices):
        return "a sample index is negative"
    return ""


def _repeats_a_column(arrays: list[ArrayHeader]) -> bool:
    return len(arrays) > 1 and len(arrays) != len({h.column for h in arrays})


def _check_write(msg: Write) -> str:
    problem = _check_unit_request(msg)
    if problem:
        return problem
    if _repeats_a_column(msg.arrays):
        return "a column appears twice"
    if msg.commit != NO_COMMIT:
        # (the rest of the commit is checked where it is decoded: the controller)
        if _commit_indices(msg.commit) != msg.indices:
            return "the commit names other samples than the write"
        if "://" not in msg.controller or not msg.reply_to:
            return "a commit needs the controller's zmq address and the producer's id"
    return ""


def _check_append(msg: Append) -> str:
    problem = _check_unit_request(msg)
    if problem:
        return problem
    if _repeats_a_column(msg.arrays):
        return "a column appears twice"
    return "" if msg.arrays else "an append names no column"


def _check_commit(msg: Commit) -> str:
    n = int(msg.indices.size)
    if n == 0:
        return "a commit names no sample"
    # (checked in a plain loop: this runs on every put, and a put is often one sample)
    for what in ("groups", "tokens", "versions"):
        data = getattr(msg, what)
        if data is not None and data.size != n:
            return f"{what} does not hold one int64 for each of the {n} indices"
    for name, cell in msg.cells.items():
        for what, data in (("nbytes", cell.nbytes), ("lengths", cell.lengths)):
            if data is not None and data.size != n:
                return f"cells[{name!r}].{what} does not hold one int64 for each of the {n} indices"
    for what in ("tokens", "versions"):
        data = getattr(msg, what)
        if data is not None and _negative(data):
            return f"{what} must be >= 0"
    if msg.versions is not None and msg.version is not None:
        return "a commit gives one version or one per sample, not both"
    return ""


def _check_commit_for(msg: CommitFor[Commit]) -> str:
    problem = _check_commit(msg.commit)
    return f"commit: {problem}" if problem else ""


def _check_claim(msg: Claim) -> str:
    if msg.min_n is not None and msg.min_n > msg.n:
        return f"min_n={msg.min_n} exceeds n={msg.n}"
    return ""


#: Each request type's own checks (by exact type: a request is one tagged Struct).
_CHECKS: dict[type, Callable[[Any], str]] = {
    Write: _check_write,
    Append: _check_append,
    Read: _check_unit_request,
    Discard: _check_unit_request,
    Evict: _check_unit_request,
    ReadPartial: _check_unit_request,
    Retain: _check_unit_request,
    Commit: _check_commit,
    CommitFor: _check_commit_for,
    Claim: _check_claim,
}


def _negative(data: bytes | np.ndarray) -> bool:
    """Whether int64s (an array, or raw bytes holding a whole number) hold a negative."""
    if isinstance(data, np.ndarray):
        return has_negative(data)
    if len(data) <= SMALL * 8:  # a few: their sign bytes (no numpy call, no ints made)
        return max(data[_SIGN::8], default=0) >= 0x80
    return bool(np.frombuffer(data, dtype=np.int64).min() < 0)


def decode_reply(frame: Any) -> Any:
    try:
        return _reply_decoder.decode(frame)
    except _UNDECODABLE as exc:
        raise errors.TransportError(f"malformed reply: {_reason(exc)}") from None


def error_of(exc: BaseException) -> Error:
    if isinstance(exc, errors.DuplicatePut):
        return Error(type="DuplicatePut", message=str(exc), indices=list(exc.indices))
    if isinstance(exc, errors.FlowRLError):
        # named by its nearest public class (what the other side can raise: Malformed is
        # a TransportError there)
        public = next(c for c in type(exc).__mro__ if getattr(errors, c.__name__, None) is c)
        return Error(type=public.__name__, message=str(exc))
    return Error(type="FlowRLError", message=f"internal error: {type(exc).__name__}: {exc}")


def exception_of(err: Error) -> errors.FlowRLError:
    """The typed exception an error reply stands for."""
    cls = getattr(errors, err.type, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.FlowRLError)):
        cls = errors.TransportError
    if cls is errors.DuplicatePut:
        return errors.DuplicatePut(err.message, indices=tuple(err.indices or ()))
    return cls(err.message)


def ints(data: bytes) -> np.ndarray:
    """An int64 array sent as raw bytes (a read-only view of them, no copy)."""
    if len(data) % 8:
        raise errors.TransportError(f"{len(data)} bytes are not a whole number of int64s")
    return np.frombuffer(data, dtype=np.int64)

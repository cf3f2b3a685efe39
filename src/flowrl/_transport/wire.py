"""Wire protocol: tagged msgspec Structs, msgpack-encoded; arrays travel as raw bytes.

Every request frame decodes to one ``Request`` variant; every reply to one ``Reply``
variant. Storage payloads follow the header frame as separate buffer frames (see
frames.py). Nothing is pickled. New fields must get defaults (schema evolution).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from flowrl import errors
from flowrl._client.config import HubConfig, HubStats, UnitStats
from flowrl._controller.meta import WireMeta
from flowrl._controller.samplers import (
    BalancedSampler,
    FifoSampler,
    GroupSampler,
    Sampler,
    StalenessSampler,
)
from flowrl._schema.columns import Column
from flowrl._transport.frames import ArrayHeader

__all__ = ["decode_request", "encode", "raise_error", "sampler_from_spec", "spec_of_sampler"]


class _Msg(msgspec.Struct, frozen=True, tag_field="op", kw_only=True):
    pass


# -- samplers ------------------------------------------------------------------------------
class FifoSpec(_Msg, frozen=True, tag="fifo"):
    pass


class GroupSpec(_Msg, frozen=True, tag="group"):
    group_size: int


class StalenessSpec(_Msg, frozen=True, tag="stale"):
    max_staleness: int
    inner: FifoSpec | GroupSpec | StalenessSpec | BalancedSpec = FifoSpec()


class BalancedSpec(_Msg, frozen=True, tag="balanced"):
    dp_size: int
    inner: FifoSpec | GroupSpec | StalenessSpec = FifoSpec()


SamplerSpec = FifoSpec | GroupSpec | StalenessSpec | BalancedSpec


def spec_of_sampler(sampler: Sampler) -> SamplerSpec:
    if isinstance(sampler, FifoSampler):
        return FifoSpec()
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


# -- controller requests --------------------------------------------------------------------
class Hello(_Msg, frozen=True, tag="hello"):
    pass


class Declare(_Msg, frozen=True, tag="declare"):
    columns: list[Column]


class RegisterTask(_Msg, frozen=True, tag="task"):
    task: str
    columns: list[str]


class Reserve(_Msg, frozen=True, tag="reserve"):
    n: int
    timeout: float | None = None


class Abort(_Msg, frozen=True, tag="abort"):
    indices: bytes


class CheckUpdate(_Msg, frozen=True, tag="check"):
    indices: bytes
    columns: list[str]


class Cell(msgspec.Struct, frozen=True, array_like=True):
    nbytes: bytes
    lengths: bytes | None = None


class Commit(_Msg, frozen=True, tag="commit"):
    indices: bytes
    cells: dict[str, Cell]
    new: bool
    partition: str = ""
    groups: bytes | None = None
    version: int | None = None
    tokens: bytes | None = None
    producer: str = ""


class Claim(_Msg, frozen=True, tag="claim"):
    task: str
    n: int
    sampler: SamplerSpec = FifoSpec()
    columns: list[str] | None = None
    min_n: int | None = None
    timeout: float | None = None
    dp_rank: int = 0
    lease_timeout: float | None = None
    consumer: str = ""


class MetaOf(_Msg, frozen=True, tag="meta"):
    indices: bytes
    columns: list[str]


class Ack(_Msg, frozen=True, tag="ack"):
    task: str
    lease: int
    indices: bytes | None = None
    drop: bool = False


class Release(_Msg, frozen=True, tag="release"):
    task: str
    lease: int


class Publish(_Msg, frozen=True, tag="publish"):
    version: int


class End(_Msg, frozen=True, tag="end"):
    columns: list[str] = []


class Stats(_Msg, frozen=True, tag="stats"):
    pass


class PublishHello(_Msg, frozen=True, tag="pub_hello"):
    token: int


class Shutdown(_Msg, frozen=True, tag="shutdown"):
    pass


# -- storage requests ----------------------------------------------------------------------
class Write(_Msg, frozen=True, tag="write"):
    indices: bytes
    columns: list[Column]
    arrays: list[ArrayHeader]


class Read(_Msg, frozen=True, tag="read"):
    indices: bytes
    columns: list[str]


class Evict(_Msg, frozen=True, tag="evict"):
    indices: bytes


class Append(_Msg, frozen=True, tag="append"):
    """Tokens for in-progress values of a ragged column; one ArrayHeader's frames follow."""

    indices: bytes
    column: Column
    version: int
    array: ArrayHeader


class ReadPartial(_Msg, frozen=True, tag="read_partial"):
    indices: bytes
    column: Column


class Retain(_Msg, frozen=True, tag="retain"):
    """Keep only these samples (a recovered controller's live set); evict the rest."""

    indices: bytes


class Discard(_Msg, frozen=True, tag="discard"):
    indices: bytes
    columns: list[str]


class UnitStatsReq(_Msg, frozen=True, tag="unit_stats"):
    pass


Request = (
    Hello
    | Declare
    | RegisterTask
    | Reserve
    | Abort
    | CheckUpdate
    | Commit
    | Claim
    | MetaOf
    | Ack
    | Release
    | Publish
    | End
    | Stats
    | PublishHello
    | Shutdown
    | Write
    | Read
    | Evict
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


class Welcome(_Msg, frozen=True, tag="welcome"):
    columns: list[Column]
    config: HubConfig
    units: list[str]
    events: str
    version: int


class Reserved(_Msg, frozen=True, tag="reserved"):
    indices: bytes
    unit: int


class Units(_Msg, frozen=True, tag="units"):
    units: bytes


class MetaReply(_Msg, frozen=True, tag="meta_reply"):
    meta: WireMeta


class StatsReply(_Msg, frozen=True, tag="stats_reply"):
    stats: HubStats


class UnitStatsReply(_Msg, frozen=True, tag="unit_stats_reply"):
    stats: UnitStats


class Arrays(_Msg, frozen=True, tag="arrays"):
    arrays: list[ArrayHeader]


class Lengths(_Msg, frozen=True, tag="lengths"):
    lengths: bytes


Reply = (
    Done
    | Error
    | Welcome
    | Reserved
    | Units
    | MetaReply
    | StatsReply
    | UnitStatsReply
    | Arrays
    | Lengths
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: Any) -> Any:
    try:
        return _request_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise errors.TransportError(f"malformed request: {exc}") from None


def decode_reply(frame: Any) -> Any:
    try:
        return _reply_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise errors.TransportError(f"malformed reply: {exc}") from None


def error_of(exc: BaseException) -> Error:
    if isinstance(exc, errors.FlowRLError):
        return Error(type=type(exc).__name__, message=str(exc))
    return Error(type="FlowRLError", message=f"internal error: {type(exc).__name__}: {exc}")


def raise_error(err: Error) -> None:
    cls = getattr(errors, err.type, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.FlowRLError)):
        cls = errors.TransportError
    raise cls(err.message)


def ints(data: bytes) -> np.ndarray:
    """An int64 array sent as raw bytes (a read-only view of them, no copy)."""
    return np.frombuffer(data, dtype=np.int64)

"""How commands travel: msgpack, with int64 arrays as raw bytes, decoded without a copy.

A field typed :data:`Int64s` holds a numpy int64 array in memory. The encoder writes its
bytes; the decoder refuses bytes that are not a whole number of int64s (a malformed
request, rejected before it reaches the controller) and returns a read-only view of them.
Value constraints (``Count``, ``NonNeg``, ...) are checked on decoding only, never when a
client builds a command: a request that breaks them cannot change state half-way.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

import msgspec
import numpy as np

from flowrl.errors import ConfigError

__all__ = [
    "Count",
    "Int64",
    "Int64s",
    "NonNeg",
    "PositiveSeconds",
    "Seconds",
    "decoder",
    "encode",
]

#: An int64 array (indices, sizes, token counts): numpy in memory, raw bytes on the wire.
Int64s: TypeAlias = np.ndarray
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]  # n, min_n, group sizes
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # versions, ranks, lengths
Seconds = Annotated[float, msgspec.Meta(ge=0)]  # NaN and negatives rejected, inf allowed
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


_INT64 = np.dtype("<i8")  # (a dtype named by a string is parsed on every call)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj, dtype=_INT64).data
    raise NotImplementedError(f"{type(obj).__name__} cannot travel on the wire")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        if not isinstance(obj, bytes):
            raise TypeError(f"Expected `bytes` of int64s, got `{type(obj).__name__}`")
        if len(obj) % 8:
            raise ValueError(f"{len(obj)} bytes are not a whole number of int64s")
        return np.frombuffer(obj, _INT64)  # a read-only view, no copy
    raise NotImplementedError(f"cannot decode {kind!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(msg: Any) -> bytes:
    """msgpack bytes of a message; a value msgpack cannot carry raises ConfigError.

    That is an int outside [-2**63, 2**64) or a str that is not valid Unicode (a lone
    surrogate), both from a caller's argument: nothing has been sent when it raises.
    """
    try:
        return _encoder.encode(msg)
    except (OverflowError, UnicodeEncodeError, TypeError, msgspec.EncodeError) as exc:
        raise ConfigError(
            f"{type(msg).__name__} request cannot be sent to the hub's servers: {exc}; ints "
            "must fit in 64 bits and strings must be valid Unicode"
        ) from None


def decoder(kind: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder of ``kind`` that turns :data:`Int64s` fields back into arrays."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)

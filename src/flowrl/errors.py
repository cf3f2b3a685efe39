"""The exceptions flowrl raises.

Every error derives from :class:`FlowRLError`. Errors caused by what a caller passed
(``SchemaError`` and friends) leave the hub unchanged. Failures of user code running
inside a stage are wrapped in :class:`StageError`, chained with ``from``.

::

    FlowRLError
    ├── ConfigError                 a config object or argument is invalid
    ├── SchemaError                 a column's declared type does not match the data
    │   ├── UnknownColumnError      a column name the hub does not know
    │   └── LengthMismatchError     columns of one put() disagree on the sample count
    ├── UnknownIndexError           a sample index that does not exist (or was evicted)
    ├── UnknownTaskError            a task that was never registered
    ├── LeaseError                  acking/releasing a lease that is unknown or expired
    ├── DuplicatePut                a producer's put (id, seq) that the hub already holds
    ├── WouldBlock                  a *_nowait call found nothing to do right now
    │   ├── NothingReady            claim_nowait: no claimable samples
    │   └── HubFull                 put_nowait: capacity is exhausted
    ├── Timeout                     a blocking call ran out of time
    ├── EndOfStream                 the stream is closed and nothing more will be ready
    ├── HubClosed                   the hub was shut down
    ├── TransportError              a server could not be reached or answered garbage
    │   └── ResourceExhausted       this process ran out of sockets, descriptors or memory
    ├── JournalError                a journal on disk is corrupt or incompatible
    ├── StageError                  user code in a stage raised (see ``__cause__``)
    └── PipelineError               a pipeline spec is invalid (missing producer, cycle)
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DuplicatePut",
    "EndOfStream",
    "FlowRLError",
    "HubClosed",
    "HubFull",
    "JournalError",
    "LeaseError",
    "LengthMismatchError",
    "NothingReady",
    "PipelineError",
    "ResourceExhausted",
    "SchemaError",
    "StageError",
    "Timeout",
    "TransportError",
    "UnknownColumnError",
    "UnknownIndexError",
    "UnknownTaskError",
    "WouldBlock",
]


class FlowRLError(Exception):
    """Root of every error flowrl raises."""


class ConfigError(FlowRLError, ValueError):
    """A configuration object or argument is invalid."""


class SchemaError(FlowRLError, TypeError):
    """Data does not match a column's declared type, shape or kind."""


class UnknownColumnError(SchemaError, KeyError):
    """A column name that is not declared on the hub."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class LengthMismatchError(SchemaError):
    """Columns written together disagree on the number of samples."""


class UnknownIndexError(FlowRLError, KeyError):
    """A sample index that was never allocated or has been evicted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownTaskError(FlowRLError, KeyError):
    """A consuming task that was never registered with the hub."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LeaseError(FlowRLError):
    """A lease that is unknown, already settled or expired."""


class DuplicatePut(FlowRLError):
    """A put whose ``(producer, seq)`` the hub already committed: ``indices`` are the
    samples that put made. ``put`` answers such a re-sent put with them instead of
    raising; this type carries that answer across processes."""

    def __init__(self, message: str, *, indices: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.indices = indices

    def __reduce__(self) -> tuple[object, ...]:  # keep the indices across processes
        return (_rebuild_duplicate_put, (str(self), self.indices))


def _rebuild_duplicate_put(message: str, indices: tuple[int, ...]) -> DuplicatePut:
    return DuplicatePut(message, indices=indices)


class WouldBlock(FlowRLError):
    """A non-blocking call could not proceed without waiting."""


class NothingReady(WouldBlock):
    """``claim_nowait`` found no claimable samples."""


class HubFull(WouldBlock):
    """``put_nowait`` found the hub at capacity."""


class Timeout(FlowRLError, TimeoutError):
    """A blocking call ran out of time."""


class EndOfStream(FlowRLError):
    """The stream was ended and no more samples will become ready for this task."""


class HubClosed(FlowRLError):
    """The hub has been shut down."""


class TransportError(FlowRLError, ConnectionError):
    """A hub server could not be reached or sent a malformed reply."""


class ResourceExhausted(TransportError):
    """This process ran out of a resource the hub's connections need (file descriptors,
    sockets, memory)."""


class StageError(FlowRLError):
    """User code inside a stage raised; the original exception is ``__cause__``."""

    def __init__(self, message: str, *, stage: str = "", indices: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.stage = stage
        self.indices = indices

    def __reduce__(self) -> tuple[object, ...]:  # keep stage/indices across processes
        return (_rebuild_stage_error, (str(self), self.stage, self.indices))


class PipelineError(FlowRLError, ValueError):
    """A pipeline specification is invalid (a column without producer, a cycle, ...)."""


def _rebuild_stage_error(message: str, stage: str, indices: tuple[int, ...]) -> StageError:
    return StageError(message, stage=stage, indices=indices)


class JournalError(FlowRLError):
    """A journal (or persisted storage) on disk is corrupt or from an incompatible version."""

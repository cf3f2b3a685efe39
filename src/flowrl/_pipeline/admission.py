"""Bounded staleness η (AReaL): admit new rollouts only as fast as the trainer catches up.

With ``B`` samples trained per policy version and the hub at version ``v`` (counted from
the version when the controller was created), a producer may have admitted at most
``(v + η + 1) * B`` samples. A trainer that takes ``B`` samples per version in
admission order (whole steps, e.g. one group id per step) therefore never trains on a
sample produced more than η versions ago; one that takes the oldest *ready* samples can
overtake a straggler and train it one version later (see docs/staleness.md):

* η = 0 — synchronous, on-policy: version ``v`` is trained only on data it generated;
* η = 1 — one-step-off: generation of step ``v + 1`` overlaps training of step ``v``;
* η = k — fully asynchronous, at most ``k`` versions behind.

The count is local to this controller (one per process: all source workers of a threads
executor share it). It follows the hub's version through its ``VersionPublished`` events
(an admission within the bound costs no round trip to the hub); at the bound it asks the
hub once (a version published a moment ago may not have arrived as an event yet), and
again every ``REFRESH_S`` while blocked (an event the subscription lost cannot block it). A
sample's version is the hub's version when it is put, or the ``version=`` its producer
passes, which is never older than its admission.
"""

from __future__ import annotations

import threading
import time
from typing import Any, final

import msgspec

from flowrl.errors import ConfigError, Timeout, WouldBlock
from flowrl.events import Event, VersionPublished

#: While a producer is blocked, the hub's version is read from the hub this often (events
#: bring it at once; this only guards against one the subscription lost).
REFRESH_S = 1.0

__all__ = ["AdmissionController", "AdmissionStats", "Staleness"]


@final
class Staleness(msgspec.Struct, frozen=True, kw_only=True):
    """How far rollout may run ahead of training.

    ``max_staleness``: η, the most versions a trained sample may lag the policy.
    ``samples_per_version``: samples the trainer consumes per published version (its
    global batch size, all data-parallel ranks together).
    """

    max_staleness: int
    samples_per_version: int

    def __post_init__(self) -> None:
        if not _int_at_least(self.max_staleness, 0):
            raise ConfigError(
                f"Staleness.max_staleness must be an int >= 0 (0 = synchronous), got "
                f"{self.max_staleness!r}"
            )
        if not _int_at_least(self.samples_per_version, 1):
            raise ConfigError(
                f"Staleness.samples_per_version must be a positive int (the trainer's global "
                f"batch size), got {self.samples_per_version!r}"
            )

    @property
    def window(self) -> int:
        """Samples that may be admitted ahead of the trainer's current version."""
        return (self.max_staleness + 1) * self.samples_per_version


@final
class AdmissionStats(msgspec.Struct, frozen=True, kw_only=True):
    """``admitted`` samples so far, ``allowed`` at ``version``; ``waiting``: producers
    blocked right now because the bound is reached."""

    admitted: int
    allowed: int
    version: int
    waiting: int


@final
class AdmissionController:
    """Blocks producers that would exceed the staleness bound; wakes on new versions.

    >>> admission = AdmissionController(hub, Staleness(max_staleness=1, samples_per_version=8))
    >>> admission.admit(8)        # before generating 8 samples; blocks while too far ahead
    >>> admission.refund(2)       # only 6 were produced
    """

    def __init__(self, hub: Any, staleness: Staleness) -> None:
        if not isinstance(staleness, Staleness):
            raise ConfigError(f"staleness must be a flowrl.Staleness, got {staleness!r}")
        self.staleness = staleness
        self._hub = hub
        self._cond = threading.Condition()
        self._base = self._version = hub.version
        self._admitted = 0
        self._waiting = 0
        self._subscription = hub.subscribe(self._on_event, events=[VersionPublished])

    def _on_event(self, event: Event) -> None:
        if isinstance(event, VersionPublished):
            self._saw_version(event.version)

    def _saw_version(self, version: int) -> None:
        with self._cond:
            if version > self._version:
                self._version = version
                self._cond.notify_all()

    def _refresh(self) -> None:
        """Read the version from the hub (called with the condition held, released during
        the call: in-process, the hub calls ``_on_event`` under its own lock)."""
        self._cond.release()
        try:
            version = self._hub.version
        finally:
            self._cond.acquire()
        self._version = max(self._version, version)

    def _allowed(self) -> int:
        return (self._version - self._base) * self.staleness.samples_per_version + (
            self.staleness.window
        )

    def admit(self, n: int, *, timeout: float | None = None) -> None:
        """Wait until ``n`` more samples fit the bound, then count them as admitted."""
        if not _int_at_least(n, 1) or n > self.staleness.window:
            raise ConfigError(
                f"admit() n must be an int in [1, {self.staleness.window}] (the staleness "
                f"window (max_staleness + 1) * samples_per_version), got {n!r}; produce in "
                "smaller batches or raise samples_per_version"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            blocked = asked = False
            try:
                while self._admitted + n > self._allowed():
                    if not asked:  # at the bound: the hub may be ahead of its events
                        asked = True
                        self._refresh()
                        continue
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        if timeout == 0:
                            raise WouldBlock(self._blocked_message(n))
                        raise Timeout(f"admit() waited {timeout}s: {self._blocked_message(n)}")
                    if not blocked:
                        blocked = True
                        self._waiting += 1
                    if not self._cond.wait(min(REFRESH_S, remaining or REFRESH_S)):
                        self._refresh()
                self._admitted += n
            finally:
                self._waiting -= blocked

    def admit_nowait(self, n: int) -> None:
        """Like :meth:`admit`, but raises :class:`~flowrl.errors.WouldBlock` at once."""
        self.admit(n, timeout=0)

    def refund(self, n: int) -> None:
        """Give back admitted samples that were not produced (a short or failed batch)."""
        with self._cond:
            if not _int_at_least(n, 0) or n > self._admitted:
                raise ConfigError(
                    f"refund() n must be an int in [0, admitted={self._admitted}], got {n!r}"
                )
            self._admitted -= n
            self._cond.notify_all()

    def _blocked_message(self, n: int) -> str:
        return (
            f"{n} more samples would exceed the staleness bound ({self._admitted} admitted, "
            f"{self._allowed()} allowed at version {self._version}); the trainer must "
            "publish a new version first"
        )

    def statistics(self) -> AdmissionStats:
        with self._cond:
            return AdmissionStats(
                admitted=self._admitted,
                allowed=self._allowed(),
                version=self._version,
                waiting=self._waiting,
            )

    def close(self) -> None:
        """Stop listening to the hub's events."""
        self._subscription.cancel()

    def __enter__(self) -> AdmissionController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _int_at_least(x: object, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low

"""StalenessMetrics: an observer that measures how off-policy the trained data is.

It follows the hub's event stream: ``Put`` events give each sample's version and token
count, ``Claimed`` events by the training task are what gets trained, and
``VersionPublished`` events close a step. A sample's *lag* is the hub's version when the
trainer claimed it minus the version that produced it; a token is *stale* when its sample's
lag is above zero. Subscribe before producing: samples put earlier are not known to it.

Partial rollouts (generation interrupted by a weight update and resumed with the new
policy) have tokens of several versions. Put the sample with the *oldest* version so the
lag here is an upper bound, and keep exact per-token versions in a ragged int64 column
(see docs/staleness.md).
"""

from __future__ import annotations

import threading
from typing import final

import msgspec

from flowrl.events import Claimed, Evicted, Put, VersionPublished
from flowrl.hooks import Observer

__all__ = ["StalenessMetrics", "StalenessStep"]


@final
class StalenessStep(msgspec.Struct, frozen=True, kw_only=True):
    """Lag of the samples the trainer claimed while the hub was at ``version``."""

    version: int
    samples: int
    tokens: int
    mean_lag: float
    max_lag: int
    stale_tokens: int

    @property
    def stale_token_fraction(self) -> float:
        return self.stale_tokens / self.tokens if self.tokens else 0.0


class _Open:
    __slots__ = ("lag_max", "lag_sum", "samples", "stale_tokens", "tokens")

    def __init__(self) -> None:
        self.samples = self.tokens = self.stale_tokens = self.lag_sum = self.lag_max = 0


@final
class StalenessMetrics(Observer):
    """Per-step version lag of what ``task`` trains on. ``hub.subscribe(metrics)``."""

    def __init__(self, task: str) -> None:
        self.task = task
        self._lock = threading.Lock()
        self._samples: dict[int, tuple[int, int]] = {}  # index -> (version, tokens)
        self._version = 0
        self._open = _Open()
        self._done: list[StalenessStep] = []

    def on_put(self, event: Put) -> None:
        versions = event.versions or (event.version,) * len(event.indices)
        with self._lock:
            for i, tok, version in zip(event.indices, event.tokens, versions, strict=True):
                old = self._samples.get(i)
                if old is not None and not event.new and version < 0:  # version unchanged
                    version = old[0]
                self._samples[i] = (version, tok)

    def on_claim(self, event: Claimed) -> None:
        if event.task != self.task:
            return
        with self._lock:
            step = self._open
            for i in event.indices:
                known = self._samples.get(i)
                if known is None:
                    continue
                lag = self._version - known[0]
                step.samples += 1
                step.tokens += known[1]
                step.lag_sum += lag
                step.lag_max = max(step.lag_max, lag)
                if lag > 0:
                    step.stale_tokens += known[1]

    def on_version(self, event: VersionPublished) -> None:
        with self._lock:
            self._close()
            self._version = event.version

    def on_evict(self, event: Evicted) -> None:
        with self._lock:
            for i in event.indices:
                self._samples.pop(i, None)

    def _close(self) -> None:
        step = self._summary()
        if step is not None:
            self._done.append(step)
        self._open = _Open()

    def _summary(self) -> StalenessStep | None:
        step = self._open
        if not step.samples:
            return None
        return StalenessStep(
            version=self._version,
            samples=step.samples,
            tokens=step.tokens,
            mean_lag=step.lag_sum / step.samples,
            max_lag=step.lag_max,
            stale_tokens=step.stale_tokens,
        )

    def steps(self) -> list[StalenessStep]:
        """One entry per version the trainer claimed samples at (the current one last)."""
        with self._lock:
            current = self._summary()
            return [*self._done, current] if current is not None else list(self._done)

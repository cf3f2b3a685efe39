"""Request workloads for the simulator: prompt and response lengths per generation step.

A :class:`Workload` draws, for step ``s`` and a seed, ``requests_per_step`` prompt lengths
and response lengths. Response lengths follow one of:

- ``lognormal``: ``exp(N(log(median), sigma))``, identical every step;
- ``drift``: the same with ``log(median)`` growing by ``log(1 + drift_per_step)`` each step
  (responses get longer as training goes on, as RL practitioners observe);
- ``trace``: a recorded list of response lengths, resampled with replacement.

Every length is clipped to ``[min_len, max_len]`` (``max_len`` is the generation cap:
longer responses are truncated there, as ``max_tokens`` does). Draws are deterministic for
``(seed, step)`` and independent across steps.
"""

from __future__ import annotations

from typing import Literal, final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError

__all__ = ["StepRequests", "Workload"]


@final
class StepRequests(msgspec.Struct, frozen=True):
    """The requests of one step (int64 arrays of equal length)."""

    prompt: NDArray[np.int64]
    response: NDArray[np.int64]


@final
class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Distribution of prompt and response lengths (see module docstring)."""

    kind: Literal["lognormal", "drift", "trace"] = "drift"
    requests_per_step: int = 8192
    median: float = 1500.0
    sigma: float = 1.05
    drift_per_step: float = 0.06
    min_len: int = 16
    max_len: int = 32768
    prompt_median: float = 400.0
    prompt_sigma: float = 0.5
    prompt_max: int = 4096
    trace: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.requests_per_step < 1:
            raise ConfigError(f"requests_per_step must be >= 1, got {self.requests_per_step}")
        if self.median <= 0 or self.sigma < 0 or self.prompt_median <= 0:
            raise ConfigError("Workload median/prompt_median must be > 0 and sigma >= 0")
        if not 1 <= self.min_len <= self.max_len:
            raise ConfigError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.kind == "trace" and not self.trace:
            raise ConfigError("Workload(kind='trace') needs a non-empty trace of response lengths")
        if self.drift_per_step <= -1:
            raise ConfigError(f"drift_per_step must be > -1, got {self.drift_per_step}")

    def median_at(self, step: int) -> float:
        """Median response length the generator uses at ``step``."""
        if self.kind == "drift":
            return self.median * (1.0 + self.drift_per_step) ** step
        return self.median

    def draw(self, step: int, seed: int) -> StepRequests:
        rng = np.random.default_rng([seed, step])
        n = self.requests_per_step
        prompt = np.exp(rng.normal(np.log(self.prompt_median), self.prompt_sigma, n))
        prompt = np.clip(np.rint(prompt), 8, self.prompt_max).astype(np.int64)
        if self.kind == "trace":
            resp = rng.choice(np.asarray(self.trace, dtype=np.float64), size=n, replace=True)
        else:
            resp = np.exp(rng.normal(np.log(self.median_at(step)), self.sigma, n))
        resp = np.clip(np.rint(resp), self.min_len, self.max_len).astype(np.int64)
        return StepRequests(prompt=prompt, response=resp)

"""What a pipeline run returns: per-stage counts and how busy each stage was."""

from __future__ import annotations

from typing import final

import msgspec

__all__ = ["RunResult", "StageStats"]


@final
class StageStats(msgspec.Struct, frozen=True, kw_only=True):
    """One stage over a run.

    ``batches``: calls of the stage function that produced output. ``samples``: samples
    they created (a source) or consumed (any other stage). ``busy_s``: seconds spent
    inside the stage function, all workers together. ``busy_fraction``: ``busy_s`` over
    the run's wall time times ``workers`` — near 1 means the stage is the bottleneck.
    ``restarts``: dead workers of the stage that were replaced (process and Ray executors).
    ``expired``: batches whose lease expired while the stage function ran; their samples
    went to another worker and the result was dropped (raise the stage's ``lease_timeout``).
    """

    name: str
    workers: int
    batches: int
    samples: int
    busy_s: float
    busy_fraction: float
    restarts: int = 0
    expired: int = 0


@final
class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """``stages`` by name, in pipeline order; ``completed`` is False when the run was stopped
    (``PipelineRun.stop``) before every stage reached the end of its stream."""

    wall_s: float
    stages: dict[str, StageStats]
    completed: bool

"""What every executor does in the driver: collect worker outcomes, end streams, sum up.

Workers (threads or processes) report a :class:`WorkerReport` or an exception when they
finish. The driver ends the hub's stream once every source worker is exhausted (unless
code outside the pipeline puts external columns), stops everyone at the first failure or
at the run's deadline, and turns the reports into a :class:`RunResult`.

Executors whose workers can die without reporting (processes, Ray actors) share one
restart policy, :class:`Restarts`: a dead worker of a consuming stage is replaced by a
fresh one, at most ``max_restarts`` times per run; the samples it had leased come back
when their lease expires and go to another worker, so nothing is lost or processed twice.
A dead source worker is not replaced (started afresh, a source would create its samples
again); nor is any worker once the run is stopping. A worker that raised is no death: it
reported a StageError, which fails the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from flowrl._pipeline.constants import STOP_GRACE_S
from flowrl._pipeline.executors.worker import WorkerReport
from flowrl._pipeline.result import RunResult, StageStats
from flowrl.errors import ConfigError, StageError, Timeout

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.stage import StageSpec

__all__ = [
    "Outcome",
    "Restarts",
    "SampleQuota",
    "StopFlag",
    "check_limits",
    "check_restarts",
    "collect",
    "finish",
]


class StopFlag(Protocol):
    def is_set(self) -> bool: ...

    def set(self) -> None: ...


class Outcome(NamedTuple):
    reports: list[WorkerReport]
    errors: list[BaseException]
    timed_out: bool


def check_limits(timeout: object, max_samples: object) -> None:
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0
    ):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if max_samples is not None and (
        not isinstance(max_samples, int) or isinstance(max_samples, bool) or max_samples < 1
    ):
        raise ConfigError(f"max_samples must be a positive int, got {max_samples!r}")


def check_restarts(max_restarts: object) -> int:
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError(
            f"max_restarts must be an int >= 0 (dead workers replaced per run), got "
            f"{max_restarts!r}"
        )
    return max_restarts


class Restarts:
    """The restart policy of one run: which dead workers are replaced, and how many were.

    ``replace`` is called by the driver when a worker died without reporting; it returns
    None when the executor should start a fresh worker in its place (one restart used), or
    the StageError that fails the run.
    """

    def __init__(self, max_restarts: int) -> None:
        self.left = check_restarts(max_restarts)
        self.by_stage: dict[str, int] = {}

    def replace(self, spec: StageSpec, name: str, how: str, stop: StopFlag) -> StageError | None:
        """``name``: the worker's name; ``how``: how it died ("was killed by SIGKILL")."""
        if spec.is_source:
            why = (
                "a source worker is not restarted (started afresh it would create its "
                "samples again)"
            )
        elif stop.is_set():
            return StageError(
                f"the worker {name} of stage {spec.name!r} {how} while the run was stopping",
                stage=spec.name,
            )
        elif self.left > 0:
            self.left -= 1
            self.by_stage[spec.name] = self.by_stage.get(spec.name, 0) + 1
            return None
        else:
            used = sum(self.by_stage.values())
            why = (
                f"no restart is left ({used} dead worker(s) already replaced in this run; "
                "raise max_restarts= of the executor to allow more)"
            )
        return StageError(
            f"the worker {name} of stage {spec.name!r} {how} before reporting, and {why}; "
            "the samples it had leased return to the hub when their lease expires",
            stage=spec.name,
        )


def collect(
    pipeline: Pipeline,
    hub: HubClient,
    receive: Callable[[float], WorkerReport | BaseException | None],
    n_workers: int,
    stop: StopFlag,
    timeout: float | None,
    t0: float,
) -> Outcome:
    """Wait for ``n_workers`` outcomes; ``receive(wait)`` returns one or None after ``wait``."""
    sources_left = sum(s.workers for s in pipeline.stages if s.is_source)
    source_names = {s.name for s in pipeline.stages if s.is_source}
    reports: list[WorkerReport] = []
    errors: list[BaseException] = []
    timed_out = False
    deadline = None if timeout is None else t0 + timeout
    grace_end: float | None = None
    while len(reports) + len(errors) < n_workers:
        now = time.perf_counter()
        if grace_end is None and stop.is_set():
            grace_end = now + STOP_GRACE_S
        limit = deadline if grace_end is None else grace_end
        if limit is not None and now >= limit:
            if grace_end is not None:
                break  # give up on workers stuck inside a stage function
            timed_out = True
            stop.set()
            continue
        item = receive(0.5 if limit is None else min(0.5, limit - now))
        if item is None:
            continue
        if isinstance(item, BaseException):
            errors.append(item)
            stop.set()
            continue
        reports.append(item)
        if item.stage in source_names and item.ended:
            sources_left -= 1
            if sources_left == 0 and not pipeline.external and not stop.is_set():
                hub.end_stream(pipeline.source_columns)
    return Outcome(reports, errors, timed_out)


def finish(
    pipeline: Pipeline,
    outcome: Outcome,
    n_workers: int,
    wall: float,
    timeout: float | None,
    stuck: Sequence[str],
    restarts: Restarts | None = None,
) -> RunResult:
    """Raise the first failure (or a Timeout), else sum the reports per stage."""
    if outcome.errors:
        first = outcome.errors[0]
        for other in outcome.errors[1:]:
            first.add_note(f"also failed: {other}")
        raise first
    if outcome.timed_out:
        raise Timeout(
            f"the pipeline did not finish within timeout={timeout}s"
            + (f"; still inside a stage function: {sorted(stuck)}" if stuck else "")
            + "; raise the timeout or check for a stage waiting on a column nobody writes"
        )
    stages: dict[str, StageStats] = {}
    for spec in pipeline.stages:
        mine = [r for r in outcome.reports if r.stage == spec.name]
        busy = sum(r.busy_s for r in mine)
        stages[spec.name] = StageStats(
            name=spec.name,
            workers=spec.workers,
            batches=sum(r.batches for r in mine),
            samples=sum(r.samples for r in mine),
            busy_s=busy,
            busy_fraction=busy / (wall * spec.workers) if wall > 0 else 0.0,
            restarts=0 if restarts is None else restarts.by_stage.get(spec.name, 0),
            expired=sum(r.expired for r in mine),
        )
    completed = len(outcome.reports) == n_workers and all(r.ended for r in outcome.reports)
    return RunResult(wall_s=wall, stages=stages, completed=completed)


class SampleQuota:
    """``max_samples`` shared by the source workers of one run (``take`` reserves a call)."""

    def __init__(self, total: int) -> None:
        self._left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= n
            return True

    def refund(self, n: int) -> None:
        with self._lock:
            self._left += n

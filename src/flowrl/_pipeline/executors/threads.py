"""The embedded executor: every stage worker is a thread of this process.

Zero-copy with the in-process hub; torch releases the GIL in its kernels, so model stages
overlap. The driver (the thread calling ``run``) starts the workers, ends the stream once
every source is exhausted, and collects reports; the first failure stops everyone.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, final

from flowrl._pipeline.admission import AdmissionController
from flowrl._pipeline.constants import STOP_GRACE_S
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.worker import WorkerReport, run_worker
from flowrl._pipeline.result import RunResult, StageStats
from flowrl.errors import ConfigError, Timeout

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.stage import StageSpec

__all__ = ["ThreadExecutor", "stage_stats"]


@final
class ThreadExecutor(Executor):
    """Run each stage's ``workers`` as threads. ``timeout``: seconds for the whole run
    (raises :class:`~flowrl.errors.Timeout`); ``max_samples``: stop the sources once they
    have created this many samples (the call in flight completes)."""

    def __init__(self, *, timeout: float | None = None, max_samples: int | None = None) -> None:
        if timeout is not None and (not isinstance(timeout, int | float) or not timeout > 0):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if max_samples is not None and (
            not isinstance(max_samples, int) or isinstance(max_samples, bool) or max_samples < 1
        ):
            raise ConfigError(f"max_samples must be a positive int, got {max_samples!r}")
        self.timeout = timeout
        self.max_samples = max_samples
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self, pipeline: Pipeline, hub: HubClient) -> RunResult:
        stop = self._stop
        pipeline.register(hub)
        admission = AdmissionController(hub, pipeline.staleness) if pipeline.staleness else None
        quota = _Quota(self.max_samples) if self.max_samples is not None else None
        done: queue.Queue[WorkerReport | BaseException] = queue.Queue()

        def main(spec: StageSpec, worker: int) -> None:
            try:
                done.put(run_worker(spec, worker, hub, stop, admission=admission, quota=quota))
            except BaseException as exc:
                stop.set()
                done.put(exc)

        threads = [
            threading.Thread(
                target=main, args=(spec, w), name=f"flowrl-{spec.name}-{w}", daemon=True
            )
            for spec in pipeline.stages
            for w in range(spec.workers)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        try:
            reports, errors, timed_out = self._collect(pipeline, hub, done, len(threads), t0)
        finally:
            stop.set()
            if admission is not None:
                admission.close()
            self._stop = threading.Event()  # the executor can run again
        wall = time.perf_counter() - t0
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"also failed: {other}")
            raise first
        if timed_out:
            running = sorted({t.name for t in threads if t.is_alive()})
            raise Timeout(
                f"the pipeline did not finish within timeout={self.timeout}s"
                + (f"; still inside a stage function: {running}" if running else "")
                + "; raise the timeout or check for a stage waiting on a column nobody writes"
            )
        return RunResult(
            wall_s=wall,
            stages=stage_stats(pipeline, reports, wall),
            completed=len(reports) == len(threads) and all(r.ended for r in reports),
        )

    def _collect(
        self,
        pipeline: Pipeline,
        hub: HubClient,
        done: queue.Queue[WorkerReport | BaseException],
        n_workers: int,
        t0: float,
    ) -> tuple[list[WorkerReport], list[BaseException], bool]:
        """Wait for every worker; end the stream when the sources are exhausted."""
        sources_left = sum(s.workers for s in pipeline.stages if s.is_source)
        source_names = {s.name for s in pipeline.stages if s.is_source}
        reports: list[WorkerReport] = []
        errors: list[BaseException] = []
        timed_out = False
        deadline = None if self.timeout is None else t0 + self.timeout
        grace_end: float | None = None
        while len(reports) + len(errors) < n_workers:
            now = time.perf_counter()
            if grace_end is None and self._stop.is_set():
                grace_end = now + STOP_GRACE_S
            limit = deadline if grace_end is None else grace_end
            if limit is not None and now >= limit:
                if grace_end is not None:
                    break  # give up on workers stuck inside a stage function
                timed_out = True
                self._stop.set()
                continue
            try:
                item = done.get(timeout=0.5 if limit is None else min(0.5, limit - now))
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                errors.append(item)
                continue
            reports.append(item)
            if item.stage in source_names and item.ended:
                sources_left -= 1
                if sources_left == 0 and not pipeline.external and not self._stop.is_set():
                    hub.end_stream(pipeline.source_columns)
        return reports, errors, timed_out


def stage_stats(
    pipeline: Pipeline, reports: list[WorkerReport], wall: float
) -> dict[str, StageStats]:
    """Sum worker reports per stage, in pipeline order."""
    out: dict[str, StageStats] = {}
    for spec in pipeline.stages:
        mine = [r for r in reports if r.stage == spec.name]
        busy = sum(r.busy_s for r in mine)
        out[spec.name] = StageStats(
            name=spec.name,
            workers=spec.workers,
            batches=sum(r.batches for r in mine),
            samples=sum(r.samples for r in mine),
            busy_s=busy,
            busy_fraction=busy / (wall * spec.workers) if wall > 0 else 0.0,
        )
    return out


class _Quota:
    """``max_samples`` shared by the source workers of one run."""

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

"""The embedded executor: every stage worker is a thread of this process.

Zero-copy with the in-process hub; torch releases the GIL in its kernels, so model stages
overlap. The driver (the thread calling ``run``) starts the workers and collects their
reports; the first failure stops everyone.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, final

from flowrl._pipeline.admission import AdmissionController
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.driver import SampleQuota, check_limits, collect, finish
from flowrl._pipeline.executors.worker import WorkerReport, run_worker

if TYPE_CHECKING:
    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.result import RunResult
    from flowrl._pipeline.stage import StageSpec

__all__ = ["ThreadExecutor"]


@final
class ThreadExecutor(Executor):
    """Run each stage's ``workers`` as threads. ``timeout``: seconds for the whole run
    (raises :class:`~flowrl.errors.Timeout`); ``max_samples``: stop the sources once they
    have created this many samples (the call in flight completes)."""

    def __init__(self, *, timeout: float | None = None, max_samples: int | None = None) -> None:
        check_limits(timeout, max_samples)
        self.timeout = timeout
        self.max_samples = max_samples
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self, pipeline: Pipeline, hub: HubClient) -> RunResult:
        stop = self._stop
        pipeline.register(hub)
        admission = AdmissionController(hub, pipeline.staleness) if pipeline.staleness else None
        quota = SampleQuota(self.max_samples) if self.max_samples is not None else None
        done: queue.Queue[WorkerReport | BaseException] = queue.Queue()

        def main(spec: StageSpec, worker: int) -> None:
            try:
                done.put(run_worker(spec, worker, hub, stop, admission=admission, quota=quota))
            except BaseException as exc:
                stop.set()
                done.put(exc)

        def receive(wait: float) -> WorkerReport | BaseException | None:
            try:
                return done.get(timeout=wait)
            except queue.Empty:
                return None

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
            outcome = collect(pipeline, hub, receive, len(threads), stop, self.timeout, t0)
        finally:
            stop.set()
            if admission is not None:
                admission.close()
            self._stop = threading.Event()  # the executor can run again
        stuck = [t.name for t in threads if t.is_alive()]
        return finish(
            pipeline, outcome, len(threads), time.perf_counter() - t0, self.timeout, stuck
        )

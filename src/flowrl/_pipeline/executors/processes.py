"""The multi-process executor: every stage worker is a process with its own hub client.

The hub must be a multi-process one (``flowrl.launch_hub``): each worker process
``flowrl.connect``\\ s to its address, so payload bytes go from the storage units to the
worker directly. Processes are started with ``spawn`` (safe with torch and threads), so
stage functions and classes must be importable: defined at module level.

Reports and failures come back as msgspec-encoded bytes. A failure keeps its stage, sample
indices and message; its ``__cause__`` is a ``RuntimeError`` naming the original type,
with the worker's traceback as a note (the original exception object stays in its
process). A worker process that dies without reporting (killed, segfault) fails the run;
its leases expire after their ``lease_timeout`` and the samples return to the hub.

With ``staleness`` or ``max_samples``, the admission controller and the sample quota live
in one helper process (a ``multiprocessing`` manager) that every source worker calls.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import pickle
import queue
import time
import traceback
from multiprocessing.managers import BaseManager
from typing import TYPE_CHECKING, Any, final

import msgspec

from flowrl._pipeline.admission import AdmissionController, Staleness
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.driver import SampleQuota, check_limits, collect, finish
from flowrl._pipeline.executors.worker import WorkerReport, run_worker
from flowrl.errors import ConfigError, StageError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.result import RunResult
    from flowrl._pipeline.stage import StageSpec
    from flowrl._schema.columns import Column

__all__ = ["ProcessExecutor"]


class _Failure(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    stage: str
    worker: int
    indices: tuple[int, ...]
    message: str
    cause: str
    traceback: str


decoder = msgspec.msgpack.Decoder(WorkerReport | _Failure)


@final
class ProcessExecutor(Executor):
    """Run each stage worker as a process. ``timeout`` and ``max_samples`` as for threads."""

    def __init__(self, *, timeout: float | None = None, max_samples: int | None = None) -> None:
        check_limits(timeout, max_samples)
        self.timeout = timeout
        self.max_samples = max_samples
        self._ctx = mp.get_context("spawn")
        self._stop = self._ctx.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self, pipeline: Pipeline, hub: HubClient) -> RunResult:
        address = getattr(hub, "address", None)
        if not isinstance(address, str):
            raise ConfigError(
                "executor='processes' needs a multi-process hub that worker processes can "
                "connect to: hub = flowrl.launch_hub(pipeline.columns)"
            )
        for spec in pipeline.stages:
            _check_importable(spec)
        from flowrl._transport.launch import connect

        pipeline.register(hub)
        stop = self._stop
        results = self._ctx.Queue()
        helper = self._helper(address, pipeline.staleness)
        try:
            open_hub = functools.partial(connect, address)
            procs = [
                self._ctx.Process(
                    target=worker_main,
                    args=(spec, w, open_hub, stop, results, *helper[1:]),
                    name=f"flowrl-{spec.name}-{w}",
                    daemon=True,
                )
                for spec in pipeline.stages
                for w in range(spec.workers)
            ]
            t0 = time.perf_counter()
            for p in procs:
                p.start()
            reported: set[str] = set()

            def receive(wait: float) -> WorkerReport | BaseException | None:
                try:
                    item = decoder.decode(results.get(timeout=wait))
                except queue.Empty:
                    return _dead(procs, reported)
                reported.add(f"flowrl-{item.stage}-{item.worker}")
                return outcome_of(item)

            try:
                outcome = collect(pipeline, hub, receive, len(procs), stop, self.timeout, t0)
            finally:
                stop.set()
                for p in procs:
                    p.join(timeout=1.0)
                    if p.is_alive():
                        p.terminate()
                        p.join()
            stuck = [p.name for p in procs if p.name not in reported]
            return finish(
                pipeline, outcome, len(procs), time.perf_counter() - t0, self.timeout, stuck
            )
        finally:
            if helper[0] is not None:
                helper[0].shutdown()
            self._stop = self._ctx.Event()  # the executor can run again

    def default_hub(self, columns: Sequence[Column]) -> HubClient:
        from flowrl._transport.launch import launch_hub

        return launch_hub(columns)

    def _helper(self, address: str, staleness: Staleness | None) -> tuple[Any, Any, Any]:
        """(manager, admission proxy, quota proxy); a manager only when one is needed."""
        if staleness is None and self.max_samples is None:
            return None, None, None
        manager = _Shared(ctx=self._ctx)
        manager.start()
        admission = manager.Admission(address, staleness) if staleness else None  # type: ignore[attr-defined]
        quota = (
            manager.Quota(self.max_samples) if self.max_samples is not None else None  # type: ignore[attr-defined]
        )
        return manager, admission, quota


class _Shared(BaseManager):
    """Serves the admission controller and the quota to every worker process."""


def _admission(address: str, staleness: Staleness) -> AdmissionController:
    from flowrl._transport.launch import connect

    return AdmissionController(connect(address), staleness)


_Shared.register("Admission", callable=_admission)
_Shared.register("Quota", callable=SampleQuota)


def worker_main(
    spec: StageSpec,
    worker: int,
    open_hub: Callable[[], HubClient],
    stop: Any,
    results: Any,
    admission: Any,
    quota: Any,
) -> None:
    """A worker in its own process: run it with a hub client of its own and put its
    report, or its failure, on ``results`` (msgspec-encoded; decode with ``decoder``)."""
    encoder = msgspec.msgpack.Encoder()
    try:
        with open_hub() as hub:
            report = run_worker(spec, worker, hub, stop, admission=admission, quota=quota)
        results.put(encoder.encode(report))
    except BaseException as exc:
        stop.set()
        cause = exc.__cause__ if isinstance(exc, StageError) and exc.__cause__ else exc
        results.put(
            encoder.encode(
                _Failure(
                    stage=spec.name,
                    worker=worker,
                    indices=exc.indices if isinstance(exc, StageError) else (),
                    message=str(exc),
                    cause=f"{type(cause).__name__}: {cause}",
                    traceback="".join(traceback.format_exception(cause)),
                )
            )
        )


def outcome_of(item: WorkerReport | _Failure) -> WorkerReport | StageError:
    """What ``collect`` takes from a decoded worker message: a report or a StageError."""
    return _as_error(item) if isinstance(item, _Failure) else item


def _as_error(failure: _Failure) -> StageError:
    cause = RuntimeError(failure.cause)
    cause.add_note(f"in worker process {failure.worker} of stage {failure.stage!r}:")
    cause.add_note(failure.traceback)
    err = StageError(failure.message, stage=failure.stage, indices=failure.indices)
    err.__cause__ = cause
    return err


def _dead(procs: list[Any], reported: set[str]) -> StageError | None:
    """A worker process that exited without reporting (killed, crashed) fails the run."""
    for p in procs:
        if p.exitcode is not None and p.name not in reported:
            reported.add(p.name)
            stage = p.name.removeprefix("flowrl-").rsplit("-", 1)[0]
            return StageError(
                f"the worker process {p.name} of stage {stage!r} died with exit code "
                f"{p.exitcode} before reporting; its leases return to the hub when they expire",
                stage=stage,
            )
    return None


def _check_importable(spec: StageSpec) -> None:
    try:
        pickle.dumps(spec)
    except Exception as exc:
        raise ConfigError(
            f"{spec.where} cannot be sent to a worker process ({exc}); define the function or "
            "class at module level (not inside a function or as a lambda), or use "
            "executor='threads'"
        ) from None

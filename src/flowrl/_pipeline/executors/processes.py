"""The multi-process executor: every stage worker is a process with its own hub client.

The hub must be a multi-process one (``flowrl.launch_hub``): each worker process
``flowrl.connect``\\ s to its address, so payload bytes go from the storage units to the
worker directly. Processes are started with ``spawn`` (safe with torch and threads), so
stage functions and classes must be importable: defined at module level.

Reports and failures come back as msgspec-encoded bytes. A failure keeps its stage, sample
indices and message; its ``__cause__`` is a ``RuntimeError`` naming the original type,
with the worker's traceback as a note (the original exception object stays in its
process), and it fails the run.

A worker process that dies without reporting (SIGKILL, a segfault, the OOM killer) is
replaced by a fresh process, at most ``max_restarts`` times per run (the restart policy
of :mod:`.driver`, shared with the Ray executor); the fresh worker claims under a consumer
id of its own, and the samples the dead one had leased return to the hub when their lease
expires (the stage's ``lease_timeout``) and go to another worker: nothing is lost or
processed twice. Past ``max_restarts``, or for a source worker, the death fails the run
with a StageError. A worker limits torch to the CPUs its stage reserved
(``torch.set_num_threads``), as under Ray.

With ``staleness`` or ``max_samples``, the admission controller and the sample quota live
in one helper process (a ``multiprocessing`` manager) that every source worker calls.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import time
import traceback
from multiprocessing.managers import BaseManager
from typing import TYPE_CHECKING, Any, final

import msgspec

from flowrl._pipeline.admission import AdmissionController, Staleness
from flowrl._pipeline.constants import MAX_RESTARTS
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.driver import (
    Restarts,
    SampleQuota,
    check_limits,
    check_restarts,
    collect,
    finish,
)
from flowrl._pipeline.executors.worker import WorkerReport, run_worker
from flowrl.errors import ConfigError, StageError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from flowrl._client.base import HubClient
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.result import RunResult
    from flowrl._pipeline.stage import StageSpec
    from flowrl._schema.columns import Column
    from flowrl._transport.auth import HubKey

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
    """Run each stage worker as a process. ``timeout`` and ``max_samples`` as for threads;
    ``max_restarts``: dead worker processes replaced per run before the run fails."""

    def __init__(
        self,
        *,
        timeout: float | None = None,
        max_samples: int | None = None,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        check_limits(timeout, max_samples)
        self.timeout = timeout
        self.max_samples = max_samples
        self.max_restarts = check_restarts(max_restarts)
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
        from flowrl._launch.processes import connect

        pipeline.register(hub)
        stop = self._stop
        results = self._ctx.Queue()
        key = getattr(hub, "key", None)  # (a hub on TCP admits only holders of its key)
        helper = self._helper(address, pipeline.staleness, key)
        try:
            open_hub = functools.partial(connect, address, key=key)
            workers = _Workers(
                functools.partial(self._ctx.Process, target=worker_main, daemon=True),
                (open_hub, stop, results, *helper[1:]),
                Restarts(self.max_restarts),
            )
            for spec in pipeline.stages:
                for w in range(spec.workers):
                    workers.add(spec, w)
            t0 = time.perf_counter()
            workers.start_all()

            def receive(wait: float) -> WorkerReport | BaseException | None:
                try:
                    data = results.get(timeout=wait)
                except queue.Empty:
                    # A report may land just before its worker exits: read it first.
                    dead = workers.dead()
                    if dead is None:
                        return None
                    try:
                        data = results.get_nowait()
                    except queue.Empty:
                        return workers.replace(dead, stop)
                item = decoder.decode(data)
                workers.reported.add(_name(item.stage, item.worker))
                return outcome_of(item)

            try:
                outcome = collect(pipeline, hub, receive, len(workers), stop, self.timeout, t0)
            finally:
                stop.set()
                workers.join_all()
            stuck = [name for name in workers.procs if name not in workers.reported]
            wall = time.perf_counter() - t0
            return finish(
                pipeline, outcome, len(workers), wall, self.timeout, stuck, workers.restarts
            )
        finally:
            if helper[0] is not None:
                helper[0].shutdown()
            self._stop = self._ctx.Event()  # the executor can run again

    def default_hub(self, columns: Sequence[Column]) -> HubClient:
        from flowrl._launch.processes import launch_hub

        return launch_hub(columns)

    def _helper(
        self, address: str, staleness: Staleness | None, key: HubKey | None
    ) -> tuple[Any, Any, Any]:
        """(manager, admission proxy, quota proxy); a manager only when one is needed."""
        if staleness is None and self.max_samples is None:
            return None, None, None
        manager = _Shared(ctx=self._ctx)
        manager.start()
        admission = manager.Admission(address, staleness, key) if staleness else None  # type: ignore[attr-defined]
        quota = (
            manager.Quota(self.max_samples) if self.max_samples is not None else None  # type: ignore[attr-defined]
        )
        return manager, admission, quota


def _name(stage: str, worker: int) -> str:
    return f"flowrl-{stage}-{worker}"


class _Workers:
    """The worker processes of one run, by name; dead ones are replaced in place."""

    def __init__(
        self, make: Callable[..., Any], shared_args: tuple[Any, ...], restarts: Restarts
    ) -> None:
        self._make = make
        self._shared_args = shared_args
        self.restarts = restarts
        self.procs: dict[str, Any] = {}
        self.specs: dict[str, tuple[StageSpec, int]] = {}
        self.reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.procs)

    def add(self, spec: StageSpec, worker: int) -> None:
        name = _name(spec.name, worker)
        self.specs[name] = (spec, worker)
        self.procs[name] = self._new(name)

    def _new(self, name: str) -> Any:
        spec, worker = self.specs[name]
        return self._make(args=(spec, worker, *self._shared_args), name=name)

    def start_all(self) -> None:
        for p in self.procs.values():
            p.start()

    def dead(self) -> str | None:
        """A worker process that exited without reporting (killed, crashed), if any."""
        for name, p in self.procs.items():
            if p.exitcode is not None and name not in self.reported:
                return name
        return None

    def replace(self, name: str, stop: Any) -> StageError | None:
        """Start a fresh process in place of dead ``name``, or say why the run fails."""
        spec, _ = self.specs[name]
        old = self.procs[name]
        old.join()
        err = self.restarts.replace(spec, f"process {name}", _how(old.exitcode), stop)
        if err is not None:
            self.reported.add(name)
            return err
        fresh = self._new(name)
        fresh.start()
        self.procs[name] = fresh
        return None

    def join_all(self) -> None:
        for p in self.procs.values():
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
                p.join()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class _Shared(BaseManager):
    """Serves the admission controller and the quota to every worker process."""


def _admission(address: str, staleness: Staleness, key: HubKey | None) -> AdmissionController:
    from flowrl._launch.processes import connect

    return AdmissionController(connect(address, key=key), staleness)


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
    limit_torch_threads(spec)
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


def limit_torch_threads(spec: StageSpec) -> None:
    """Limit torch, if the stage's module imported it, to the CPUs the stage reserved:
    worker processes on one machine must not each start a thread per core."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, int(spec.num_cpus)))


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


def _check_importable(spec: StageSpec) -> None:
    try:
        pickle.dumps(spec)
    except Exception as exc:
        raise ConfigError(
            f"{spec.where} cannot be sent to a worker process ({exc}); define the function or "
            "class at module level (not inside a function or as a lambda), or use "
            "executor='threads'"
        ) from None

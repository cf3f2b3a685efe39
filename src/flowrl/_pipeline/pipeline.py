"""Pipeline: a frozen, validated graph of stages connected by the columns they read and write.

Construction checks the whole graph: stage names are unique (each names a hub task),
every column has one producer, every input is produced by a stage or declared in
``columns=`` (an *external* column, put by code outside the pipeline), every column has a
type, and there is no cycle (the error names it). Running is an executor's job.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import cast, final

import msgspec

from flowrl._client.base import HubClient
from flowrl._pipeline.admission import Staleness
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.processes import ProcessExecutor
from flowrl._pipeline.executors.ray import RayExecutor
from flowrl._pipeline.executors.threads import ThreadExecutor
from flowrl._pipeline.loader import Loader
from flowrl._pipeline.result import RunResult
from flowrl._pipeline.stage import StageSpec
from flowrl._schema.columns import Column
from flowrl.errors import ConfigError, PipelineError, Timeout

__all__ = ["Pipeline", "PipelineRun"]


@final
class Pipeline(msgspec.Struct, frozen=True):
    """Stages and the types of their columns. ``Pipeline([gen, score, train], columns=[...])``.

    ``columns``: types of the columns that stages name without a ``Column`` (after
    construction: every column the pipeline uses). ``staleness``: bound how far the source
    stages may run ahead of the policy version (see :class:`~flowrl.Staleness`).
    """

    stages: Sequence[StageSpec]  # a tuple after construction
    columns: Sequence[Column] = ()  # a tuple after construction
    staleness: Staleness | None = None

    def __post_init__(self) -> None:
        stages = _check_stages(self.stages)
        columns = _merge_columns(stages, self.columns)
        producer = _producers(stages)
        for spec in stages:
            for name in spec.inputs:
                if name not in producer and name not in columns:
                    raise PipelineError(
                        f"{spec.where} reads column {name!r}, which no stage produces and "
                        f"which is not declared; add a stage with outputs=[{name!r}], or, if "
                        "code outside the pipeline puts it, declare its type in "
                        "Pipeline(columns=[...])"
                    )
            for name in spec.outputs:
                if name not in columns:
                    raise PipelineError(
                        f"{spec.where} writes column {name!r} without a type; declare it as "
                        f"outputs=[flowrl.Column.scalar({name!r}, 'float32')] (or the right "
                        "kind), or in Pipeline(columns=[...])"
                    )
        _check_acyclic(stages, producer)
        if self.staleness is not None:
            if not isinstance(self.staleness, Staleness):
                raise ConfigError(f"staleness must be a flowrl.Staleness, got {self.staleness!r}")
            if not any(s.is_source for s in stages):
                raise PipelineError(
                    "staleness bounds the source stages, but this pipeline has none; use "
                    "flowrl.AdmissionController in the code that puts the samples"
                )
        msgspec.structs.force_setattr(self, "stages", stages)
        msgspec.structs.force_setattr(self, "columns", tuple(columns.values()))

    # -- the graph --------------------------------------------------------------------------
    @property
    def external(self) -> tuple[str, ...]:
        """Columns stages read that no stage writes: code outside the pipeline puts them."""
        produced = {c for s in self.stages for c in s.outputs}
        return tuple(sorted({c for s in self.stages for c in s.inputs} - produced))

    @property
    def source_columns(self) -> tuple[str, ...]:
        """Columns written by source stages (created with new samples)."""
        return tuple(c for s in self.stages if s.is_source for c in s.outputs)

    def register(self, hub: HubClient) -> None:
        """Declare the columns on ``hub`` and register one task per consuming stage."""
        hub.declare(*self.columns)
        for spec in self.stages:
            if not spec.is_source:
                hub.register_task(spec.name, spec.inputs)

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        hub: HubClient | None = None,
        *,
        executor: str | Executor = "threads",
        timeout: float | None = None,
        max_samples: int | None = None,
    ) -> RunResult:
        """Run until every stage reached the end of its stream; raise the first StageError.

        Without ``hub``, the executor makes one for the run (in-process for threads, a
        ``launch_hub`` for processes, a ``launch_ray_hub`` for Ray) and closes it after.
        ``executor``: ``"threads"`` (default), ``"processes"``, ``"ray"`` (stage workers as
        Ray actors, see :class:`~flowrl.RayExecutor`) or an :class:`Executor`. ``timeout``:
        seconds for the whole run. ``max_samples``: stop the sources after this many samples.
        """
        runner = _executor(executor, timeout, max_samples)
        if hub is not None:
            return runner.run(self, hub)
        with runner.default_hub(self.columns) as own:
            return runner.run(self, own)

    def start(
        self,
        hub: HubClient | None = None,
        *,
        executor: str | Executor = "threads",
        timeout: float | None = None,
        max_samples: int | None = None,
        loaders: Sequence[Loader] = (),
    ) -> PipelineRun:
        """Like :meth:`run`, in a background thread; returns a :class:`PipelineRun`.

        ``loaders``: :class:`~flowrl.Loader` objects of a trainer in this process; if the
        run fails, their iteration raises the run's StageError instead of waiting forever.
        """
        runner = _executor(executor, timeout, max_samples)
        return PipelineRun(self, runner, hub, tuple(loaders))


@final
class PipelineRun:
    """A pipeline running in a background thread (from :meth:`Pipeline.start`).

    ``result()`` waits for it and returns the :class:`RunResult` or raises its error;
    ``stop()`` asks it to stop early. As a context manager, leaving the block waits for the
    result (re-raising a stage's error), or stops the run if the block raised.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        executor: Executor,
        hub: HubClient | None,
        loaders: tuple[Loader, ...],
    ) -> None:
        self.pipeline = pipeline
        self.hub: HubClient = hub if hub is not None else executor.default_hub(pipeline.columns)
        self._owns_hub = hub is None
        self._executor = executor
        self._loaders = loaders
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="flowrl-pipeline", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._result = self._executor.run(self.pipeline, self.hub)
        except BaseException as exc:
            self._error = exc
            for loader in self._loaders:
                loader._abort(exc)
        finally:
            if self._owns_hub:
                self.hub.close()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._executor.stop()

    def result(self, timeout: float | None = None) -> RunResult:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise Timeout(f"the pipeline is still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return cast(RunResult, self._result)

    def __enter__(self) -> PipelineRun:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.stop()
            self._thread.join()
            return
        self.result()


def _executor(executor: str | Executor, timeout: float | None, max_samples: int | None) -> Executor:
    if isinstance(executor, Executor):
        if timeout is not None or max_samples is not None:
            raise ConfigError(
                "timeout= and max_samples= configure the built-in executors; pass them to "
                f"your {type(executor).__name__} instead"
            )
        return executor
    if executor == "threads":
        return ThreadExecutor(timeout=timeout, max_samples=max_samples)
    if executor == "processes":
        return ProcessExecutor(timeout=timeout, max_samples=max_samples)
    if executor == "ray":
        return RayExecutor(timeout=timeout, max_samples=max_samples)
    raise ConfigError(
        f"unknown executor {executor!r}; use 'threads', 'processes', 'ray' or an Executor instance"
    )


# -- validation ------------------------------------------------------------------------------
def _check_stages(stages: object) -> tuple[StageSpec, ...]:
    if isinstance(stages, StageSpec) or not isinstance(stages, Sequence) or not stages:
        raise PipelineError(
            f"Pipeline expects a non-empty list of stages, got {stages!r}; decorate functions "
            "with @flowrl.stage(...) and pass them as Pipeline([a, b, c], columns=[...])"
        )
    seen: dict[str, StageSpec] = {}
    for spec in stages:
        if not isinstance(spec, StageSpec):
            raise PipelineError(
                f"Pipeline stages must be @flowrl.stage specs, got {spec!r}; decorate it "
                "with @flowrl.stage(inputs=[...], outputs=[...], batch_size=n)"
            )
        if spec.name in seen:
            raise PipelineError(
                f"two stages are named {spec.name!r} ({seen[spec.name].file}:"
                f"{seen[spec.name].line} and {spec.file}:{spec.line}); a stage name is its hub "
                "task, so names must be unique: pass name='...' to one of them"
            )
        seen[spec.name] = spec
    return tuple(stages)


def _merge_columns(stages: tuple[StageSpec, ...], declared: object) -> dict[str, Column]:
    if isinstance(declared, Column) or not isinstance(declared, Sequence):
        raise PipelineError(f"Pipeline columns must be a list of flowrl.Column, got {declared!r}")
    columns: dict[str, Column] = {}
    where: dict[str, str] = {}
    typed = [(c, "Pipeline(columns=...)") for c in declared]
    typed += [(c, s.where) for s in stages for c in s.output_columns]
    for col, origin in typed:
        if not isinstance(col, Column):
            raise PipelineError(f"Pipeline columns must be flowrl.Column, got {col!r}")
        old = columns.get(col.name)
        if old is not None and old != col:
            raise PipelineError(
                f"column {col.name!r} is declared as {old.describe()} in {where[col.name]} and "
                f"as {col.describe()} in {origin}; declare it once"
            )
        columns[col.name] = col
        where[col.name] = origin
    return columns


def _producers(stages: tuple[StageSpec, ...]) -> dict[str, StageSpec]:
    producer: dict[str, StageSpec] = {}
    for spec in stages:
        for name in spec.outputs:
            other = producer.get(name)
            if other is not None:
                raise PipelineError(
                    f"column {name!r} is written by both {other.where} and {spec.where}; each "
                    "column has one producer: rename one output"
                )
            producer[name] = spec
    return producer


def _check_acyclic(stages: tuple[StageSpec, ...], producer: dict[str, StageSpec]) -> None:
    """Depth-first search over stage -> upstream stage; report the first cycle found."""
    upstream = {
        s.name: sorted({producer[c].name for c in s.inputs if c in producer}) for s in stages
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for up in upstream[name]:
            if state.get(up) == 1:
                loop = [*path[path.index(up) :], up][::-1]
                by_name = {s.name: s for s in stages}
                via = [
                    f"{a} writes {sorted(set(by_name[a].outputs) & set(by_name[b].inputs))} "
                    f"read by {b}"
                    for a, b in itertools.pairwise(loop)
                ]
                raise PipelineError(
                    f"the pipeline has a cycle: {' -> '.join(loop)} ({'; '.join(via)}); a stage "
                    "cannot depend on its own outputs: write a new column to break the cycle"
                )
            if up not in state:
                visit(up)
        path.pop()
        state[name] = 2

    for spec in stages:
        if spec.name not in state:
            visit(spec.name)

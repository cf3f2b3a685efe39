"""The Ray executor: every stage worker is a Ray actor with the resources its stage declares.

Workers run the process executor's worker (``worker_main``: the same loop, the same
reports and failures) with a hub client of their own, so payload bytes go between the
storage units and the worker directly, never through the driver; with a hub from
``launch_ray_hub`` (the default) a worker puts new samples on a storage unit of its own
node. Stage specs travel pickled by reference, as to spawned processes: stage functions
and classes must be importable where the workers run (the driver's ``sys.path`` is added
to theirs).

Resources per worker come from ``@stage(num_cpus=, num_gpus=, placement_strategy=)``.
With a placement strategy, each worker gets a placement group of ``num_gpus`` one-GPU
bundles: it runs in the first, and the Ray tasks and actors it starts are captured by the
group. Workers that cannot be placed within ``placement_timeout`` fail the run with a
ConfigError naming what they asked for. A worker limits torch to the CPUs it reserved
(``torch.set_num_threads``).

A worker actor that dies (ray.kill, a lost node, out of memory) is replaced by a fresh
one, at most ``max_restarts`` times per run (the restart policy of :mod:`.driver`, shared
with the process executor); the samples it had leased return to the hub when their lease
expires (the stage's ``lease_timeout``) and go to another worker, so nothing is lost or
processed twice. Past that, or for a source worker, the run fails with a StageError.

With ``staleness`` or ``max_samples``, the admission controller and the sample quota live
in one helper actor that every source worker calls.
"""

from __future__ import annotations

import functools
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

from flowrl._launch.ray_hub import import_ray
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
from flowrl._pipeline.executors.processes import (
    _check_importable,
    decoder,
    outcome_of,
    worker_main,
)
from flowrl.errors import ConfigError, StageError, Timeout

if TYPE_CHECKING:
    from collections.abc import Sequence

    from flowrl._client.base import HubClient
    from flowrl._pipeline.executors.worker import WorkerReport
    from flowrl._pipeline.pipeline import Pipeline
    from flowrl._pipeline.result import RunResult
    from flowrl._pipeline.stage import StageSpec
    from flowrl._schema.columns import Column
    from flowrl._transport.auth import HubKey

__all__ = ["RayExecutor"]


@final
class RayExecutor(Executor):
    """Run each stage worker as a Ray actor. ``timeout`` and ``max_samples`` as for threads;
    ``placement_timeout``: seconds to wait for the cluster to place every worker;
    ``max_restarts``: dead worker actors replaced per run before the run fails."""

    def __init__(
        self,
        *,
        timeout: float | None = None,
        max_samples: int | None = None,
        placement_timeout: float = 60.0,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        check_limits(timeout, max_samples)
        if not isinstance(placement_timeout, int | float) or not placement_timeout > 0:
            raise ConfigError(
                f"placement_timeout must be a positive number of seconds, got {placement_timeout!r}"
            )
        self.timeout = timeout
        self.max_samples = max_samples
        self.placement_timeout = float(placement_timeout)
        self.max_restarts = check_restarts(max_restarts)
        self._stop = _Broadcast()

    def stop(self) -> None:
        self._stop.set()

    def default_hub(self, columns: Sequence[Column]) -> HubClient:
        from flowrl._launch.ray_hub import launch_ray_hub

        return launch_ray_hub(columns)

    def run(self, pipeline: Pipeline, hub: HubClient) -> RunResult:
        address = getattr(hub, "address", None)
        if not isinstance(address, str):
            raise ConfigError(
                "executor='ray' needs a hub its worker actors can connect to: "
                "hub = flowrl.launch_ray_hub(pipeline.columns)"
            )
        for spec in pipeline.stages:
            _check_importable(spec)
        import_ray()
        pipeline.register(hub)
        stop = self._stop
        key = getattr(hub, "key", None)  # a hub on TCP admits only holders of its key
        shared = _shared(address, key, pipeline, self.max_samples)
        run = _Run(
            address=address,
            key=key,
            unit_nodes=tuple(getattr(hub, "unit_nodes", ())),
            path=list(sys.path),
            stop=stop,
            restarts=Restarts(self.max_restarts),
            shared=shared,
            admission=shared if pipeline.staleness is not None else None,
            quota=shared if self.max_samples is not None else None,
        )
        try:
            slots = [run.place(spec, w) for spec in pipeline.stages for w in range(spec.workers)]
            run.wait_placed(slots, self.placement_timeout)
            t0 = time.perf_counter()
            for slot in slots:
                run.submit(slot)
            try:
                outcome = collect(pipeline, hub, run.receive, len(slots), stop, self.timeout, t0)
            finally:
                stop.set()
            stuck = [slot.name for slot in slots if not slot.reported]
            wall = time.perf_counter() - t0
            return finish(pipeline, outcome, len(slots), wall, self.timeout, stuck, run.restarts)
        finally:
            run.close()
            self._stop = _Broadcast()  # the executor can run again


class _Broadcast:
    """The run's stop flag; setting it tells every worker actor to stop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._actors: list[Any] = []

    def add(self, actor: Any) -> None:
        with self._lock:
            self._actors.append(actor)
            stopped = self._event.is_set()
        if stopped:
            actor.stop.remote()

    def is_set(self) -> bool:
        return self._event.is_set()

    def actors(self) -> list[Any]:
        """Every worker actor of the run, dead ones too."""
        with self._lock:
            return list(self._actors)

    def set(self) -> None:
        with self._lock:
            first = not self._event.is_set()
            self._event.set()
            actors = list(self._actors)
        if first:
            for actor in actors:
                actor.stop.remote()  # a dead actor's ref just errors; nobody waits on it


@dataclass
class _Slot:
    """One worker of one stage: its current actor and run call."""

    spec: StageSpec
    worker: int
    pickled: bytes
    actor: Any = None
    group: Any = None  # its placement group, kept across restarts
    reported: bool = False

    @property
    def name(self) -> str:
        return f"flowrl-{self.spec.name}-{self.worker}"


@dataclass
class _Run:
    """The actors of one run, and how the driver hears from them."""

    address: str
    key: HubKey | None
    unit_nodes: tuple[str, ...]
    path: list[str]
    stop: _Broadcast
    restarts: Restarts
    shared: Any  # the helper actor, or None; admission and quota: it, where they are used
    admission: Any
    quota: Any
    slots: list[_Slot] = field(default_factory=list)
    pending: dict[Any, _Slot] = field(default_factory=dict)  # run() calls not returned yet

    def place(self, spec: StageSpec, worker: int) -> _Slot:
        slot = _Slot(spec, worker, pickle.dumps(spec))
        self.slots.append(slot)
        if spec.placement_strategy is not None:
            from ray.util.placement_group import placement_group

            first = {"GPU": 1.0, **({"CPU": spec.num_cpus} if spec.num_cpus else {})}
            bundles = [first] + [{"GPU": 1.0}] * (int(spec.num_gpus) - 1)
            slot.group = placement_group(bundles, strategy=spec.placement_strategy)
        self._start(slot)
        return slot

    def _start(self, slot: _Slot) -> None:
        spec = slot.spec
        options: dict[str, Any] = {
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
            "max_concurrency": 2,  # run() and stop()
        }
        if slot.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["num_gpus"] = 1.0
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                slot.group,
                placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True,
            )
        slot.actor = _worker_actor().options(**options).remote()
        self.stop.add(slot.actor)

    def wait_placed(self, slots: list[_Slot], timeout: float) -> None:
        import ray

        refs = {slot.actor.ready.remote(): slot for slot in slots}
        ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        ray.get(ready)  # an actor that failed to start raises here
        if waiting:
            lacking = sorted({_resources(refs[r].spec) for r in waiting})
            raise ConfigError(
                f"the Ray cluster did not place {len(waiting)} stage worker(s) within "
                f"{timeout:.0f}s: {'; '.join(lacking)}; the cluster has "
                f"{ray.cluster_resources()}. Lower the stage's num_cpus/num_gpus or "
                "workers, or add nodes"
            )

    def submit(self, slot: _Slot) -> None:
        ref = slot.actor.run.remote(
            slot.pickled,
            slot.worker,
            self.path,
            self.address,
            self.key,
            self.unit_nodes,
            self.admission,
            self.quota,
        )
        self.pending[ref] = slot

    def receive(self, wait: float) -> WorkerReport | BaseException | None:
        import ray

        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=wait)
        if not ready:
            return None
        slot = self.pending.pop(ready[0])
        try:
            data = ray.get(ready[0])
        except ray.exceptions.RayTaskError as exc:  # before the worker ran: e.g. an import
            slot.reported = True
            err = StageError(
                f"the worker actor {slot.name} of stage {slot.spec.name!r} could not start "
                f"its worker: {exc}",
                stage=slot.spec.name,
            )
            err.__cause__ = exc
            return err
        except ray.exceptions.RayActorError as exc:
            how = f"died ({type(exc).__name__}: {exc})"
            failed = self.restarts.replace(slot.spec, f"actor {slot.name}", how, self.stop)
            if failed is None:
                ray.kill(slot.actor)
                self._start(slot)  # the dead one's leases expire and go to other workers
                self.submit(slot)
                return None
            slot.reported = True
            return failed
        slot.reported = True
        return outcome_of(decoder.decode(data))

    def close(self) -> None:
        """End every actor and placement group of the run."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.stop.actors():
            ray.kill(actor)
        if self.shared is not None:
            ray.kill(self.shared)
        for slot in self.slots:
            if slot.group is not None:
                remove_placement_group(slot.group)


def _resources(spec: StageSpec) -> str:
    placement = f", {spec.placement_strategy} placement group" if spec.placement_strategy else ""
    return (
        f"stage {spec.name!r} asks for num_cpus={spec.num_cpus:g}, "
        f"num_gpus={spec.num_gpus:g}{placement} per worker"
    )


@functools.cache
def _worker_actor() -> Any:
    import ray

    return ray.remote(StageWorker)


class StageWorker:
    """The body of a worker actor: ``run`` runs one stage worker, ``stop`` stops it."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def ready(self) -> None:
        """Returns once the actor is placed and started."""

    def stop(self) -> None:
        self._stop.set()

    def run(
        self,
        pickled: bytes,
        worker: int,
        path: list[str],
        address: str,
        key: HubKey | None,
        unit_nodes: tuple[str, ...],
        admission: Any,
        quota: Any,
    ) -> bytes:
        """Run the worker; returns its msgspec-encoded report or failure."""
        import ray

        from flowrl._launch.processes import connect

        sys.path.extend(p for p in path if p not in sys.path)
        spec: StageSpec = pickle.loads(pickled)  # imports the stage's module
        node = ray.get_runtime_context().get_node_id()
        open_hub = functools.partial(connect, address, key=key, unit_nodes=unit_nodes, node=node)
        result = _Result()
        worker_main(
            spec,
            worker,
            open_hub,
            self._stop,
            result,
            None if admission is None else _AdmissionProxy(admission),
            None if quota is None else _QuotaProxy(quota),
        )
        return result.data


class _Result:
    """Where ``worker_main`` puts its one message."""

    data = b""

    def put(self, data: bytes) -> None:
        self.data = data


def _shared(address: str, key: HubKey | None, pipeline: Pipeline, max_samples: int | None) -> Any:
    """The helper actor of the source workers (None when nothing is shared)."""
    if pipeline.staleness is None and max_samples is None:
        return None
    import ray

    sources = sum(s.workers for s in pipeline.stages if s.is_source)
    helper = ray.remote(Shared).options(num_cpus=0, max_concurrency=sources + 1)
    return helper.remote(address, key, pipeline.staleness, max_samples)


class Shared:
    """The admission controller and the sample quota of a run, for every source worker."""

    def __init__(
        self,
        address: str,
        key: HubKey | None,
        staleness: Staleness | None,
        max_samples: int | None,
    ):
        from flowrl._launch.processes import connect

        self._admission = (
            None if staleness is None else AdmissionController(connect(address, key=key), staleness)
        )
        self._quota = None if max_samples is None else SampleQuota(max_samples)

    def admit(self, n: int, timeout: float | None) -> bool:
        if self._admission is None:
            return True
        try:
            self._admission.admit(n, timeout=timeout)
        except Timeout:
            return False
        return True

    def refund_admission(self, n: int) -> None:
        if self._admission is not None:
            self._admission.refund(n)

    def take(self, n: int) -> bool:
        return self._quota is None or self._quota.take(n)

    def refund_quota(self, n: int) -> None:
        if self._quota is not None:
            self._quota.refund(n)


class _AdmissionProxy:
    def __init__(self, shared: Any) -> None:
        self._shared = shared

    def admit(self, n: int, *, timeout: float | None = None) -> None:
        import ray

        if not ray.get(self._shared.admit.remote(n, timeout)):
            raise Timeout(f"{n} samples not admitted within {timeout}s")

    def refund(self, n: int) -> None:
        import ray

        ray.get(self._shared.refund_admission.remote(n))


class _QuotaProxy:
    def __init__(self, shared: Any) -> None:
        self._shared = shared

    def take(self, n: int) -> bool:
        import ray

        return bool(ray.get(self._shared.take.remote(n)))

    def refund(self, n: int) -> None:
        import ray

        ray.get(self._shared.refund_quota.remote(n))

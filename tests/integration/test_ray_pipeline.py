"""executor="ray" on a local 3-node Ray cluster: exact accounting, locality, worker death.

Stage workers are Ray actors spread over the nodes; the driver reads the last stage's
outputs through a Loader (its own hub task) and checks that every sample reached every
task exactly once. Stages are module-level: workers import them by reference.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, Loader, Pipeline, RayExecutor, stage
from flowrl.errors import ConfigError, StageError

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ray = pytest.importorskip("ray")

ID = Column.scalar("id", "int64")
NODE = Column.string("node")
Y = Column.scalar("y", "int64")
MAILBOX = "flowrl-test-mailbox"
NODE_LOG = "flowrl-test-source-nodes"


@stage(outputs=[ID, NODE], batch_size=5, workers=3, num_cpus=1)
class Source:
    """Worker ``w`` creates ids ``w * 1000 + k``; ``max_samples`` ends the stream."""

    def setup(self, ctx: flowrl.StageContext) -> None:
        self.next = ctx.worker * 1000
        self.node = ray.get_runtime_context().get_node_id()
        ray.get(ray.get_actor(NODE_LOG).volunteer.remote(self.node))  # where this worker runs

    def __call__(self) -> dict[str, Any]:
        ids = np.arange(self.next, self.next + 5)
        self.next += 5
        return {"id": ids, "node": [self.node] * 5}


@stage(inputs=["id"], outputs=[Y], batch_size=4, workers=2, num_cpus=1)
def double(batch):
    return {"y": batch.numpy("id") * 2}


@stage(inputs=["id", "y"], batch_size=3, min_batch=1, num_cpus=0.5)
def audit(batch):
    if not (batch.numpy("y") == 2 * batch.numpy("id")).all():
        raise ValueError("y != 2 * id")


@ray.remote(num_cpus=0)
class Mailbox:
    """Where a stage worker leaves its actor handle for the test to kill it."""

    def __init__(self) -> None:
        self.victim: Any = None
        self.volunteers: list[Any] = []

    def volunteer(self, handle: Any) -> bool:
        self.volunteers.append(handle)
        if self.victim is not None:
            return False
        self.victim = handle
        return True

    def seen(self) -> list[Any]:
        return self.volunteers

    def get(self) -> Any:
        return self.victim


@stage(outputs=[ID], batch_size=4, num_cpus=0.5)
def ids():
    for start in range(0, 40, 4):
        yield {"id": np.arange(start, start + 4)}


@stage(inputs=["id"], outputs=[Y], batch_size=4, workers=2, num_cpus=0.5, lease_timeout=2.0)
def fragile_worker(batch):
    """The first call anywhere volunteers to die: it blocks until the test kills its actor."""
    mailbox = ray.get_actor(MAILBOX)
    if ray.get(mailbox.volunteer.remote(ray.get_runtime_context().current_actor)):
        time.sleep(300)
    return {"y": batch.numpy("id") * 2}


@stage(inputs=["id"], outputs=[Y], batch_size=4, num_cpus=0.5)
def fragile(batch):
    if (batch.numpy("id") >= 8).any():
        raise ValueError("bad sample")
    return {"y": batch.numpy("id")}


@stage(inputs=["id"], outputs=[Y], batch_size=4, num_gpus=2, placement_strategy="STRICT_PACK")
class TensorParallel:
    """Stands for an engine with one Ray worker per GPU: its ranks go to its group."""

    def setup(self) -> None:
        group = ray.util.get_current_placement_group()
        self.bundles = 0 if group is None else group.bundle_count
        self.gpus = len(ray.get_gpu_ids())

    def __call__(self, batch):
        return {"y": np.full(len(batch), self.bundles * 10 + self.gpus)}


@stage(outputs=[ID], batch_size=4, num_cpus=64)
def huge():
    return None


@pytest.fixture(scope="module")
def cluster(ray_runtime: Any) -> Any:
    return ray_runtime.cluster()


def _drain(loader: Loader, columns: tuple[str, ...]) -> tuple[dict[str, list[Any]], list[int]]:
    seen: dict[str, list[Any]] = {c: [] for c in columns}
    units: list[int] = []
    for batch in loader:
        for c in columns:
            values = batch.arrow(c).to_pylist()
            seen[c].extend(values)
        units.extend(batch.meta.units.tolist())
    return seen, units


def test_pipeline_on_three_nodes_every_sample_once_per_task_and_local_puts(cluster: Any) -> None:
    pipe = Pipeline([Source, double, audit])
    node_log = Mailbox.options(name=NODE_LOG).remote()
    hub = flowrl.launch_ray_hub(pipe.columns)
    try:
        loader = Loader(hub, task="check", columns=["id", "node", "y"], batch_size=8, timeout=120)
        with pipe.start(hub, executor="ray", max_samples=60, timeout=120, loaders=[loader]) as run:
            seen, units = _drain(loader, ("id", "node", "y"))
        result = run.result()
        assert result.completed
        produced = result.stages["Source"].samples
        assert produced >= 60
        assert len(seen["id"]) == produced and len(set(seen["id"])) == produced  # once each
        assert seen["y"] == [2 * i for i in seen["id"]]
        for unit, node in zip(units, seen["node"], strict=True):
            assert hub.unit_nodes[unit] == node  # stored on the producing worker's node
        # The source workers were placed on several nodes (which of them produced the
        # samples is a race: the first to start may make all 60 before the others start).
        assert len(set(ray.get(node_log.seen.remote()))) >= 2
        stats = hub.statistics()
        for task in ("double", "audit", "check"):
            assert stats.tasks[task].consumed == produced, task
            assert stats.tasks[task].ready == stats.tasks[task].leased == 0, task
        assert stats.live == 0 and stats.leases == 0
    finally:
        hub.close()
        ray.kill(node_log)


def test_killed_worker_leases_expire_and_go_to_another_worker(cluster: Any) -> None:
    mailbox = Mailbox.options(name=MAILBOX).remote()
    pipe = Pipeline([ids, fragile_worker])
    hub = flowrl.launch_ray_hub(pipe.columns)
    try:
        loader = Loader(hub, task="check", columns=["id", "y"], batch_size=4, timeout=120)
        executor = RayExecutor(timeout=120, max_restarts=1)
        with pipe.start(hub, executor=executor, loaders=[loader]) as run:
            deadline = time.monotonic() + 60
            while (victim := ray.get(mailbox.get.remote())) is None:
                assert time.monotonic() < deadline, "no worker volunteered"
                time.sleep(0.05)
            ray.kill(victim)  # mid-batch: it holds a lease on 4 samples
            seen, _ = _drain(loader, ("id", "y"))
        result = run.result()
        assert result.completed
        assert Counter(seen["id"]) == Counter(range(40))  # none lost, none twice
        assert seen["y"] == [2 * i for i in seen["id"]]
        stats = hub.statistics()
        assert stats.tasks["fragile_worker"].consumed == 40
        assert stats.live == 0 and stats.leases == 0
    finally:
        hub.close()
        ray.kill(mailbox)


def test_ray_workers_reach_a_tcp_hub_launched_outside_ray_with_its_key(cluster: Any) -> None:
    # launch_hub(host=) admits only holders of its key: the workers and the run's shared
    # admission actor (staleness) get it from the executor
    # (a window of 64 admits all 40 and the source's last, empty call: no version is published)
    pipe = Pipeline(
        [ids, double], staleness=flowrl.Staleness(max_staleness=0, samples_per_version=64)
    )
    hub = flowrl.launch_hub(pipe.columns, host="127.0.0.1")
    try:
        loader = Loader(hub, task="check", columns=["id", "y"], batch_size=4, timeout=120)
        with pipe.start(hub, executor="ray", timeout=120, loaders=[loader]) as run:
            seen, _ = _drain(loader, ("id", "y"))
        assert run.result().completed
        assert Counter(seen["id"]) == Counter(range(40))
        assert seen["y"] == [2 * i for i in seen["id"]]
        assert hub.statistics().refused_peers == 0
    finally:
        hub.close()


def test_stage_error_reraises_with_stage_and_indices(cluster: Any) -> None:
    with pytest.raises(StageError) as info:
        Pipeline([ids, fragile]).run(executor="ray", timeout=120)
    err = info.value
    assert err.stage == "fragile" and "bad sample" in str(err)
    assert len(err.indices) == 4 and min(err.indices) >= 8
    assert "ValueError" in str(err.__cause__)


def test_multi_gpu_worker_runs_in_its_placement_group(cluster: Any) -> None:
    pipe = Pipeline([ids, TensorParallel])
    hub = flowrl.launch_ray_hub(pipe.columns)
    try:
        loader = Loader(hub, task="check", columns=["y"], batch_size=8, timeout=120)
        with pipe.start(hub, executor="ray", timeout=120, loaders=[loader]):
            seen, _ = _drain(loader, ("y",))
        assert seen["y"] == [21] * 40  # a 2-bundle group; the worker holds the first GPU
    finally:
        hub.close()


def test_unplaceable_worker_fails_with_what_it_asked_for(cluster: Any) -> None:
    executor = RayExecutor(placement_timeout=2.0, timeout=60)
    with pytest.raises(ConfigError, match=r"stage 'huge' asks for num_cpus=64"):
        Pipeline([huge]).run(executor=executor)

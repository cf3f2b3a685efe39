"""Shared fixtures: ``make_hub`` builds a hub under every placement in ``PLACEMENTS``.

Behaviour tests take ``make_hub`` and use only the public client API (``flowrl.*`` and hub
methods), never ``hub.controller`` or other internals, so the same test runs unchanged
in-process, over zmq and on Ray. Every hub a test made is closed at teardown.

Ray tests (marker ``ray``; skipped when ray is not installed) share one Ray runtime per
test session: ``ray_runtime.single()`` for the placement tests, ``ray_runtime.cluster()``
(a local multi-node ``ray.cluster_utils.Cluster``) for the integration tests. A process
holds one Ray runtime at a time, so asking for the other kind shuts the current one down.

``bench`` is the script ``benchmarks/<BENCHMARK>.py`` imported as a module, for test
modules that set ``BENCHMARK`` and test a benchmark's pieces at a tiny size.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import flowrl

PLACEMENTS = ["inproc", "zmq", pytest.param("ray", marks=pytest.mark.ray)]


def _inproc(
    columns: Iterable[flowrl.Column],
    tasks: Mapping[str, Sequence[str]] | None,
    config: flowrl.HubConfig | None,
) -> Any:
    return flowrl.Hub(columns, tasks=dict(tasks) if tasks else None, config=config)


def _zmq(
    columns: Iterable[flowrl.Column],
    tasks: Mapping[str, Sequence[str]] | None,
    config: flowrl.HubConfig | None,
) -> Any:
    launch = getattr(flowrl, "launch_hub", None)
    if launch is None:
        pytest.skip("flowrl.launch_hub is not available yet")
    return launch(columns=list(columns), tasks=dict(tasks) if tasks else None, config=config)


class RayRuntime:
    """The Ray runtime of this test process: none, one node, or a local multi-node cluster."""

    #: Logical resources of the cluster's nodes (this machine has 2 cores; Ray schedules by
    #: these counts, not by real cores). The last node has 2 logical GPUs for placement
    #: group tests; nothing runs on a real GPU.
    CLUSTER_NODES: tuple[dict[str, Any], ...] = (
        {"num_cpus": 2},
        {"num_cpus": 2},
        {"num_cpus": 2, "num_gpus": 2},
    )

    def __init__(self) -> None:
        self.kind: str | None = None
        self._cluster: Any = None

    def single(self) -> None:
        ray = pytest.importorskip("ray")
        if self.kind != "single" or not ray.is_initialized():
            self.shutdown()
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            self.kind = "single"

    def cluster(self) -> Any:
        """The cluster (started on first use); this process is its driver, on the head node."""
        ray = pytest.importorskip("ray")
        from ray.cluster_utils import Cluster

        if self.kind != "cluster" or not ray.is_initialized():
            self.shutdown()
            head, *others = self.CLUSTER_NODES
            self._cluster = Cluster(
                initialize_head=True, head_node_args={**head, "include_dashboard": False}
            )
            for node in others:
                self._cluster.add_node(**node)
            self._cluster.wait_for_nodes()
            ray.init(address=self._cluster.address, log_to_driver=False)
            self.kind = "cluster"
        return self._cluster

    def shutdown(self) -> None:
        """Shut down the runtime, also one that flowrl started by itself (``ray.init()``)."""
        ray = sys.modules.get("ray")
        if ray is not None:
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        self.kind = None


_RAY = RayRuntime()


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> ModuleType:
    name = request.module.BENCHMARK
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[RayRuntime]:
    yield _RAY
    _RAY.shutdown()


def _ray(
    columns: Iterable[flowrl.Column],
    tasks: Mapping[str, Sequence[str]] | None,
    config: flowrl.HubConfig | None,
) -> Any:
    _RAY.single()
    return flowrl.launch_ray_hub(
        columns,
        tasks=dict(tasks) if tasks else None,
        config=config,
        units_per_node=config.n_units if config else 1,  # one node: every unit on it
    )


FACTORIES: dict[str, Callable[..., Any]] = {"inproc": _inproc, "zmq": _zmq, "ray": _ray}

MakeHub = Callable[..., Any]


#: Modules whose ``make_hub`` tests run on Ray as well: the hub's behaviour. Elsewhere
#: (schema conversions, client fuzzing, loaders, ...) tests exercise client code that is
#: the same over zmq and on Ray, which only moves the zmq servers into actors, and every
#: Ray hub costs a few seconds of actor start-up on a 2-core machine.
RAY_MODULES = {"test_hub_behaviour", "test_drop"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``placement`` over ``PLACEMENTS`` (``ray`` only in ``RAY_MODULES``),
    unless the test or its module chose its own placements."""
    if "placement" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "placement" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return  # the test's own placements (pytest then has no fixture def for it)
    closest = metafunc._arg2fixturedefs["placement"][-1]
    if closest.func is not placement.__wrapped__:
        return  # a module's own placement fixture
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    chosen = PLACEMENTS if module in RAY_MODULES else PLACEMENTS[:2]
    metafunc.parametrize("placement", chosen, indirect=True)


@pytest.fixture
def placement(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_hub(placement: str, request: pytest.FixtureRequest) -> Iterator[MakeHub]:
    """``make_hub(columns=[...], tasks={...}, config=HubConfig(...))`` -> a hub client."""
    if placement == "ray":
        request.getfixturevalue("ray_runtime")  # shut down at the end of the session
    made: list[Any] = []
    factory = FACTORIES[placement]

    def make(
        columns: Iterable[flowrl.Column] = (),
        tasks: Mapping[str, Sequence[str]] | None = None,
        config: flowrl.HubConfig | None = None,
    ) -> Any:
        hub = factory(tuple(columns), tasks, config)
        made.append(hub)
        return hub

    yield make
    errors: list[BaseException] = []
    for hub in reversed(made):
        try:
            hub.close()
        except Exception as exc:  # close every hub even if one fails, then report
            errors.append(exc)
    if errors:
        raise errors[0]

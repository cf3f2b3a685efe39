"""The hub placed on a local 3-node Ray cluster: data locality, cross-node reads, shutdown.

Producers and consumers are Ray tasks pinned to nodes; they reach the hub with
``flowrl.connect(hub.address, unit_nodes=hub.unit_nodes, node=<their node>)``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import TransportError

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ray = pytest.importorskip("ray")

X = Column.scalar("x", "int64")
NODE = Column.string("node")


def _on(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node, soft=False)


@ray.remote(num_cpus=0)
def produce(address: str, unit_nodes: list[str], start: int, n: int) -> list[int]:
    node = ray.get_runtime_context().get_node_id()
    with flowrl.connect(address, unit_nodes=unit_nodes, node=node) as hub:
        idx = hub.put({"x": np.arange(start, start + n), "node": [node] * n})
    return idx.tolist()


@ray.remote(num_cpus=0)
def consume(address: str, task: str, n: int) -> tuple[list[int], list[int], list[str]]:
    """Claim ``n`` samples on this node, read them, ack: (units, x, producer nodes)."""
    with flowrl.connect(address) as hub:
        meta = hub.claim(task, n, timeout=30)
        batch = hub.get(meta)
        hub.ack(meta)
    return meta.units.tolist(), batch.numpy("x").tolist(), batch.arrow("node").to_pylist()


@pytest.fixture(scope="module")
def nodes(ray_runtime: Any) -> list[str]:
    ray_runtime.cluster()
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def test_puts_stay_on_the_producers_node_and_reads_cross_nodes(nodes: list[str]) -> None:
    hub = flowrl.launch_ray_hub([X, NODE], tasks={"read": ["x", "node"]})
    try:
        assert len(hub.unit_addresses) == len(nodes) == 3
        assert sorted(hub.unit_nodes) == nodes  # one storage unit per node
        puts = [
            produce.options(scheduling_strategy=_on(node)).remote(
                hub.address, list(hub.unit_nodes), 100 * i, 8
            )
            for i, node in enumerate(nodes)
        ]
        ray.get(puts, timeout=60)
        # Each consumer runs on the node after the producer's: every read crosses nodes
        # for some samples, and the BatchMeta says where each sample's bytes live.
        reads = [
            consume.options(scheduling_strategy=_on(nodes[(i + 1) % 3])).remote(
                hub.address, "read", 8
            )
            for i in range(3)
        ]
        seen: list[int] = []
        for units, xs, producers in ray.get(reads, timeout=60):
            for unit, producer in zip(units, producers, strict=True):
                assert hub.unit_nodes[unit] == producer  # stored on the producer's node
            seen.extend(xs)
        assert sorted(seen) == [100 * i + j for i in range(3) for j in range(8)]
        stats = hub.statistics()
        assert stats.tasks["read"].consumed == 24 and stats.live == 0
    finally:
        hub.close()


def test_units_per_node_and_placement_errors(nodes: list[str]) -> None:
    with pytest.raises(flowrl.errors.ConfigError, match="not alive nodes"):
        flowrl.launch_ray_hub([X], nodes=["no-such-node"])
    with pytest.raises(flowrl.errors.ConfigError, match="units_per_node=1"):
        flowrl.launch_ray_hub([X], config=flowrl.HubConfig(n_units=2))
    hub = flowrl.launch_ray_hub([X], tasks={"t": ["x"]}, units_per_node=2, nodes=nodes[:1])
    try:
        assert hub.unit_nodes == (nodes[0], nodes[0]) and hub.config.n_units == 2
        hub.put({"x": np.arange(4)})
        hub.put({"x": np.arange(4, 8)})
        meta = hub.claim("t", 8, timeout=10)
        assert set(meta.units.tolist()) == {0, 1}  # local units in turn
    finally:
        hub.close()


def test_close_stops_every_actor_of_the_hub(nodes: list[str]) -> None:
    def alive() -> int:
        # The GCS actor table (ray.util.state needs the dashboard, which tests leave off).
        table = ray._private.state.state.actor_table(None)
        return sum(
            a["State"] == "ALIVE" and a["ActorClassName"].endswith("ServerHost")
            for a in table.values()
        )

    before = alive()
    hub = flowrl.launch_ray_hub([X])
    assert alive() == before + 4  # the controller and a unit per node
    address = hub.address
    hub.close()
    deadline = time.monotonic() + 10  # ray.kill is asynchronous
    while alive() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == before
    with pytest.raises(TransportError):
        flowrl.RemoteHub(address, rpc_timeout=1.0)

"""The hub placed on a local 3-node Ray cluster: data locality, cross-node reads, shutdown,
and crashes of its server actors.

Producers and consumers are Ray tasks pinned to nodes; they reach the hub with
``flowrl.connect(hub.address, unit_nodes=hub.unit_nodes, node=<their node>)``.

The kill tests SIGKILL the process of a server actor (the nodes all run on this machine)
and count, per task, which samples were acknowledged: with a journal every sample produced
is acknowledged exactly once per task across the kill and Ray's restart of the actor;
without one, clients get a ``TransportError``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kill_scenarios import (
    COLS,
    TASKS,
    Producer,
    assert_each_once,
    controller_kill_scenario,
    drain,
    retry,
    rows,
)

import flowrl
from flowrl import Column, HubConfig, JournalConfig
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


# -- crashes of the server actors ----------------------------------------------------------


def journaled(path: Path, nodes: list[str]) -> flowrl.RemoteHub:
    config = HubConfig(capacity=1024, lease_timeout=2.0, journal=JournalConfig(path=str(path)))
    hub = flowrl.launch_ray_hub(COLS, tasks=TASKS, config=config, nodes=nodes)
    hub.rpc_timeout = 3.0  # notice a dead server in seconds, not the default 30
    return hub


def kill(hub: flowrl.RemoteHub, server: int) -> None:
    """SIGKILL the process of the hub's server actor ``server`` (-1: the controller)."""
    os.kill(hub.servers.pids()[server], signal.SIGKILL)


def wait_restarted(hub: flowrl.RemoteHub, restarts: int) -> None:
    deadline = time.monotonic() + 60
    while hub.servers.restarts < restarts or set(hub.servers.states()) != {"ALIVE"}:
        assert time.monotonic() < deadline, "Ray did not restart the server actor"
        time.sleep(0.05)


def test_a_killed_controller_actor_restarts_with_its_leases(
    nodes: list[str], tmp_path: Path
) -> None:
    """SIGKILL the controller's process with a lease held and a claim parked in it: Ray
    restarts the actor on the same address, it recovers from the journal keeping the
    lease, the parked claim is re-sent, and every sample is consumed once per task."""
    hub = journaled(tmp_path, nodes[:2])
    pids = hub.servers.pids()

    def kill_controller() -> None:
        kill(hub, -1)
        wait_restarted(hub, 1)
        assert hub.servers.restarts == 1
        new_pids = hub.servers.pids()
        assert new_pids[:-1] == pids[:-1] and new_pids[-1] != pids[-1]  # the controller only

    try:
        controller_kill_scenario(hub, kill_controller)
    finally:
        hub.close()


def test_a_killed_storage_unit_actor_restarts_on_its_node_with_its_bytes(
    nodes: list[str], tmp_path: Path
) -> None:
    """A producer and a consumer keep going while a storage unit actor on another node
    than the driver's is SIGKILLed: Ray restarts it on its node, it reloads its Arrow
    files, and every sample is consumed once per task."""
    here = ray.get_runtime_context().get_node_id()
    others = [n for n in nodes if n != here]
    hub = journaled(tmp_path, others)  # units on the other two nodes; samples go to both
    producer = Producer(hub)
    try:
        victim = 0
        pids = hub.servers.pids()
        producer.start_and_wait_for(40)
        tags = producer.tags
        # A consumer reads across the kill: part of the samples before, the rest after.
        # (leased long enough to outlive the restart on a loaded machine)
        meta = hub.claim("train", 16, timeout=5, lease_timeout=60.0)
        assert victim in meta.units.tolist()  # it reads from the unit that dies
        kill(hub, victim)
        wait_restarted(hub, 1)
        assert ray.get(hub.servers.actors[victim].node.remote()) == hub.unit_nodes[victim]
        assert hub.servers.pids()[victim] != pids[victim]
        batch = retry(hub.get, meta)  # the bytes are back
        assert batch["tag"].tolist() == [tags[i] for i in meta.indices.tolist()]
        hub.ack(meta)
        acked = {"train": Counter[int](meta.indices.tolist()), "score": Counter[int]()}
        producer.join()
        hub.end_stream()
        for task, counts in acked.items():
            drain(hub, task, counts, tags)
        assert len(tags) == 120
        assert_each_once(acked, tags)
        assert hub.servers.restarts == 1
    finally:
        producer.join()
        hub.close()


def test_without_a_journal_a_dead_server_is_a_transport_error(nodes: list[str]) -> None:
    """Nothing would come back: Ray does not restart the actors, and clients get a
    TransportError (a claim that waits for ever too), not a hang."""
    hub = flowrl.launch_ray_hub(COLS, tasks=TASKS, nodes=nodes[:1])
    hub.rpc_timeout = 1.0
    try:
        hub.put(rows(np.arange(8)))
        meta = hub.claim("train", 8, timeout=5)
        unit, controller = hub.servers.pids()
        os.kill(unit, signal.SIGKILL)  # the storage unit holding the bytes
        with pytest.raises(TransportError, match="storage unit 0 did not answer"):
            hub.get(meta)

        outcome: list[BaseException] = []

        def wait_for_ever() -> None:
            try:
                hub.claim("score", 16)  # only 8 samples: parked, no timeout
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait_for_ever)
        waiter.start()
        time.sleep(0.3)
        os.kill(controller, signal.SIGKILL)  # with the claim parked in it
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "a claim on a dead controller hangs"
        (exc,) = outcome
        assert isinstance(exc, TransportError)
        with pytest.raises(TransportError, match="controller did not answer"):
            hub.statistics()
        assert hub.servers.states() == ["DEAD", "DEAD"]
        assert hub.servers.restarts == 0
    finally:
        hub.close()


def test_a_new_hub_on_an_old_journal_gives_back_the_old_leases_or_refuses_it(
    nodes: list[str], tmp_path: Path
) -> None:
    """Not a restart: the clients of the old hub are gone, so their leases end at once,
    and the samples (bytes included) are there for the new hub's consumers. A journal of
    another shape is refused."""
    hub = journaled(tmp_path, nodes[:1])
    try:
        idx = hub.put(rows(np.arange(8)))
        hub.claim("train", 8, timeout=5, lease_timeout=600)
    finally:
        hub.close()
    again = journaled(tmp_path, nodes[:1])
    try:
        meta = again.claim("train", 8, timeout=10)
        assert meta.indices.tolist() == idx.tolist()
        assert again.get(meta)["tag"].tolist() == list(range(8))
        assert again.servers.restarts == 0
    finally:
        again.close()
    # A journal of another shape is refused with the server's own error, not a dead actor.
    other = HubConfig(capacity=2048, journal=JournalConfig(path=str(tmp_path)))
    with pytest.raises(flowrl.errors.ConfigError, match="capacity"):
        flowrl.launch_ray_hub(COLS, tasks=TASKS, config=other, nodes=nodes[:1])


def test_a_peer_without_the_hub_key_is_refused_and_counted(nodes: list[str]) -> None:
    """The actors listen on TCP: only holders of the hub's key get in (Ray tasks of the
    cluster get it from the controller's actor, as ``produce`` does)."""
    import zmq

    from flowrl._transport import wire

    hub = flowrl.launch_ray_hub([X, NODE], tasks={"read": ["x", "node"]})
    socks = []
    try:
        assert hub.key is not None and all(a.startswith("tcp://") for a in hub.unit_addresses)
        for address in (hub.address, *hub.unit_addresses):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send_multipart([b"1" * 8, wire.encode(wire.Shutdown())])
            socks.append(sock)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = hub.statistics()
            if stats.refused_peers and all(u.refused_peers for u in stats.units):
                break
            time.sleep(0.05)
        assert stats.refused_peers and all(u.refused_peers for u in stats.units), stats
        assert ray.get(produce.remote(hub.address, list(hub.unit_nodes), 0, 2)) == [0, 1]
    finally:
        for sock in socks:
            sock.close()
        hub.close()

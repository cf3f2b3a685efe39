"""The hub on Ray: put/get throughput on a 2-node local cluster, zmq data plane vs object store.

Setup: a ``ray.cluster_utils.Cluster`` of two nodes on this machine (node A: the head,
where the driver runs; node B: a second raylet with its own object store), a hub from
``flowrl.launch_ray_hub`` with one storage unit per node, and client actors pinned to the
nodes. Payload as ``hub_throughput.py``: per sample an int64 ``input_ids`` and a float32
``logprobs`` sequence of --seq-len plus a float32 ``reward``, in batches of --batch.

What it measures (samples/s and GiB/s of payload; each figure the median of --repeat
rounds, the sections alternating so that drift on a shared machine hits them alike):

* ``zmq_put_*``: a producer actor on node A puts --samples samples; they land on node A's
  storage unit (data locality: the producer's own node).
* ``zmq_get_same_node_*`` / ``zmq_get_cross_node_*``: a consumer actor on node A, then one
  on node B, claims every sample for its own task and reads it (``hub.get`` plus turning
  every column into numpy); ``zmq_consume_*`` times the whole claim + get + ack loop.
  Bytes go storage unit -> consumer over TCP, never through the driver.
* ``objstore_put_*``: the same producer ``ray.put``\\ s the same payload (a dict of numpy
  arrays per batch) into node A's object store; ``objstore_get_same_node_*`` /
  ``objstore_get_cross_node_*``: consumers on A and B ``ray.get`` every batch as numpy
  (node B first has the object copied from A's store). Both data planes' reads end in
  numpy views and read one element of each array, not every byte.
* ``*_ratio``: ``get_cross_vs_same_node_{zmq,objstore}`` and
  ``objstore_vs_zmq_get_{same,cross}_node`` (above 1: the object store reads faster).

* ``restart_*`` (a journaled hub on the cluster holding --restart-samples samples of
  --restart-seq-len tokens, on node A's storage unit): the controller actor's process is
  SIGKILLed, then that storage unit actor's process. ``restart_controller_ray_s`` /
  ``restart_unit_ray_s``: kill -> Ray reports the actor ALIVE again (a new worker process,
  the server rebinding its ports and recovering); ``restart_controller_s``: kill -> the
  driver's client gets a ``statistics()`` answer again (journal replayed);
  ``restart_unit_s``: kill -> a read of 256 of the unit's samples succeeds (segments
  memory-mapped back). The client polls with ``rpc_timeout`` 0.25 s, so the client-side
  figures include up to that much of waiting on a request the dead server never got.

* ``journal`` and ``recovery`` (from ``benchmarks/journal.py``, on the same zmq servers
  the Ray actors host, outside the cluster): put + consume throughput with the journal
  off / on / on with persisted data at the default sync policy, ``loss`` = 1 - on/off
  (target <= 0.20), and the time to recover a hub holding --recovery-samples samples.
  ``--no-journal`` skips them.

How to read it: both "nodes" share this machine, so cross-node traffic is loopback TCP at
memory speed, not a network; on a real cluster, cross-node reads are bounded by the link
for both data planes. Same-node object-store reads are zero-copy views of shared memory,
while the zmq data plane copies through a socket; on the other hand the object store holds
objects by reference counting, not by task, so it has no claim/ack, leases or per-task
exactly-once delivery: the hub uses zmq for those and could hand out object refs as its
payload where same-node reads dominate. Quote ratios from one run; absolute numbers drift
on a shared 2-core machine.

Usage: python benchmarks/ray_hub.py --json [--samples N] [--seq-len L] [--repeat R]
       [--sections zmq object_store restart] [--restart-samples N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import journal  # benchmarks/journal.py, beside this script
import numpy as np
import ray
from hub_throughput import COLUMNS, payload
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import flowrl

GIB = 1024**3
TASKS = {"same_node": ["input_ids", "logprobs", "reward"]}


@dataclass
class Bench:
    """What every section gets: the cluster's two nodes and the run's sizes."""

    node_a: str  # the head node: the driver, the producer, the controller
    node_b: str
    samples: int
    seq_len: int
    batch: int
    restart_samples: int = 20_000
    restart_seq_len: int = 16

    @property
    def sample_bytes(self) -> int:
        return self.seq_len * 8 + self.seq_len * 4 + 4

    def rates(self, prefix: str, seconds: float) -> dict[str, float]:
        n = self.samples
        return {
            f"{prefix}_samples_per_s": n / seconds,
            f"{prefix}_gib_per_s": n * self.sample_bytes / seconds / GIB,
        }

    def on(self, node: str) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(node, soft=False)


@ray.remote(num_cpus=1)
class Client:
    """A producer or consumer pinned to one node."""

    def __init__(self, seq_len: int, batch: int, batches: int) -> None:
        rng = np.random.default_rng(0)
        self.batches = [payload(batch, seq_len, rng) for _ in range(min(8, batches))]
        self.n_batches = batches
        self.batch = batch
        self.hub: Any = None

    def connect(self, address: str, unit_nodes: list[str]) -> None:
        node = ray.get_runtime_context().get_node_id()
        self.hub = flowrl.connect(address, unit_nodes=unit_nodes, node=node)

    def hub_put(self) -> tuple[float, list[int]]:
        """(seconds, the storage units the samples went to)."""
        t0 = time.perf_counter()
        put = [self.hub.put(self.batches[i % len(self.batches)]) for i in range(self.n_batches)]
        seconds = time.perf_counter() - t0
        units = self.hub.meta(np.concatenate(put), ["reward"]).units
        return seconds, sorted(set(units.tolist()))

    def hub_consume(self, task: str) -> tuple[float, float, int]:
        """(get seconds, claim+get+ack seconds, checksum)."""
        get_s, checksum = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(self.n_batches):
            meta = self.hub.claim(task, self.batch, timeout=60)
            t1 = time.perf_counter()
            b = self.hub.get(meta)
            ids, _ = b.packed("input_ids")
            lps, _ = b.packed("logprobs")
            checksum += int(ids[-1]) + int(lps.size) + int(b["reward"].size)
            get_s += time.perf_counter() - t1
            self.hub.ack(meta)
        return get_s, time.perf_counter() - t0, checksum

    def store_put(self) -> tuple[float, list[Any]]:
        refs = []
        t0 = time.perf_counter()
        for i in range(self.n_batches):
            b = self.batches[i % len(self.batches)]
            refs.append(
                ray.put(
                    {
                        "input_ids": b["input_ids"].values,
                        "logprobs": b["logprobs"].values,
                        "offsets": b["input_ids"].cu_seqlens,
                        "reward": b["reward"],
                    }
                )
            )
        return time.perf_counter() - t0, refs

    def store_get(self, refs: list[Any]) -> tuple[float, int]:
        checksum = 0
        t0 = time.perf_counter()
        for ref in refs:
            b = ray.get(ref)
            checksum += int(b["input_ids"][-1]) + int(b["logprobs"].size) + int(b["reward"].size)
        return time.perf_counter() - t0, checksum

    def close(self) -> None:
        if self.hub is not None:
            self.hub.close()


def _clients(bench: Bench) -> tuple[Any, Any, Any]:
    """A producer on A and consumers on A and B."""
    batches = bench.samples // bench.batch
    make = [
        Client.options(scheduling_strategy=bench.on(node)).remote(
            bench.seq_len, bench.batch, batches
        )
        for node in (bench.node_a, bench.node_a, bench.node_b)
    ]
    return make[0], make[1], make[2]


def zmq_data_plane(bench: Bench) -> dict[str, Any]:
    """Put on node A's unit; read it from A (same node) and from B (cross node)."""
    tasks = {**TASKS, "cross_node": TASKS["same_node"]}
    capacity = bench.samples + bench.batch
    hub = flowrl.launch_ray_hub(COLUMNS, tasks=tasks, config=flowrl.HubConfig(capacity=capacity))
    producer, same, cross = _clients(bench)
    try:
        ray.get(
            [c.connect.remote(hub.address, list(hub.unit_nodes)) for c in (producer, same, cross)]
        )
        put_s, units = ray.get(producer.hub_put.remote())
        if [hub.unit_nodes[u] for u in units] != [bench.node_a]:
            raise RuntimeError(f"the producer's samples left its node: units {units}")
        get_a, consume_a, sum_a = ray.get(same.hub_consume.remote("same_node"))
        get_b, consume_b, sum_b = ray.get(cross.hub_consume.remote("cross_node"))
        if sum_a != sum_b:
            raise RuntimeError("same-node and cross-node reads differ")
        return {
            **bench.rates("zmq_put", put_s),
            **bench.rates("zmq_get_same_node", get_a),
            **bench.rates("zmq_get_cross_node", get_b),
            **bench.rates("zmq_consume_same_node", consume_a),
            **bench.rates("zmq_consume_cross_node", consume_b),
        }
    finally:
        ray.get([c.close.remote() for c in (producer, same, cross)])
        for c in (producer, same, cross):
            ray.kill(c)
        hub.close()


def object_store(bench: Bench) -> dict[str, Any]:
    """``ray.put`` on node A; ``ray.get`` on A (same node) and on B (cross node)."""
    producer, same, cross = _clients(bench)
    try:
        put_s, refs = ray.get(producer.store_put.remote())
        get_a, sum_a = ray.get(same.store_get.remote(refs))
        get_b, sum_b = ray.get(cross.store_get.remote(refs))
        if sum_a != sum_b:
            raise RuntimeError("same-node and cross-node reads differ")
        del refs
        return {
            **bench.rates("objstore_put", put_s),
            **bench.rates("objstore_get_same_node", get_a),
            **bench.rates("objstore_get_cross_node", get_b),
        }
    finally:
        for c in (producer, same, cross):
            ray.kill(c)


def restart(bench: Bench) -> dict[str, Any]:
    """SIGKILL the controller actor, then node A's storage unit actor, of a journaled hub;
    time until Ray has each back and until the driver's client is served again."""
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-") as folder:
        config = flowrl.HubConfig(
            capacity=bench.restart_samples + bench.batch,
            journal=flowrl.JournalConfig(path=folder),
        )
        hub = flowrl.launch_ray_hub(COLUMNS, tasks=TASKS, config=config)
        try:
            rng = np.random.default_rng(0)
            rows = payload(256, bench.restart_seq_len, rng)
            puts = [hub.put(rows) for _ in range(bench.restart_samples // 256)]
            unit = hub.unit_nodes.index(bench.node_a)  # where the driver's puts went
            meta = hub.meta(puts[0], ["input_ids", "reward"])
            if set(meta.units.tolist()) != {unit}:
                raise RuntimeError(f"the driver's samples left its node: units {meta.units}")
            hub.rpc_timeout = 0.25
            pids = hub.servers.pids()
            out = {}
            for name, server, call in (
                ("controller", -1, hub.statistics),
                ("unit", unit, lambda: hub.get(meta)),
            ):
                restarts = hub.servers.restarts
                t0 = time.perf_counter()
                os.kill(pids[server], signal.SIGKILL)
                ray_s = served_s = None
                while ray_s is None or served_s is None:
                    if (
                        ray_s is None
                        and hub.servers.restarts > restarts
                        and hub.servers.states()[server] == "ALIVE"
                    ):
                        ray_s = time.perf_counter() - t0
                    if served_s is None:
                        try:
                            call()
                            served_s = time.perf_counter() - t0
                        except flowrl.errors.TransportError:
                            pass
                    if time.perf_counter() - t0 > 120:
                        raise RuntimeError(f"the {name} did not come back in 120 s")
                out[f"restart_{name}_ray_s"] = ray_s
                out[f"restart_{name}_s"] = served_s
            stats = hub.statistics()
            if stats.live != len(puts) * 256 or hub.servers.restarts != 2:
                raise RuntimeError(
                    f"after the restarts: {stats.live} samples, {hub.servers.restarts} restarts"
                )
            out["restart_hub_samples"] = stats.live
            return out
        finally:
            hub.close()


#: Sections of the report, run in turn each round; each returns a flat dict of figures.
SECTIONS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "zmq": zmq_data_plane,
    "object_store": object_store,
    "restart": restart,
}


def ratios(r: dict[str, float]) -> dict[str, float]:
    out = {}
    if "zmq_get_same_node_samples_per_s" in r:
        out["get_cross_vs_same_node_zmq_ratio"] = (
            r["zmq_get_cross_node_samples_per_s"] / r["zmq_get_same_node_samples_per_s"]
        )
    if "objstore_get_same_node_samples_per_s" in r:
        out["get_cross_vs_same_node_objstore_ratio"] = (
            r["objstore_get_cross_node_samples_per_s"] / r["objstore_get_same_node_samples_per_s"]
        )
    if "zmq_get_same_node_samples_per_s" in r and "objstore_get_same_node_samples_per_s" in r:
        for where in ("same_node", "cross_node"):
            out[f"objstore_vs_zmq_get_{where}_ratio"] = (
                r[f"objstore_get_{where}_samples_per_s"] / r[f"zmq_get_{where}_samples_per_s"]
            )
    return out


def run(bench: Bench, sections: list[str], repeat: int) -> dict[str, Any]:
    """Every section ``repeat`` times in rotation; the median of each figure."""
    rounds: dict[str, list[float]] = {}
    for _ in range(repeat):
        for name in sections:
            for key, value in SECTIONS[name](bench).items():
                rounds.setdefault(key, []).append(value)
    result = {key: statistics.median(values) for key, values in rounds.items()}
    return {**result, **ratios(result)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--no-journal", action="store_true", help="skip journal and recovery")
    ap.add_argument("--recovery-samples", type=int, default=100_000)
    ap.add_argument("--restart-samples", type=int, default=20_000)
    ap.add_argument("--restart-seq-len", type=int, default=16)
    args = ap.parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        node_a = ray.get_runtime_context().get_node_id()
        node_b = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != node_a)
        bench = Bench(
            node_a,
            node_b,
            args.samples,
            args.seq_len,
            args.batch,
            args.restart_samples,
            args.restart_seq_len,
        )
        result: dict[str, Any] = {
            "nodes": 2,
            "samples": args.samples,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "repeat": args.repeat,
            **run(bench, args.sections, args.repeat),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    if not args.no_journal:
        result["journal"] = journal.overhead(
            "zmq", 2 * args.samples, args.seq_len, args.batch, args.repeat
        )
        result["recovery"] = journal.recovery(args.recovery_samples, 256)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:45s} {v}")


if __name__ == "__main__":
    main()

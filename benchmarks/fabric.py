"""RFabric against static fabrics on the same simulated asynchronous RL loop, 1k-32k GPUs.

Cluster: PoDs of 256 GPUs (32 nodes x 8), half training, half generation; 256 core-facing
ports of 400 Gb/s per PoD. Fabrics (``flowrl.sim.network.run_fabric``, flow-level model):

- ``fat-tree 1:1``: all 256 ports on a non-blocking electrical core (the paper's ideal);
- ``fat-tree 3:1``: 85 ports (3:1 oversubscribed leaf-spine / fat-tree);
- ``static OCS``: 32 EPS ports + 224 optical ports laid out once for the mean of the two
  phases' demand and never changed (one-shot, TopoOpt-like);
- ``rfabric``: 32 EPS + 224 OCS ports, the paper's templates and slack rule
  (``FabricPolicy(rule="slack", materializer="template")``);
- ``rfabric+``: ours, demand-materialized circuits and the benefit rule.

Workloads (``FabricWorkload``): ``dense-72B`` (generation-bound: 120 s generation, 90 s
training, 144 GB of bf16 gradients and weights), ``moe-671B`` (training-bound: 60 s
generation, 90 s training, 1.34 TB), both one-step off-policy, and ``moe-671B-onpolicy``
(generation waits for the weight sync). ``rfabric+`` is told which phases are critical
(the all-reduce; the weight sync too when on-policy). OCS delay (switching + steering):
0.05 s (3D MEMS) and 3 s (a slow switch, more than the 2 s optimizer slack before the
weight sync, less than the 5 s before the first gradient all-reduce).

Read ``step_vs_fat_tree`` (steady step time over the non-blocking fat-tree's), the mean
weight-sync and all-reduce transfer times, ``reconfigurations`` over 6 steps (the first
profiles), ``stall_s`` (delay the slack did not hide) and ``slack_used_s``.

Usage: ``python benchmarks/fabric.py [--json] [--quick]``; deterministic, seconds to run.
"""

from __future__ import annotations

import argparse
import json
import sys

from flowrl.sched import FabricPolicy, FabricSpec, materialize, phase_demand
from flowrl.sched.fabric import empty
from flowrl.sim import FabricWorkload, run_fabric

WORKLOADS = {
    "dense-72B": FabricWorkload(),
    "moe-671B": FabricWorkload(gen_s=60.0, grad_bytes=1.34e12, weight_bytes=1.34e12),
    "moe-671B-onpolicy": FabricWorkload(
        gen_s=60.0, grad_bytes=1.34e12, weight_bytes=1.34e12, staleness=0
    ),
}
SCALES = (1024, 4096, 16384, 32768)
DELAYS = (0.05, 3.0)
EPS_SLICE = 32


def fabrics(gpus: int, delay: float, work: FabricWorkload) -> list[dict[str, object]]:
    volumes = {"train": work.grad_bytes, "sync": work.weight_bytes}
    full = FabricSpec(gpus=gpus, ocs_delay_s=delay)
    over = FabricSpec(gpus=gpus, eps_ports=85, ocs_delay_s=delay)
    hybrid = FabricSpec(gpus=gpus, eps_ports=EPS_SLICE, ocs_delay_s=delay)
    mean = (
        phase_demand(hybrid, "train", work.grad_bytes)
        + phase_demand(hybrid, "sync", work.weight_bytes)
    ) / 2
    runs = [
        run_fabric(full, work, static=empty(full), name="fat-tree 1:1"),
        run_fabric(over, work, static=empty(over), name="fat-tree 3:1"),
        run_fabric(hybrid, work, static=materialize(hybrid, mean), name="static OCS"),
        run_fabric(hybrid, work, policy=FabricPolicy(hybrid, volumes), name="rfabric"),
        run_fabric(
            hybrid,
            work,
            policy=FabricPolicy(
                hybrid,
                volumes,
                rule="benefit",
                materializer="demand",
                critical=("train", "sync") if work.staleness == 0 else ("train",),
            ),
            name="rfabric+",
        ),
    ]
    base = runs[0].step_s
    return [
        {
            "fabric": r.fabric,
            "step_s": r.step_s,
            "step_vs_fat_tree": r.step_s / base,
            "sync_s": r.sync_s,
            "allreduce_s": r.allreduce_s,
            "exposed_s": r.exposed_s,
            "reconfigurations": r.reconfigurations,
            "stall_s": r.stall_s,
            "slack_used_s": r.slack_used_s,
        }
        for r in runs
    ]


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    scales = SCALES[:2] if args.quick else SCALES
    workloads = ["moe-671B-onpolicy"] if args.quick else list(WORKLOADS)
    rows = []
    for w in workloads:
        for delay in DELAYS:
            for gpus in scales:
                for r in fabrics(gpus, delay, WORKLOADS[w]):
                    rows.append({"workload": w, "ocs_delay_s": delay, "gpus": gpus, **r})
    out = {"rows": rows}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        for r in rows:
            print(
                f"{r['workload']:10} delay {r['ocs_delay_s']:4} {r['gpus']:6} {r['fabric']:13} "
                f"step x{r['step_vs_fat_tree']:.4f} sync {r['sync_s']:.3f} s "
                f"allreduce {r['allreduce_s']:.3f} s reconf {r['reconfigurations']} "
                f"stall {r['stall_s']:.2f} s slack {r['slack_used_s']:.2f} s"
            )
    return out


if __name__ == "__main__":
    main()

"""RFabric against static fabrics on the same simulated asynchronous RL loop, 1k-32k GPUs.

Cluster: PoDs of 256 GPUs (32 nodes x 8), half training, half generation; 256 core-facing
ports of 400 Gb/s per PoD. Fabrics (``flowrl.sim.network.run_fabric``, flow-level model):

- ``fat-tree 1:1``: all 256 ports on a non-blocking electrical core (the paper's ideal);
- ``fat-tree 3:1``: 85 ports (3:1 oversubscribed leaf-spine / fat-tree);
- ``static OCS``: 32 EPS ports + 224 optical ports laid out once for the mean of the
  all-reduce's, the weight sync's and the KV migrations' demand and never changed
  (one-shot, TopoOpt-like);
- ``rfabric``: 32 EPS + 224 OCS ports, the paper's templates and slack rule
  (``FabricPolicy(rule="slack", materializer="template")``);
- ``rfabric+``: ours, demand-materialized circuits (the KV migrations' volume included in
  the train layout, which the generation runs under) and the benefit rule.

Both policies give the generation PoDs circuits among themselves while training trains
(the paper's generation topology, laid "once before a new parallel deployment"), take them
for the weight-sync tree and give them back once the weights have landed.

Workloads (``FabricWorkload``): ``dense-72B`` (generation-bound: 120 s generation, 90 s
training, 144 GB of bf16 gradients and weights), ``moe-671B`` (training-bound: 60 s
generation, 90 s training, 1.34 TB), both one-step off-policy, and ``moe-671B-onpolicy``
(generation waits for the weight sync). ``rfabric+`` is told which phases are critical
(the all-reduce; the weight sync too when on-policy). OCS delay (switching + steering):
0.05 s (3D MEMS) and 3 s (a slow switch, more than the 2 s optimizer slack before the
weight sync, less than the 5 s before the first gradient all-reduce).

Step time cannot tell these fabrics apart (a few hundred milliseconds of core traffic
against minutes of compute); the per-phase transfer times can. Read ``phases_s`` (mean
seconds per step of each kind of core traffic: ``weight_sync``, ``allreduce``,
``kv_migration`` — the balancer's KV moves between generation PoDs — and ``data_hub`` —
rollouts from generation to training PoDs; the last two run during generation over the
circuits in place, and are timed as the step's bytes at the generation window's
time-averaged capacity),
``phases_vs_fat_tree`` (the same over the non-blocking fat-tree's), ``ports`` (core ports
per PoD and in total, electrical vs optical), ``step_vs_fat_tree`` (steady step time over
the fat-tree's), ``reconfigurations`` over 6 steps (the first profiles), ``stall_s`` (delay
the slack did not hide) and ``slack_used_s``. ``summary`` gives, per fabric, the worst
(largest) ratio to the fat-tree of each phase over every workload, delay and scale.

Usage: ``python benchmarks/fabric.py [--json] [--quick]``; deterministic, seconds to run.
"""

from __future__ import annotations

import argparse
import json
import sys

from flowrl.sched import FabricPolicy, FabricSpec, materialize, phase_demand
from flowrl.sched.fabric import empty
from flowrl.sim import FabricWorkload, run_fabric

# DeepSeek-V3's MLA caches 70 KB a token (61 layers x 576 values x 2 bytes), not 320 KB:
# the same 250 migrated requests of 4 k tokens per PoD move 72 GB
MLA_KV_BYTES = 72e9
PHASES = {
    "weight_sync": "sync_s",
    "allreduce": "allreduce_s",
    "kv_migration": "kv_s",
    "data_hub": "hub_s",
}
WORKLOADS = {
    "dense-72B": FabricWorkload(),
    "moe-671B": FabricWorkload(
        gen_s=60.0, grad_bytes=1.34e12, weight_bytes=1.34e12, kv_bytes=MLA_KV_BYTES
    ),
    "moe-671B-onpolicy": FabricWorkload(
        gen_s=60.0, grad_bytes=1.34e12, weight_bytes=1.34e12, kv_bytes=MLA_KV_BYTES, staleness=0
    ),
}
SCALES = (1024, 4096, 16384, 32768)
DELAYS = (0.05, 3.0)
EPS_SLICE = 32


def fabrics(gpus: int, delay: float, work: FabricWorkload) -> list[dict[str, object]]:
    volumes = {"train": work.grad_bytes, "sync": work.weight_bytes, "kv": work.kv_bytes}
    full = FabricSpec(gpus=gpus, ocs_delay_s=delay)
    over = FabricSpec(gpus=gpus, eps_ports=85, ocs_delay_s=delay)
    hybrid = FabricSpec(gpus=gpus, eps_ports=EPS_SLICE, ocs_delay_s=delay)
    mean = sum(phase_demand(hybrid, k, v) for k, v in volumes.items()) / len(volumes)  # type: ignore[arg-type]
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
    base = runs[0]
    pods = full.pods
    return [
        {
            "fabric": r.fabric,
            "step_s": r.step_s,
            "step_vs_fat_tree": r.step_s / base.step_s,
            "sync_s": r.sync_s,
            "allreduce_s": r.allreduce_s,
            "phases_s": {k: getattr(r, f) for k, f in PHASES.items()},
            "phases_vs_fat_tree": {
                k: getattr(r, f) / getattr(base, f) if getattr(base, f) > 0 else 1.0
                for k, f in PHASES.items()
            },
            "ports": {
                "electrical_per_pod": r.eps_ports,
                "optical_per_pod": r.ocs_ports,
                "electrical": r.eps_ports * pods,
                "optical": r.ocs_ports * pods,
            },
            "exposed_s": r.exposed_s,
            "reconfigurations": r.reconfigurations,
            "stall_s": r.stall_s,
            "slack_used_s": r.slack_used_s,
        }
        for r in runs
    ]


def summarise(rows: list[dict[str, object]]) -> dict[str, object]:
    """Per fabric: the worst ratio to the fat-tree of each phase, and its ports per PoD."""
    out: dict[str, object] = {}
    for r in rows:
        cur = out.setdefault(r["fabric"], {"ports_per_pod": {}, "worst_vs_fat_tree": {}})
        ports = r["ports"]
        cur["ports_per_pod"] = {  # type: ignore[index]
            "electrical": ports["electrical_per_pod"],  # type: ignore[index]
            "optical": ports["optical_per_pod"],  # type: ignore[index]
        }
        worst = cur["worst_vs_fat_tree"]  # type: ignore[index]
        for k, v in r["phases_vs_fat_tree"].items():  # type: ignore[attr-defined]
            worst[k] = round(max(worst.get(k, 0.0), v), 3)
    return out


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
    out = {"rows": rows, "summary": summarise(rows)}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        for r in rows:
            ph = r["phases_s"]
            print(
                f"{r['workload']:10} delay {r['ocs_delay_s']:4} {r['gpus']:6} {r['fabric']:13} "
                f"step x{r['step_vs_fat_tree']:.4f} sync {ph['weight_sync']:.3f} s "
                f"allreduce {ph['allreduce']:.3f} s kv {ph['kv_migration']:.3f} s "
                f"hub {ph['data_hub']:.4f} s reconf {r['reconfigurations']} "
                f"stall {r['stall_s']:.2f} s slack {r['slack_used_s']:.2f} s"
            )
        for name, s in out["summary"].items():
            print(f"{name:13} {s}")
    return out


if __name__ == "__main__":
    main()

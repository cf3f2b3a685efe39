"""Heterogeneous allocation (AReaL-Hex): distance to the exact optimum, model fidelity,
scheduling time, and throughput per dollar.

GPU types: H800 (80 GB, 3.35 TB/s, 989 TFLOP/s, $5.28/h), H20 (96 GB, 4.0 TB/s, 148 TFLOP/s,
$1.85/h), A100 (80 GB, 2.0 TB/s, 312 TFLOP/s, $2.00/h), L40S (48 GB, 0.86 TB/s, 362 TFLOP/s,
PCIe-class 32 GB/s links, $1.20/h). Workload per step: 512-token prompts, lognormal responses
(median 1,500, sigma 1; 512 profiled samples, 8 length classes), a 7B- or 14B-shaped dense
model; "long" caps responses at 16 k tokens (the step is often the longest response decoded
alone), "capped" at 4 k with twice the rollouts (the step is throughput or training bound).

Sections of the JSON:

- ``exact``: ``allocate`` against the independent exact reference of the tests
  (``tests/unit/hex_oracle.py``: its own enumeration of replicas and splits, a highspy MILP
  by bisection on the step, solved from scratch) on 24-256 GPUs of 2-4 types.
  ``gap = step / reference - 1`` (the reference brackets the optimum to 1e-5), and the
  paper's repartition heuristic (``method="bisect"``) on the same instances.
- ``fidelity``: a plan's predicted generation makespan over its true one, the truth being
  the same replicas evaluated with 64 length classes; for the mean-length model (1 class,
  what the allocator used before) and the 8-class model.
- ``timing``: wall time of ``allocate`` at 256 GPUs of 3 types (96 H800 + 96 H20 + 64
  A100), median of ``--repeats`` runs per workload, with the load average (shared machine).
- ``budget``: at about the paper's hourly budget, 32 H800, 88 H20 and 24 + 24; tokens per
  dollar of the mixed cluster over each homogeneous one (the paper: up to 1.50x).

Usage: ``python benchmarks/hex_alloc.py [--json] [--quick] [--repeats N]`` (``--quick``: the
smallest instances, for the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import msgspec
import numpy as np

from flowrl.sched import HardwareSpec, ModelSpec
from flowrl.sched.hex_alloc import GpuPool, HexPlan, HexWorkload, allocate, replica_config

HWS = {
    "H800": HardwareSpec(),
    "H20": HardwareSpec(hbm_bytes=96e9, hbm_bw=4.0e12, flops=148e12),
    "A100": HardwareSpec(hbm_bytes=80e9, hbm_bw=2.0e12, flops=312e12),
    "L40S": HardwareSpec(hbm_bytes=48e9, hbm_bw=0.864e12, flops=362e12, link_bw=32e9),
}
PRICES = {"H800": 5.28, "H20": 1.85, "A100": 2.0, "L40S": 1.2}
MODELS = {
    "7B": ModelSpec(
        name="dense-7b", params=7.6e9, layers=28, hidden=3584, n_heads=28, n_kv_heads=4
    ),
    "14B": ModelSpec(),
}
EXACT = [  # (GPUs per type, model, workload)
    ({"H800": 16, "H20": 8}, "7B", "capped"),
    ({"H800": 16, "H20": 16, "A100": 16}, "7B", "long"),
    ({"H800": 16, "H20": 16, "A100": 16, "L40S": 16}, "14B", "capped"),
    ({"H800": 48, "H20": 48, "A100": 32}, "14B", "capped"),
    ({"H800": 96, "H20": 96, "A100": 64}, "14B", "capped"),
    ({"H800": 96, "H20": 96, "A100": 64}, "7B", "long"),
    ({"H800": 64, "H20": 64, "A100": 64, "L40S": 64}, "14B", "capped"),
]
QUICK = 2  # --quick: the first instances of EXACT
BIG = {"H800": 96, "H20": 96, "A100": 64}
BUDGET = {"32xH800": {"H800": 32}, "88xH20": {"H20": 88}, "24xH800+24xH20": {"H800": 24, "H20": 24}}


def _oracle() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "tests" / "unit" / "hex_oracle.py"
    spec = importlib.util.spec_from_file_location("hex_oracle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pools(counts: dict[str, int]) -> list[GpuPool]:
    return [
        GpuPool(name=k, hw=HWS[k], count=n, price_per_hour=PRICES[k]) for k, n in counts.items()
    ]


def workload(model: str, kind: str, classes: int = 8, seed: int = 0) -> HexWorkload:
    rng = np.random.default_rng(seed)
    cap, rollouts = (16384, 4096) if kind == "long" else (4096, 8192)
    lens = np.minimum(np.exp(rng.normal(np.log(1500), 1.0, size=512)), cap).round()
    return HexWorkload(
        model=MODELS[model],
        rollouts=rollouts,
        prompt_tokens=512,
        response_lengths=tuple(lens),
        length_classes=classes,
    )


def describe(plan: HexPlan, wall: float) -> dict[str, object]:
    return {
        "train_gpus": list(plan.train_gpus),
        "rollout_gpus": list(plan.rollout_gpus),
        "train_dp": plan.train.dp,
        "train_stages": [list(s) for s in plan.train.stages],
        "replicas": [
            [[list(s) for s in c.stages], n]
            for c, n in zip(plan.rollout.configs, plan.rollout.replicas, strict=True)
        ],
        "step_s": plan.step_s,
        "train_s": plan.train_s,
        "rollout_s": plan.rollout_s,
        "tokens_per_s": plan.tokens_per_s,
        "tokens_per_dollar": plan.tokens_per_dollar,
        "milps": plan.evaluated,
        "wall_s": wall,
    }


def timed(ps: list[GpuPool], wl: HexWorkload, **kw: object) -> tuple[HexPlan, float]:
    t0 = time.perf_counter()
    plan = allocate(ps, wl, **kw)  # type: ignore[arg-type]
    return plan, time.perf_counter() - t0


def exact_rows(oracle: ModuleType, quick: bool) -> list[dict[str, object]]:
    rows = []
    for counts, model, kind in EXACT[:QUICK] if quick else EXACT:
        ps, wl = pools(counts), workload(model, kind)
        ours, wall = timed(ps, wl)
        paper, paper_wall = timed(ps, wl, method="bisect")
        t0 = time.perf_counter()
        ref = oracle.reference(ps, wl)
        rows.append(
            {
                "gpus": counts,
                "model": model,
                "workload": kind,
                "reference_lo": ref.lo,
                "reference_hi": ref.hi,
                "reference_wall_s": time.perf_counter() - t0,
                "gap": ours.step_s / ref.hi - 1,
                "paper_gap": paper.step_s / ref.hi - 1,
                "ours": describe(ours, wall),
                "paper": describe(paper, paper_wall),
            }
        )
    return rows


def fidelity(oracle: ModuleType, quick: bool) -> dict[str, object]:
    """Predicted makespan over the truth (64 classes) of the plans of 1- and 8-class models."""
    out: dict[str, object] = {}
    cases = EXACT[:QUICK] if quick else [e for e in EXACT if sum(e[0].values()) <= 128]
    for classes in (1, 8):
        ratios = []
        for counts, model, kind in cases:
            ps = pools(counts)
            plan = allocate(ps, workload(model, kind, classes))
            fine = workload(model, kind, 64)
            configs = tuple(replica_config(c.stages, ps, fine) for c in plan.rollout.configs)
            truth = oracle.true_makespan(configs, plan.rollout.replicas, fine)
            ratios.append(plan.rollout.makespan / truth)
        out[f"classes_{classes}"] = ratios
    return out


def timing(repeats: int) -> dict[str, object]:
    ps = pools(BIG)
    walls = {}
    for model, kind in (("7B", "long"), ("14B", "capped")):
        walls[f"{model}/{kind}"] = statistics.median(
            timed(ps, workload(model, kind))[1] for _ in range(repeats)
        )
    return {"wall_s": walls, "max_wall_s": max(walls.values()), "loadavg": os.getloadavg()}


def budget() -> dict[str, object]:
    rows: dict[str, object] = {}
    ratios: dict[str, dict[str, float]] = {"hetero_over_h800": {}, "hetero_over_h20": {}}
    for model in MODELS:
        tpd = {}
        for name, counts in BUDGET.items():
            plan, wall = timed(pools(counts), workload(model, "long"))
            rows[f"{model}/{name}"] = describe(plan, wall)
            tpd[name] = plan.tokens_per_dollar
        ratios["hetero_over_h800"][model] = tpd["24xH800+24xH20"] / tpd["32xH800"]
        ratios["hetero_over_h20"][model] = tpd["24xH800+24xH20"] / tpd["88xH20"]
    return {"rows": rows, **ratios}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    oracle = _oracle()
    exact = exact_rows(oracle, args.quick)
    out: dict[str, object] = {
        "exact": exact,
        "fidelity": fidelity(oracle, args.quick),
        "summary": {
            "max_gap": max(float(r["gap"]) for r in exact),  # type: ignore[arg-type]
            "max_paper_gap": max(float(r["paper_gap"]) for r in exact),  # type: ignore[arg-type]
        },
    }
    if not args.quick:
        out["timing"] = timing(args.repeats)
        out["budget"] = budget()
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=msgspec.to_builtins)
        print()
    else:
        for r in exact:
            print(
                f"{r['gpus']} {r['model']}/{r['workload']}: step {r['ours']['step_s']:.2f} s, "  # type: ignore[index]
                f"gap {r['gap']:+.2e}, paper {r['paper_gap']:+.2%}, "
                f"ours {r['ours']['wall_s']:.2f} s, reference {r['reference_wall_s']:.1f} s"  # type: ignore[index]
            )
        print(json.dumps({k: v for k, v in out.items() if k != "exact"}, indent=1))
    return out


if __name__ == "__main__":
    main()

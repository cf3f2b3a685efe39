"""Run several schemes on one cluster and workload; tabulate, summarise and plot them.

Shared by the ``flowrl sim`` CLI and ``benchmarks/sched_sim.py``. Per scheme it reports the
mean generation makespan per step, end-to-end throughput (response tokens / time to the
last training step's end), generation-stage throughput, migrated fraction, and re-plan and
balancer-tick latencies (wall-clock, this machine).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowrl.sim.cluster import ClusterSpec
from flowrl.sim.engine import SimResult, Simulator
from flowrl.sim.schemes import Scheme
from flowrl.sim.workload import Workload

__all__ = ["format_table", "plot_curves", "run_schemes", "summarise"]


def run_schemes(
    cluster: ClusterSpec,
    workload: Workload,
    schemes: Sequence[Scheme],
    *,
    steps: int,
    seed: int,
    tick_s: float = 0.25,
) -> dict[str, SimResult]:
    return {
        s.name: Simulator(cluster, workload, s, steps=steps, seed=seed, tick_s=tick_s).run()
        for s in schemes
    }


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def summarise(r: SimResult) -> dict[str, object]:
    return {
        "makespan_s": [round(s.makespan, 1) for s in r.steps],
        "mean_makespan_s": round(float(np.mean([s.makespan for s in r.steps])), 1),
        "stage_s": [round(s.stage_end - s.start, 1) for s in r.steps],
        "throughput_tok_s": round(r.throughput, 1),
        "gen_throughput_tok_s": round(r.gen_throughput, 1),
        "migrated_fraction": round(r.migrated_fraction, 4),
        "relaid_fraction": round(r.relaid / max(r.requests, 1), 4),
        "plans": r.plans,
        "plans_applied": r.plans_applied,
        "replan_p50_ms": round(_pct(r.replan_ms, 50), 2),
        "replan_p99_ms": round(_pct(r.replan_ms, 99), 2),
        "balancer_tick_ms": round(float(np.mean(r.balancer_ms)) if r.balancer_ms else 0.0, 3),
        "balancer_tick_p99_ms": round(_pct(r.balancer_ms, 99), 3),
        "fusion_threshold": [s.threshold for s in r.steps],
        "fused_after_s": [
            round(s.fused_at - s.start, 1) if s.fused_at >= 0 else None for s in r.steps
        ],
        "forecast_bucket_error": round(float(np.mean(r.forecast_errors)), 4)
        if r.forecast_errors
        else None,
        "events": r.events,
        "sim_wall_s": round(r.wall_s, 2),
    }


def format_table(results: dict[str, SimResult]) -> str:
    best_static = max(
        (r.throughput for n, r in results.items() if n.startswith("static")), default=0.0
    )
    head = (
        f"{'scheme':26s} {'makespan/step s':>16s} {'tok/s (e2e)':>12s} {'vs best static':>15s}"
        f" {'migrated':>9s} {'replan p50 ms':>14s} {'bal tick ms':>12s}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        s = summarise(r)
        ratio = r.throughput / best_static if best_static else float("nan")
        lines.append(
            f"{name:26s} {s['mean_makespan_s']:>16} {r.throughput:>12.0f} {ratio:>14.2f}x"
            f" {r.migrated_fraction:>9.3f} {s['replan_p50_ms']:>14} {s['balancer_tick_ms']:>12}"
        )
    return "\n".join(lines)


def plot_curves(results: dict[str, SimResult], path: str, *, step: int = -1) -> None:
    """Remaining requests over time in one generation step, one line per scheme (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        s = r.steps[step]
        t = np.asarray(s.curve_t) - s.start
        ax.plot(t, s.curve_remaining, label=f"{name} ({s.makespan:.0f} s)")
    ax.set_xlabel("seconds since step start")
    ax.set_ylabel("remaining requests")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_title(f"generation step {results[next(iter(results))].steps[step].step}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

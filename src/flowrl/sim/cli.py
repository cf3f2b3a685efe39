"""``flowrl sim``: simulate scheduling schemes on a disaggregated RL cluster.

Examples::

    flowrl sim                                   # 64 GPUs, every standard scheme, table
    flowrl sim --gpus 2048 --requests 32768 --schemes planner+balancer --steps 1
    flowrl sim --json --plot remaining.png       # JSON summary + remaining-requests plot
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from flowrl.errors import ConfigError
from flowrl.sim.cluster import ClusterSpec
from flowrl.sim.report import format_table, plot_curves, run_schemes, summarise
from flowrl.sim.schemes import Scheme, standard_schemes
from flowrl.sim.workload import Workload

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowrl sim",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--gpus", type=int, default=64, help="generation GPUs (multiple of 8)")
    p.add_argument("--requests", type=int, default=16384, help="requests per step")
    p.add_argument("--steps", type=int, default=3, help="RL steps simulated")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths")
    p.add_argument("--median", type=float, default=1500.0, help="median response length")
    p.add_argument("--sigma", type=float, default=1.05, help="lognormal sigma of lengths")
    p.add_argument("--drift", type=float, default=0.06, help="median growth per step")
    p.add_argument("--max-len", type=int, default=32768, help="generation length cap")
    p.add_argument("--trace", help="file of recorded response lengths, one per line")
    p.add_argument("--tick", type=float, default=0.25, help="simulation tick, seconds")
    p.add_argument("--schemes", default="all", help="comma-separated scheme names, or 'all'")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PATH", help="write remaining-requests plot (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        trace: tuple[int, ...] = ()
        if args.trace:
            with open(args.trace, encoding="utf-8") as fh:
                trace = tuple(int(float(x)) for x in fh.read().split())
        workload = Workload(
            kind="trace" if trace else "drift",
            requests_per_step=args.requests,
            median=args.median,
            sigma=args.sigma,
            drift_per_step=args.drift,
            max_len=args.max_len,
            trace=trace,
        )
        cluster = ClusterSpec(gpus=args.gpus)
        schemes = standard_schemes(cluster)
        names = list(schemes) if args.schemes == "all" else args.schemes.split(",")
        unknown = [n for n in names if n not in schemes]
        if unknown:
            raise ConfigError(f"unknown scheme(s) {unknown}; choose from {list(schemes)}")
        _check_solver([schemes[n] for n in names], list(schemes.values()))
        results = run_schemes(
            cluster,
            workload,
            [schemes[n] for n in names],
            steps=args.steps,
            seed=args.seed,
            tick_s=args.tick,
        )
    except (ConfigError, OSError, ValueError) as exc:
        print(f"flowrl sim: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot_curves(results, args.plot)
    if args.json:
        print(json.dumps({n: summarise(r) for n, r in results.items()}))
    else:
        print(format_table(results))
        print(LEGEND)
    return 0


LEGEND = (
    "makespan/step: simulated seconds of one generation step; tok/s (e2e): tokens generated "
    "per second over the run;\nvs best static: tok/s over the best static scheme's tok/s "
    "(higher is better); migrated: share of requests moved by the balancer."
)


def _check_solver(chosen: list[Scheme], every: list[Scheme]) -> None:
    """Refuse, before simulating, schemes whose planner needs HiGHS when it is missing."""
    if importlib.util.find_spec("highspy") is not None:
        return
    needs = [s.name for s in chosen if s.planner is not None and s.planner.method != "greedy"]
    if needs:
        without = [s.name for s in every if s.planner is None]
        raise ConfigError(
            f"scheme(s) {', '.join(needs)} plan with HiGHS, which is not installed: "
            f"pip install 'flowrl[sched]', or run --schemes {','.join(without)}"
        )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Scheduling schemes the simulator compares: which policies run, and how often.

A :class:`Scheme` names an initial parallel mode for every node and the policies that
steer the cluster: the proactive planner (every ``plan_interval_s`` and at step start),
the reactive balancer (every ``balance_interval_s``) and long-tail fusion.
:func:`standard_schemes` builds the comparison of the benchmark: static throughput-oriented
(the mode with the best saturated tokens/s per GPU on every node), static latency-oriented
(the mode with the lowest per-token latency), balancer only, planner only, planner +
balancer, and planner + balancer + long-tail migration.
"""

from __future__ import annotations

from typing import final

import msgspec

from flowrl.sched.balancer import BalancerConfig
from flowrl.sched.costmodel import latency_per_token, saturated_token_rate
from flowrl.sched.fusion import FusionConfig
from flowrl.sched.planner import PlannerConfig
from flowrl.sim.cluster import ClusterSpec

__all__ = ["Scheme", "latency_mode", "standard_schemes", "throughput_mode"]


@final
class Scheme(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    initial_mode: str
    planner: PlannerConfig | None = None
    plan_interval_s: float = 10.0
    balancer: BalancerConfig | None = None
    balance_interval_s: float = 1.0
    fusion: FusionConfig | None = None


def throughput_mode(cluster: ClusterSpec, mean_ctx: float = 3000.0) -> str:
    rates = [
        saturated_token_rate(m, mean_ctx, cluster.bs_max, cluster.model, cluster.hw) / m.gpus
        for m in cluster.modes
    ]
    return cluster.modes[max(range(len(rates)), key=rates.__getitem__)].name


def latency_mode(cluster: ClusterSpec, ctx: float = 10000.0) -> str:
    lats = [float(latency_per_token(m, ctx, cluster.model, cluster.hw)) for m in cluster.modes]
    return cluster.modes[min(range(len(lats)), key=lats.__getitem__)].name


def standard_schemes(
    cluster: ClusterSpec, *, planner: PlannerConfig | None = None
) -> dict[str, Scheme]:
    """The schemes of the benchmark's comparison table, keyed by name."""
    pcfg = planner or PlannerConfig(model=cluster.model, hw=cluster.hw, bs_max=cluster.bs_max)
    bcfg = BalancerConfig()
    fcfg = FusionConfig(
        infer_flops_per_token=cluster.infer_cost,
        infer_eta=cluster.infer_eta,
        setup_s=cluster.infer_setup_s,
        bs_max=cluster.bs_max,
    )
    thr, lat = throughput_mode(cluster), latency_mode(cluster)
    out = [
        Scheme(name="static-throughput", initial_mode=thr),
        Scheme(name="static-latency", initial_mode=lat),
        Scheme(name="balancer-only", initial_mode=thr, balancer=bcfg),
        Scheme(name="planner", initial_mode=thr, planner=pcfg),
        Scheme(name="planner+balancer", initial_mode=thr, planner=pcfg, balancer=bcfg),
        Scheme(
            name="planner+balancer+fusion",
            initial_mode=thr,
            planner=pcfg,
            balancer=bcfg,
            fusion=fcfg,
        ),
    ]
    return {s.name: s for s in out}

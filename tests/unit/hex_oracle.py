"""An exact reference for heterogeneous allocation, written apart from ``flowrl.sched``'s
solver: it enumerates the replica configurations and the splits itself (no pruning, no
Pareto filter), takes only the model's numbers from flowrl (``replica_config`` for one
configuration's costs, ``search_training`` for one split's training time, ``length_classes``),
and finds the minimum step by bisection on ``S`` with feasibility MILPs in highspy, where
at a fixed ``S`` the model is linear in the absolute rollouts ``x``::

    sum_psi x[psi,w] = B_w,   sum_w seconds[psi,w] x[psi,w] <= (S - fixed) y_psi,
    x[psi,w] = 0 where tail[psi,w] > S - fixed,   one split z_k with T_k <= S,
    sum_k gpus[k,t] z_k + sum_psi gpus[psi,t] y_psi <= n_t.

:func:`true_makespan` evaluates a plan's replicas the same independent way (scipy's LP).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import highspy
import numpy as np
from scipy.optimize import linprog

from flowrl.sched.hex_alloc import (
    GpuPool,
    HexWorkload,
    length_classes,
    replica_config,
    search_training,
)

TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Reference:
    lo: float  # infeasible
    hi: float  # feasible: the optimum lies in (lo, hi]
    configs: int
    splits: int


def all_configs(pools: list[GpuPool], wl: HexWorkload, max_stages: int) -> list:
    kinds = [
        (p, tp)
        for p, pool in enumerate(pools)
        for tp in TPS
        if tp <= pool.hw.gpus_per_node and tp <= pool.count
    ]
    out = []
    for n in range(1, max_stages + 1):
        for stages in itertools.combinations_with_replacement(kinds, n):
            cfg = replica_config(stages, pools, wl)
            if cfg is not None and all(
                g <= pool.count for g, pool in zip(cfg.gpus, pools, strict=True)
            ):
                out.append(cfg)
    return out


def _splits(pools: list[GpuPool], wl: HexWorkload) -> list[tuple[tuple[int, ...], float]]:
    per_pool = [sorted({*range(0, p.count + 1, p.hw.gpus_per_node), p.count}) for p in pools]
    out = []
    for split in itertools.product(*per_pool):
        if sum(split) == 0:
            continue
        plan = search_training(pools, split, wl)
        if plan is not None:
            out.append((split, plan.step_s))
    return out


def _feasible(
    s: float,
    configs: list,
    splits: list[tuple[tuple[int, ...], float]],
    demand: list[float],
    counts: list[int],
    fixed: float,
    stragglers: bool,
) -> bool:
    theta = s - fixed
    train = [(g, t) for g, t in splits if t <= s]
    if theta <= 0 or not train:
        return False
    pairs = [
        (j, w)
        for j, c in enumerate(configs)
        for w in range(len(demand))
        if np.isfinite(c.seconds[w]) and (not stragglers or c.tail_s[w] <= theta)
    ]
    if {w for _, w in pairs} != set(range(len(demand))):
        return False
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    nz, ny = len(train), len(configs)
    for _ in range(nz):
        h.addVar(0.0, 1.0)
    for c in configs:
        h.addVar(0.0, float(min(n // g for n, g in zip(counts, c.gpus, strict=True) if g)))
    for _ in pairs:
        h.addVar(0.0, inf)
    h.changeColsIntegrality(
        nz + ny,
        np.arange(nz + ny, dtype=np.int32),
        np.array([highspy.HighsVarType.kInteger] * (nz + ny)),
    )
    xcol = {p: nz + ny + i for i, p in enumerate(pairs)}
    for w, b in enumerate(demand):
        idx = [xcol[p] for p in pairs if p[1] == w]
        h.addRow(b, b, len(idx), np.array(idx, dtype=np.int32), np.ones(len(idx)))
    for j, c in enumerate(configs):
        idx = [xcol[p] for p in pairs if p[0] == j] + [nz + j]
        val = [c.seconds[w] for (jj, w) in pairs if jj == j] + [-theta]
        h.addRow(-inf, 0.0, len(idx), np.array(idx, dtype=np.int32), np.array(val))
    for t, n in enumerate(counts):
        idx = [k for k in range(nz) if train[k][0][t]] + [
            nz + j for j, c in enumerate(configs) if c.gpus[t]
        ]
        val = [float(train[k][0][t]) for k in range(nz) if train[k][0][t]] + [
            float(c.gpus[t]) for c in configs if c.gpus[t]
        ]
        if idx:
            h.addRow(-inf, float(n), len(idx), np.array(idx, dtype=np.int32), np.array(val))
    h.addRow(1.0, 1.0, nz, np.arange(nz, dtype=np.int32), np.ones(nz))
    h.run()
    return h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def reference(
    pools: list[GpuPool],
    wl: HexWorkload,
    *,
    stragglers: bool = True,
    max_stages: int = 2,
    rel: float = 1e-5,
) -> Reference:
    """The optimum step, bracketed to ``rel``."""
    configs = all_configs(pools, wl, max_stages)
    splits = _splits(pools, wl)
    demand = [c.rollouts for c in length_classes(wl)]
    counts = [p.count for p in pools]
    fixed = wl.reward_s + wl.model.weight_bytes / wl.sync_bw

    def ok(s: float) -> bool:
        return _feasible(s, configs, splits, demand, counts, fixed, stragglers)

    lo, hi = 0.0, 1.0
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > rel * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return Reference(lo=lo, hi=hi, configs=len(configs), splits=len(splits))


def true_makespan(
    configs: tuple, replicas: tuple[int, ...], wl: HexWorkload, stragglers: bool = True
) -> float:
    """The best makespan of these replicas: for each straggler level ``tau`` (pairs with a
    tail above it unused), an LP over ``(x, Theta)``; the best ``max(Theta, tau)``."""
    demand = [c.rollouts for c in length_classes(wl)]
    pairs_all = [
        (j, w)
        for j in range(len(configs))
        for w in range(len(demand))
        if np.isfinite(configs[j].seconds[w])
    ]
    levels = sorted({configs[j].tail_s[w] for j, w in pairs_all}) if stragglers else [0.0]
    best = np.inf
    for tau in levels:
        pairs = [(j, w) for j, w in pairs_all if not stragglers or configs[j].tail_s[w] <= tau]
        if {w for _, w in pairs} != set(range(len(demand))):
            continue
        n = len(pairs) + 1  # x..., Theta last
        a_eq = np.zeros((len(demand), n))
        for i, (_, w) in enumerate(pairs):
            a_eq[w, i] = 1.0
        a_ub = np.zeros((len(configs), n))
        for i, (j, w) in enumerate(pairs):
            a_ub[j, i] = configs[j].seconds[w]
        a_ub[:, -1] = -np.array(replicas, dtype=float)
        cost = np.zeros(n)
        cost[-1] = 1.0
        res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(len(configs)), A_eq=a_eq, b_eq=demand)
        if res.status == 0:
            best = min(best, max(res.fun, tau))
    return float(best)

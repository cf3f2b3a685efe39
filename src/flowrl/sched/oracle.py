"""An exact reference for the planner: the :class:`~flowrl.sched.problem.PlanProblem` model as
a MILP, written apart from :mod:`flowrl.sched.solver` and solved from scratch.

Tests and ``benchmarks/sched_sim.py`` measure the planner against it, so it shares nothing
with the planner's own solvers but the problem's coefficients and :func:`evaluate`: its own
formulation (a node's latency *level* rather than per-bucket presence), its own highspy
calls, and no starting point.

Model (the objective of :func:`~flowrl.sched.problem.evaluate`, exactly). ``y[n,m]``: node
``n`` runs mode ``m``; ``w[n,m,l]``: it does, and its longest-latency request is of bucket
``l`` (its *level*; only with a latency bound); ``c[n,m,b]`` requests of bucket ``b``::

    min  T + w_mig * sum_{n,b} mig_b * mv[n,b] + w_sw * sum_{n,m} sw[n,m] * y[n,m]
    s.t. sum_m y[n,m] <= 1,  sum_l w[n,m,l] = y[n,m]        one mode, one level per node
         sum_{n,m} gpus_m * y[n,m] <= budget
         sum_{n,m} c[n,m,b] = count_b                       every request placed once
         c[n,m,b] <= fits[m,b] * sum_{l: lat[m,l] >= lat[m,b]} w[n,m,l]   (no level: y)
         sum_b kv_b * c[n,m,b] <= kv_limit * cap_m * y[n,m]
         sum_m (sw[n,m] * y[n,m] + sum_b work[m,b] * c[n,m,b]) <= T           throughput
         sum_m sum_l (sw[n,m] + lat[m,l]) * w[n,m,l] + sum_{m,b} co[m,b] * c[n,m,b] <= T
         mv[n,b] >= holdings[n,b] - sum_m c[n,m,b],  mv >= 0

``fits[m,b]`` is ``count_b`` or what the KV limit lets one node hold, the smaller. The level
row is the node's longest request plus what its co-runners add: a node whose level exceeds
its longest request only over-estimates, so the optimum picks the true one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.sched._highs import _silence_banner
from flowrl.sched.problem import PlanProblem, evaluate, feasible

__all__ = ["ExactPlan", "solve_exact"]

I64 = NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class ExactPlan:
    """The reference's plan: ``objective`` re-scored by :func:`evaluate`; ``bound`` the
    solver's proven lower bound; ``optimal`` whether the gap closed (``mip_rel_gap``)."""

    mode: I64
    counts: I64
    objective: float
    bound: float
    optimal: bool
    solve_s: float


def solve_exact(
    p: PlanProblem, *, time_limit: float = 60.0, mip_rel_gap: float = 1e-4
) -> ExactPlan | None:
    """Solve ``p`` exactly (HiGHS branch-and-cut, no warm start); ``None`` if infeasible or
    no integer point was found within ``time_limit`` seconds."""
    try:
        import highspy
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError("the exact planner reference needs highspy (the 'sched' extra)") from exc
    _silence_banner(highspy)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    inf = highspy.kHighsInf
    nb = p.n_buckets
    count = p.count.astype(float)
    pairs = [(n, int(m)) for n in range(p.n_nodes) for m in p.cand if p.allowed[n, m]]

    def new(k: int, lo: float, hi: NDArray | float, cost: NDArray | float, integral: bool):
        first = h.getNumCol()
        hi_a = np.broadcast_to(np.asarray(hi, dtype=float), (k,))
        cost_a = np.broadcast_to(np.asarray(cost, dtype=float), (k,))
        h.addVars(k, np.full(k, lo), np.ascontiguousarray(hi_a))
        idx = np.arange(first, first + k, dtype=np.int32)
        h.changeColsCost(k, idx, np.ascontiguousarray(cost_a))
        if integral:
            h.changeColsIntegrality(k, idx, np.ones(k, dtype=np.uint8))  # kInteger
        return idx

    def row(lo: float, hi: float, cols: list[int] | NDArray, vals: list[float] | NDArray) -> None:
        c = np.asarray(cols, dtype=np.int32)
        h.addRow(lo, hi, len(c), c, np.asarray(vals, dtype=float))

    t = int(new(1, 0.0, inf, 1.0, False)[0])
    y = {pr: int(new(1, 0.0, 1.0, p.switch_weight * p.switch[pr], True)[0]) for pr in pairs}
    c = {pr: new(nb, 0.0, count, 0.0, True) for pr in pairs}
    levels = bool(p.lat.any() or p.co.any())
    w = {pr: new(nb, 0.0, 1.0, 0.0, True) for pr in pairs} if levels else {}
    held = np.argwhere(p.holdings > 0)
    mv = new(len(held), 0.0, inf, p.mig_weight * p.mig[held[:, 1]], False)
    for n in range(p.n_nodes):
        mine = [pr for pr in pairs if pr[0] == n]
        if not mine:
            continue
        row(-inf, 1.0, [y[pr] for pr in mine], np.ones(len(mine)))
        cols = [t] + [y[pr] for pr in mine] + [int(j) for pr in mine for j in c[pr]]
        vals = [-1.0] + [float(p.switch[pr]) for pr in mine]
        row(-inf, 0.0, cols, vals + [float(v) for _, m in mine for v in p.work[m]])
        if levels:
            cols = [t] + [int(j) for pr in mine for j in (*w[pr], *c[pr])]
            per = [np.concatenate([p.switch[pr] + p.lat[pr[1]], p.co[pr[1]]]) for pr in mine]
            row(-inf, 0.0, cols, np.concatenate([[-1.0], *per]))
    row(-inf, float(p.gpu_budget), list(y.values()), [float(p.mode_gpus[m]) for _, m in pairs])
    for b in range(nb):
        row(count[b], count[b], [int(c[pr][b]) for pr in pairs], np.ones(len(pairs)))
    for (n, m), cc in c.items():
        yy = y[(n, m)]
        fits = np.minimum(count, np.floor(p.kv_limit * float(p.cap[m]) / p.kv + 1e-9))
        row(-inf, 0.0, [*cc, yy], [*p.kv, -p.kv_limit * float(p.cap[m])])
        if not levels:
            for b in range(nb):
                row(-inf, 0.0, [cc[b], yy], [1.0, -fits[b]])
            continue
        ww = w[(n, m)]
        row(0.0, 0.0, [*ww, yy], [*np.ones(nb), -1.0])
        for b in range(nb):
            up = np.flatnonzero(p.lat[m] >= p.lat[m, b])
            row(-inf, 0.0, [cc[b], *ww[up]], [1.0, *np.full(len(up), -fits[b])])
    for k, (n, b) in enumerate(held):
        cols = [int(mv[k])] + [int(c[pr][b]) for pr in pairs if pr[0] == n]
        row(float(p.holdings[n, b]), inf, cols, np.ones(len(cols)))
    h.run()
    info = h.getInfo()
    if info.primal_solution_status != 2:
        return None
    x = np.asarray(h.getSolution().col_value)
    mode = np.full(p.n_nodes, -1, dtype=np.int64)
    counts = np.zeros((p.n_nodes, nb), dtype=np.int64)
    for (n, m), cc in c.items():
        if x[y[(n, m)]] > 0.5:
            mode[n] = m
            counts[n] = np.rint(x[cc]).astype(np.int64)
    if feasible(p, mode, counts) is not None:
        return None
    status = h.modelStatusToString(h.getModelStatus())
    return ExactPlan(
        mode=mode,
        counts=counts,
        objective=evaluate(p, mode, counts).objective,
        bound=float(info.mip_dual_bound),
        optimal=status == "Optimal",
        solve_s=float(h.getRunTime()),
    )

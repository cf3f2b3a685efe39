"""Proactive planner: choose every node's parallel mode and where pending requests run.

``plan(snapshot, estimate, config)`` is pure: it reads a :class:`ClusterSnapshot` and the
forecaster's :class:`~flowrl.sched.forecast.RemainingEstimate` per pending request, and
returns a :class:`Plan`. It follows OrchestrRL §4.1: requests are grouped into 256-token
remaining-length buckets, the cluster is modelled as a MILP over (node, mode) choices and
(node, bucket) counts that minimises expected makespan + migration + mode-switch cost under
a GPU budget and a KV-balance constraint (see :mod:`flowrl.sched.problem`), solved by HiGHS
(:mod:`flowrl.sched.solver`).

Solving strategy (``method``):

- ``"greedy"``: current modes, bisection-packed assignment (milliseconds; always feasible
  when the KV limit allows any assignment);
- ``"lp"`` (default): LP relaxation -> mode-mix rounding -> local search -> LP polish, with
  counted budgets (``max_evals`` mixes, ``lp_iterations`` simplex iterations): the plan
  depends only on the snapshot and the estimate, never on machine speed;
- ``"milp"``: the above as a warm start for the exact MILP under ``time_limit`` seconds (the
  only timed path).

Candidate modes are pruned by the wave (:func:`candidate_modes`, OrchestrRL's third
heuristic). While more requests are pending than the latency-oriented modes could run at
once, the wave is in its *bulk* and the ``keep_modes`` modes with the best saturated
tokens/s per GPU are candidates; once the latency-oriented modes could hold every pending
request, the wave is in its *tail* and the ``keep_modes`` modes with the lowest per-token
latency are. Every mode a node currently runs is always a candidate, so keeping the current
layout is representable. In the bulk the problem drops its latency bound
(:func:`~flowrl.sched.problem.build_problem` with ``latency_bound=False``): a plan is for
the rest of the step, and scored with the tail's latency it would trade the bulk's
throughput for a tail that a later plan, in latency-oriented modes, handles better — the
planner re-plans and switches when the tail comes (OrchestrRL: "early in the wave ... we
favor throughput-oriented configurations to maximize aggregate token throughput").

Invariants (asserted by tests):

- a returned plan satisfies the GPU budget and the KV-balance constraint, and assigns
  every pending request exactly once to a node that is on;
- ``plan.apply`` is True only if the plan's predicted objective is below keeping the
  current layout by at least ``min_gain`` (relative); otherwise ``node_mode`` and
  ``target_node`` describe the current layout unchanged;
- requests on a node that keeps its mode stay there unless the plan's counts require moving
  them; waiting requests move before running ones, shorter contexts before longer;
- the same inputs give the same plan (``method`` ``"greedy"`` or ``"lp"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    latency_per_token,
    saturated_concurrency,
    saturated_token_rate,
)
from flowrl.sched.forecast import RemainingEstimate
from flowrl.sched.problem import Evaluation, PlanProblem, build_problem, evaluate, feasible
from flowrl.sched.snapshot import ClusterSnapshot
from flowrl.sched.solver import (
    MAX_EVALS,
    Solution,
    assign_greedy,
    fit_budget,
    solve_milp,
    solve_relaxed,
)

__all__ = ["Plan", "PlannerConfig", "candidate_modes", "plan", "realize"]

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]


@final
class PlannerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the proactive planner (see module docstring)."""

    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    hw: HardwareSpec = msgspec.field(default_factory=HardwareSpec)
    bs_max: int = 256
    bucket: int = 256
    kv_tolerance: float = 0.25
    migration_weight: float = 1.0
    switch_weight: float | None = None
    min_gain: float = 0.03
    method: Literal["greedy", "lp", "milp"] = "lp"
    time_limit: float = 1.0
    max_evals: int = MAX_EVALS
    lp_iterations: int = 20000
    gpu_budget: int | None = None
    keep_modes: int = 1

    def __post_init__(self) -> None:
        if self.bs_max < 1 or self.bucket < 1:
            raise ConfigError("PlannerConfig bs_max and bucket must be >= 1")
        if self.migration_weight < 0 or (self.switch_weight or 0.0) < 0:
            raise ConfigError("PlannerConfig migration_weight and switch_weight must be >= 0")
        if self.kv_tolerance < 0 or not 0 <= self.min_gain < 1:
            raise ConfigError("PlannerConfig needs kv_tolerance >= 0 and 0 <= min_gain < 1")
        if self.time_limit <= 0:
            raise ConfigError(f"PlannerConfig.time_limit must be > 0, got {self.time_limit}")
        if self.max_evals < 1 or self.lp_iterations < 1:
            raise ConfigError("PlannerConfig max_evals and lp_iterations must be >= 1")
        if self.keep_modes < 1:
            raise ConfigError(f"PlannerConfig.keep_modes must be >= 1, got {self.keep_modes}")


@final
@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's decision.

    ``node_mode[n]`` is the mode index for node ``n`` (``-1`` off); ``target_node[i]`` the
    node pending request ``i`` (snapshot order) should run on. ``predicted`` and ``keep`` are
    the objective evaluations of this plan and of keeping the current layout.
    """

    node_mode: I64
    target_node: I64
    apply: bool
    predicted: Evaluation
    keep: Evaluation
    method: str
    solve_s: float
    lower_bound: float
    candidates: tuple[int, ...]
    previous_mode: I64

    @property
    def switched_nodes(self) -> I64:
        """Indices of nodes whose mode this plan changes."""
        return np.nonzero(self.node_mode != self.previous_mode)[0]


def candidate_modes(
    modes: tuple[ParallelMode, ...],
    pending: int,
    node_gpus: I64,
    current: I64,
    *,
    keep: int,
    mean_ctx: float,
    bs_max: int,
    model: ModelSpec,
    hw: HardwareSpec,
) -> tuple[I64, bool]:
    """Modes worth considering at this point of the wave, and whether it is in its tail.

    See the module docstring: ``(indices into modes, tail)``.
    """
    thr = np.array([saturated_token_rate(m, mean_ctx, bs_max, model, hw) / m.gpus for m in modes])
    lat = np.array([float(latency_per_token(m, mean_ctx, model, hw)) for m in modes])
    by_lat = np.argsort(lat, kind="stable")[:keep]
    holds = [
        int((node_gpus // m.gpus).sum()) * saturated_concurrency(m, mean_ctx, bs_max, model, hw)
        for m in modes
    ]
    tail = pending <= min(holds[int(j)] for j in by_lat)
    chosen = by_lat if tail else np.argsort(-thr, kind="stable")[:keep]
    best = {int(j) for j in chosen} | {int(m) for m in current if m >= 0}
    return np.array(sorted(best), dtype=np.int64), bool(tail)


def realize(p: PlanProblem, snap: ClusterSnapshot, mode: I64, counts: I64) -> I64:
    """Turn bucket counts into a target node per request (see invariants).

    On each (node, bucket) ``min(holdings, counts)`` requests stay (re-laid out in place if
    the node switches mode); the surplus moves to nodes whose counts exceed their holdings.
    """
    q = snap.requests
    target = p.req_node.copy()
    # within (bucket, node): waiting first, then short context first -> those move first
    order = np.lexsort((q.context, q.running, p.req_node, p.req_bucket))
    rb, rn = p.req_bucket[order], p.req_node[order]
    group = rb * p.n_nodes + rn
    start = np.r_[0, np.nonzero(np.diff(group))[0] + 1] if len(order) else np.zeros(0, int)
    rank = np.arange(len(order)) - np.repeat(start, np.diff(np.r_[start, len(order)]))
    stay = np.minimum(p.holdings, counts)
    movers = rank < (p.holdings - stay)[rn, rb]
    deficit = counts - stay
    for b in np.unique(rb[movers]):
        sel = order[movers & (rb == b)]
        dest = np.repeat(np.arange(p.n_nodes), deficit[:, b])
        target[sel] = dest[: len(sel)]
    return target


def _keep_plan(p: PlanProblem) -> tuple[I64, I64]:
    return p.current.copy(), p.holdings.copy()


def plan(snap: ClusterSnapshot, est: RemainingEstimate, config: PlannerConfig) -> Plan:
    """Decide modes and request placement for ``snap`` (see module docstring).

    ``est`` holds the remaining-length estimate of each pending request, in snapshot order
    (:meth:`~flowrl.sched.forecast.LengthForecaster.estimates`, or
    :meth:`RemainingEstimate.known` for exact lengths).
    """
    t0 = time.perf_counter()
    q = snap.requests
    if len(est) != len(q):
        raise ConfigError(
            f"the estimate has {len(est)} entries, the snapshot {len(q)} pending requests; "
            "pass one remaining-length estimate per pending request, in snapshot order"
        )
    mean_ctx = float(np.mean(q.context + est.mean / 2)) if len(q) else 1.0
    cand, tail = candidate_modes(
        snap.modes,
        len(q),
        snap.node_gpus,
        snap.node_mode,
        keep=config.keep_modes,
        mean_ctx=mean_ctx,
        bs_max=config.bs_max,
        model=config.model,
        hw=config.hw,
    )
    p = build_problem(
        snap,
        est,
        cand=cand,
        model=config.model,
        hw=config.hw,
        bs_max=config.bs_max,
        bucket=config.bucket,
        kv_tolerance=config.kv_tolerance,
        mig_weight=config.migration_weight,
        switch_weight=config.switch_weight,
        gpu_budget=config.gpu_budget,
        latency_bound=tail,
    )
    keep_mode, keep_c = _keep_plan(p)
    keep = evaluate(p, keep_mode, keep_c)
    sols: list[Solution] = []
    start = fit_budget(p, keep_mode)
    c = assign_greedy(p, start)
    if c is not None:
        sols.append(Solution(start, c, evaluate(p, start, c).objective, "greedy"))
    bound = float("nan")
    if config.method in ("lp", "milp") and len(q):
        s = solve_relaxed(p, max_evals=config.max_evals, lp_iterations=config.lp_iterations)
        if s is not None:
            sols.append(s)
            bound = s.bound
    if config.method == "milp" and len(q):
        warm = min(sols, key=lambda s: s.objective) if sols else None
        s = solve_milp(p, time_limit=config.time_limit, start=warm)
        if s is not None:
            sols.append(s)
            bound = s.bound
    sols = [s for s in sols if feasible(p, s.mode, s.counts) is None]
    best = min(sols, key=lambda s: s.objective) if sols else None
    apply = best is not None and best.objective < keep.objective * (1.0 - config.min_gain)
    if apply and best is not None:
        mode, counts, method = best.mode, best.counts, best.method
        target = realize(p, snap, mode, counts)
        pred = evaluate(p, mode, counts)
    else:
        mode, target, method, pred = keep_mode, p.req_node.copy(), "keep", keep
    return Plan(
        node_mode=mode,
        target_node=target,
        apply=bool(apply),
        predicted=pred,
        keep=keep,
        method=method,
        solve_s=time.perf_counter() - t0,
        lower_bound=bound,
        candidates=tuple(int(m) for m in cand),
        previous_mode=p.current,
    )

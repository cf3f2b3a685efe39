"""Proactive planner: choose every node's parallel mode and where pending requests run.

``plan(snapshot, remaining, config)`` is pure: it reads a :class:`ClusterSnapshot` and the
forecaster's expected remaining length per pending request, and returns a :class:`Plan`.
It follows OrchestrRL §4.1: requests are grouped into 256-token remaining-length buckets,
the cluster is modelled as a MILP over (node, mode) choices and (node, bucket) counts that
minimises expected makespan + migration + mode-switch cost under a GPU budget and a
KV-balance constraint (see :mod:`flowrl.sched.problem`), solved by HiGHS
(:mod:`flowrl.sched.solver`).

Solving strategy (``method``):

- ``"greedy"``: current modes, water-filled assignment (milliseconds; always feasible when
  the KV limit allows any assignment);
- ``"lp"`` (default): LP relaxation -> mode-mix rounding -> local search -> LP polish,
  within ``time_limit`` seconds;
- ``"milp"``: the above as a warm start for the exact MILP under ``time_limit``.

Candidate modes are pruned by the wave (:func:`candidate_modes`): each mode is scored by
``(1-w) * throughput/best_throughput + w * best_latency/latency`` with ``w`` the fraction of
the step's requests already finished, and the ``keep`` best are kept, plus every mode a
node currently runs (so keeping the current layout is always representable). Early in the
wave that favours throughput-oriented modes, in the tail latency-oriented ones.

Invariants (asserted by tests):

- a returned plan satisfies the GPU budget and the KV-balance constraint, and assigns
  every pending request exactly once to a node that is on;
- ``plan.apply`` is True only if the plan's predicted objective is below keeping the
  current layout by at least ``min_gain`` (relative); otherwise ``node_mode`` and
  ``target_node`` describe the current layout unchanged;
- requests on a node that keeps its mode stay there unless the plan's counts require moving
  them; waiting requests move before running ones, shorter contexts before longer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, final

import msgspec
import numpy as np
from numpy.typing import ArrayLike, NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    latency_per_token,
    saturated_token_rate,
)
from flowrl.sched.problem import Evaluation, PlanProblem, build_problem, evaluate, feasible
from flowrl.sched.snapshot import ClusterSnapshot
from flowrl.sched.solver import (
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
    overhead_weight: float | None = None
    min_gain: float = 0.03
    method: Literal["greedy", "lp", "milp"] = "lp"
    time_limit: float = 1.0
    max_evals: int = 60
    gpu_budget: int | None = None
    keep_modes: int = 3

    def __post_init__(self) -> None:
        if self.bs_max < 1 or self.bucket < 1:
            raise ConfigError("PlannerConfig bs_max and bucket must be >= 1")
        if self.kv_tolerance < 0 or not 0 <= self.min_gain < 1:
            raise ConfigError("PlannerConfig needs kv_tolerance >= 0 and 0 <= min_gain < 1")
        if self.time_limit <= 0:
            raise ConfigError(f"PlannerConfig.time_limit must be > 0, got {self.time_limit}")
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
    progress: float,
    current: I64,
    *,
    keep: int,
    mean_ctx: float,
    bs_max: int,
    model: ModelSpec,
    hw: HardwareSpec,
) -> I64:
    """Indices of modes worth considering at this point of the wave (see module docstring)."""
    thr = np.array([saturated_token_rate(m, mean_ctx, bs_max, model, hw) / m.gpus for m in modes])
    lat = np.array([float(latency_per_token(m, mean_ctx, model, hw)) for m in modes])
    w = float(np.clip(progress, 0.0, 1.0))
    score = (1 - w) * thr / thr.max() + w * lat.min() / lat
    best = set(np.argsort(-score, kind="stable")[:keep].tolist())
    best |= {int(m) for m in current if m >= 0}
    return np.array(sorted(best), dtype=np.int64)


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


def plan(
    snap: ClusterSnapshot,
    remaining: ArrayLike,
    config: PlannerConfig,
    *,
    tail: ArrayLike | None = None,
) -> Plan:
    """Decide modes and request placement for ``snap`` (see module docstring).

    ``remaining`` is the expected remaining length of each pending request (snapshot order);
    ``tail``, optional, a conservative one for the latency bound (see
    :meth:`~flowrl.sched.forecast.LengthForecaster.estimates`).
    """
    t0 = time.perf_counter()
    deadline = t0 + config.time_limit
    q = snap.requests
    rem = np.asarray(remaining, dtype=np.float64)
    if rem.shape != (len(q),):
        raise ConfigError(
            f"remaining has {rem.size} entries, snapshot {len(q)} requests; pass one expected "
            "remaining length per pending request, in snapshot order"
        )
    mean_ctx = float(np.mean(q.context + rem / 2)) if len(q) else 1.0
    cand = candidate_modes(
        snap.modes,
        snap.progress,
        snap.node_mode,
        keep=config.keep_modes,
        mean_ctx=mean_ctx,
        bs_max=config.bs_max,
        model=config.model,
        hw=config.hw,
    )
    p = build_problem(
        snap,
        rem,
        tail=None if tail is None else np.asarray(tail, dtype=np.float64),
        cand=cand,
        model=config.model,
        hw=config.hw,
        bs_max=config.bs_max,
        bucket=config.bucket,
        kv_tolerance=config.kv_tolerance,
        beta=config.overhead_weight,
        gpu_budget=config.gpu_budget,
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
        s = solve_relaxed(p, deadline=deadline, max_evals=config.max_evals)
        if s is not None:
            sols.append(s)
            bound = s.bound
    if config.method == "milp" and len(q):
        warm = min(sols, key=lambda s: s.objective) if sols else None
        s = solve_milp(p, time_limit=max(deadline - time.perf_counter(), 0.05), start=warm)
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
    out = Plan(
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
    return out

"""The proactive planner's optimisation problem: built from a snapshot, evaluated exactly.

:func:`build_problem` turns a :class:`ClusterSnapshot` plus a
:class:`~flowrl.sched.forecast.RemainingEstimate` per request into a :class:`PlanProblem`
over *nodes* (the unit a parallel mode is chosen for: a node in mode ``m`` runs
``gpus_per_node // m.gpus`` replicas) and *buckets* (requests grouped by expected remaining
length in ``bucket``-token bins, each represented by the bin's upper edge ``len_b`` —
OrchestrRL's conservative proxy).

Performance model. Decode is memory bound, so one iteration of a replica is, to first order,
linear in its batch ``n`` and its KV tokens ``K``: ``step(n, K) = a_m + beta_m*n + gamma_m*K``
(:func:`~flowrl.sched.costmodel.step_time`, linearised by finite differences). A request
that decodes ``R`` more tokens from context ``c`` therefore adds ``beta*R + gamma*q`` seconds
to every co-runner's completion, ``q = c*R + R^2/2`` being the KV tokens it reads;
``E[q] = c*E[R] + E[R^2]/2`` uses the forecaster's second moment, because the KV work of a
heavy-tailed remainder is far above what its mean length suggests. Coefficients, for mode
``m`` and bucket ``b`` (``q_b`` the bucket's mean ``E[q]``, ``ctx_b`` its mean context):

- ``work[m, b]`` node-seconds one request costs when the node is saturated:
  ``(len_b * step(m, n_sat, 0) / n_sat + gamma_m * q_b) / replicas_m``, ``n_sat`` being the
  KV-limited concurrency at the cluster's mean footprint;
- ``co[m, b]``   what it adds to the completion of a co-running request on the node:
  ``(len_b * beta_m + gamma_m * q_b) / replicas_m``;
- ``lat[m, b]``  seconds the longest request of ``b`` needs alone:
  ``tail_b * step(m, 1, ctx_b + tail_b/2)``, ``tail_b`` the largest tail estimate in the
  bucket (the expected maximum of its requests);
- ``kv[b]``       peak KV footprint in tokens, ``ctx_b + len_b``; ``cap[m]`` a node's KV tokens;
- ``mig[b]``      seconds to move one request's KV (migrate or recompute, the cheaper);
- ``switch[n, m]`` seconds node ``n`` is down if it changes to ``m`` (0 for its current mode).

A *plan* is a mode per node (``-1``: off) and an integer count ``c[n, b]``. Node ``n``
finishes at ``T_n = switch + max(sum_b work*c, max_{b: c>0} lat_b + sum_b co*c)``: the
saturated throughput bound, or the longest request's own decode plus what its co-runners add
to every one of its iterations. :func:`evaluate` scores a plan as
``max_n T_n + w_mig * sum mig * moved + w_sw * sum switch``, where ``moved[n, b]`` counts
requests that leave node ``n`` (a switching node re-lays its own requests out over NVLink
while it is down, which its ``switch`` time covers). OrchestrRL's objective adds makespan,
migration and switching overheads; ``w_mig`` defaults to 1 (migration seconds count in
full) and ``w_sw`` to ``1/nodes`` (a switch's downtime is already in its node's ``T_n``).

Feasibility (:func:`feasible`): every request assigned once, only to nodes that are on;
GPUs in use ``<= gpu_budget`` (default: the snapshot's ``node_gpus`` summed) and no node in a
mode needing more GPUs than its ``node_gpus``; per node ``sum_b kv*c <= (u + eps) * cap[m]``
where ``u`` is the pending requests' KV demand over the capacity of the smallest homogeneous
candidate layout (the KV-balance constraint: every node's share of the demand stays near its
share of the capacity, whichever candidate layout the plan picks; ``u > 1`` means requests
queue).

During the wave's bulk the planner builds the problem without the latency bound
(``lat = co = 0``): it then maximises throughput, and later plans, in latency-oriented modes,
take care of the tail (see :mod:`flowrl.sched.planner`).

Invariants (asserted by tests): ``T_n`` is non-decreasing in every count; every coefficient
is non-negative; keeping the current layout is always representable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    kv_capacity_tokens,
    kv_move_cost,
    saturated_concurrency,
    step_time,
    switch_time,
)
from flowrl.sched.forecast import RemainingEstimate
from flowrl.sched.snapshot import ClusterSnapshot

__all__ = ["Evaluation", "PlanProblem", "build_problem", "evaluate", "feasible"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class PlanProblem:
    """Coefficients of one planning instance (see module docstring). Modes are indices into
    ``modes``; ``cand`` lists the modes the solver may choose."""

    modes: tuple[ParallelMode, ...]
    cand: I64
    current: I64
    node_gpus: I64
    gpu_budget: int
    bucket_len: F64
    count: I64
    holdings: I64
    req_bucket: I64
    req_node: I64
    work: F64
    co: F64
    lat: F64
    kv: F64
    cap: F64
    mode_gpus: I64
    mig: F64
    switch: F64
    kv_limit: float
    mig_weight: float
    switch_weight: float
    allowed: NDArray[np.bool_]

    @property
    def n_nodes(self) -> int:
        return len(self.current)

    @property
    def n_buckets(self) -> int:
        return len(self.bucket_len)


@final
@dataclass(frozen=True, slots=True)
class Evaluation:
    objective: float
    makespan: float
    node_time: F64
    migration_s: float
    switch_s: float
    moved: int


def _linear_step(md: ParallelMode, model: ModelSpec, hw: HardwareSpec) -> tuple[float, float]:
    """``(beta, gamma)``: seconds per iteration one more sequence / one more KV token adds."""
    base = float(step_time(md, 1.0, 0.0, model, hw)[()])
    beta = float(step_time(md, 2.0, 0.0, model, hw)[()]) - base
    probe = 1e5
    gamma = (float(step_time(md, 1.0, probe, model, hw)[()]) - base) / probe
    return max(beta, 0.0), max(gamma, 0.0)


def build_problem(
    snap: ClusterSnapshot,
    est: RemainingEstimate,
    *,
    cand: I64,
    model: ModelSpec,
    hw: HardwareSpec,
    bs_max: int,
    bucket: int,
    kv_tolerance: float,
    mig_weight: float,
    switch_weight: float | None,
    gpu_budget: int | None,
    latency_bound: bool = True,
) -> PlanProblem:
    """Group the snapshot's pending requests into buckets and compute every coefficient.

    ``latency_bound=False`` (the wave's bulk, see :mod:`flowrl.sched.planner`) zeroes
    ``lat`` and ``co``: node times are then the throughput bound alone.
    """
    q = snap.requests
    if len(est) != len(q):
        raise ConfigError(
            f"the remaining-length estimate has {len(est)} entries, the snapshot {len(q)} "
            "pending requests; pass one per pending request, in snapshot order"
        )
    n_nodes = len(snap.node_mode)
    modes = snap.modes
    mean = np.maximum(est.mean, 1.0)
    raw = np.ceil(mean / bucket).astype(np.int64)
    uniq, req_bucket = np.unique(raw, return_inverse=True)
    nb = len(uniq)
    blen = uniq.astype(np.float64) * bucket
    count = np.bincount(req_bucket, minlength=nb).astype(np.int64)
    per_b = np.maximum(count, 1)
    ctx = q.context.astype(np.float64)
    ctx_b = np.bincount(req_bucket, weights=ctx, minlength=nb) / per_b
    reads = ctx * est.mean + np.maximum(est.second, est.mean**2) / 2
    q_b = np.bincount(req_bucket, weights=reads, minlength=nb) / per_b
    tail_b = blen.copy()
    np.maximum.at(tail_b, req_bucket, est.tail)
    req_node = snap.replicas.node[q.replica].astype(np.int64)
    holdings = np.zeros((n_nodes, nb), dtype=np.int64)
    np.add.at(holdings, (req_node, req_bucket), 1)

    m_all = len(modes)
    reps = np.array([max(hw.gpus_per_node // md.gpus, 1) for md in modes], dtype=np.int64)
    mean_foot = float(np.mean(ctx + blen[req_bucket] / 2)) if len(q) else 1.0
    work = np.zeros((m_all, nb))
    co = np.zeros((m_all, nb))
    lat = np.zeros((m_all, nb))
    cap = np.zeros(m_all)
    for j, md in enumerate(modes):
        n_sat = saturated_concurrency(md, mean_foot, bs_max, model, hw)
        b_m, g_m = _linear_step(md, model, hw)
        per_iter = float(step_time(md, n_sat, 0.0, model, hw)[()]) / n_sat
        work[j] = (blen * per_iter + g_m * q_b) / reps[j]
        co[j] = (blen * b_m + g_m * q_b) / reps[j]
        lat[j] = tail_b * step_time(md, 1.0, ctx_b + tail_b / 2, model, hw)
        cap[j] = reps[j] * kv_capacity_tokens(md, model, hw)
    if not latency_bound:
        co[:] = 0.0
        lat[:] = 0.0
    mode_gpus = reps * np.array([md.gpus for md in modes], dtype=np.int64)
    kv = ctx_b + blen
    _, mig = kv_move_cost(ctx_b, modes[int(cand[0])] if len(cand) else modes[0], model, hw)
    sw = np.array([switch_time(md, model, hw) for md in modes])
    switch = np.tile(sw, (n_nodes, 1))
    cur = snap.node_mode.astype(np.int64)
    on = cur >= 0
    switch[np.nonzero(on)[0], cur[on]] = 0.0
    budget = int(snap.node_gpus.sum()) if gpu_budget is None else int(gpu_budget)
    allowed = mode_gpus[None, :] <= snap.node_gpus[:, None]
    demand = float(kv @ count)
    layouts = [float(cap[m] * allowed[:, m].sum()) for m in np.asarray(cand, dtype=np.int64)]
    kv_limit = demand / max(min(layouts, default=1.0), 1.0) + kv_tolerance
    return PlanProblem(
        modes=modes,
        cand=np.asarray(cand, dtype=np.int64),
        current=cur,
        node_gpus=snap.node_gpus.astype(np.int64),
        gpu_budget=budget,
        bucket_len=blen,
        count=count,
        holdings=holdings,
        req_bucket=req_bucket.astype(np.int64),
        req_node=req_node,
        work=work,
        co=co,
        lat=lat,
        kv=kv,
        cap=cap,
        mode_gpus=mode_gpus,
        mig=np.asarray(mig, dtype=np.float64),
        switch=switch,
        kv_limit=kv_limit,
        mig_weight=float(mig_weight),
        switch_weight=(1.0 / max(n_nodes, 1)) if switch_weight is None else float(switch_weight),
        allowed=allowed,
    )


def node_times(p: PlanProblem, mode: I64, c: I64) -> F64:
    """Predicted completion time of every node under ``mode``/``c`` (its switch time if idle)."""
    out = np.zeros(p.n_nodes)
    on = mode >= 0
    if not on.any():
        return out
    idx = np.nonzero(on)[0]
    m = mode[idx]
    ci = c[idx]
    sw = p.switch[idx, m]
    thr = np.einsum("nb,nb->n", p.work[m], ci)
    longest = np.where(ci > 0, p.lat[m], 0.0).max(axis=1, initial=0.0)
    tail = longest + np.einsum("nb,nb->n", p.co[m], ci)
    out[idx] = sw + np.where(ci.sum(axis=1) > 0, np.maximum(thr, tail), 0.0)
    return out


def moved_counts(p: PlanProblem, c: I64) -> I64:
    """Requests per (node, bucket) that must leave their node under counts ``c``."""
    return np.maximum(p.holdings - c, 0)


def evaluate(p: PlanProblem, mode: I64, c: I64) -> Evaluation:
    """Score a plan with the objective in the module docstring (feasibility not checked)."""
    mode = np.asarray(mode, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    t = node_times(p, mode, c)
    if np.any((mode < 0) & (c.sum(axis=1) > 0)):
        t = np.full_like(t, np.inf)
    moved = moved_counts(p, c)
    mig = float((moved * p.mig[None, :]).sum())
    on = mode >= 0
    sw = float(p.switch[np.nonzero(on)[0], mode[on]].sum())
    span = float(t.max(initial=0.0))
    return Evaluation(
        objective=span + p.mig_weight * mig + p.switch_weight * sw,
        makespan=span,
        node_time=t,
        migration_s=mig,
        switch_s=sw,
        moved=int(moved.sum()),
    )


def feasible(p: PlanProblem, mode: I64, c: I64) -> str | None:
    """``None`` when the plan satisfies every constraint, else what it violates."""
    mode = np.asarray(mode, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    if c.shape != (p.n_nodes, p.n_buckets) or np.any(c < 0):
        return "counts must be a non-negative (nodes, buckets) array"
    if not np.array_equal(c.sum(axis=0), p.count):
        return "every request must be assigned exactly once"
    on = mode >= 0
    if np.any(~on & (c.sum(axis=1) > 0)):
        return "requests assigned to a node that is off"
    if np.any(mode >= len(p.modes)):
        return "mode index out of range"
    if np.any(~p.allowed[np.nonzero(on)[0], mode[on]]):
        return "a node runs a mode needing more GPUs than it has"
    gpus = int(p.mode_gpus[mode[on]].sum())
    if gpus > p.gpu_budget:
        return f"uses {gpus} GPUs, budget {p.gpu_budget}"
    load = c @ p.kv
    limit = np.where(on, p.kv_limit * p.cap[np.maximum(mode, 0)], 0.0)
    if np.any(load > limit + 1e-6):
        return "KV-balance constraint violated"
    return None

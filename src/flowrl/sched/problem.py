"""The proactive planner's optimisation problem: built from a snapshot, evaluated exactly.

:func:`build_problem` turns a :class:`ClusterSnapshot` plus a remaining-length estimate per
request into a :class:`PlanProblem` over *nodes* (the unit a parallel mode is chosen for: a
node in mode ``m`` runs ``gpus_per_node // m.gpus`` replicas) and *buckets* (requests grouped
by estimated remaining length in ``bucket``-token bins, each represented by the bin's upper
edge — OrchestrRL's conservative proxy). Coefficients, for mode ``m`` and bucket ``b``:

- ``work[m, b]``  node-seconds one request of ``b`` costs when the node is saturated:
  ``len_b * step(m, b_sat, b_sat * x_b) / b_sat / replicas_m`` with ``x_b = ctx_b + len_b/2``
  and ``b_sat`` the KV-limited concurrency at the cluster's mean footprint;
- ``lat[m, b]``   seconds the longest request of ``b`` needs alone: ``tail_b * step(m, 1, x_b)``,
  where ``tail_b`` is the largest *tail* estimate in the bucket (the expected maximum of its
  requests, see :meth:`LengthForecaster.estimates`; ``len_b`` when no tail is given);
- ``kv[b]``       peak KV footprint in tokens, ``ctx_b + len_b``; ``cap[m]`` a node's KV tokens;
- ``mig[b]``      seconds to move one request's KV (migrate or recompute, the cheaper);
- ``switch[n, m]`` seconds node ``n`` is down if it changes to ``m`` (0 for its current mode).

A *plan* is a mode per node (``-1``: off) and an integer count ``c[n, b]``. Its predicted
node time is ``T_n = max(switch + sum_b work*c, max_{b: c>0} switch + lat)`` (throughput
bound, latency bound) and :func:`evaluate` scores it as
``max_n T_n + beta * (sum mig * moved + sum switch)``, where ``moved[n, b]`` counts requests
that leave node ``n`` or must be re-laid-out because ``n`` switched mode.

Feasibility (:func:`feasible`): every request assigned once, only to nodes that are on;
GPUs in use ``<= gpu_budget`` (default: the snapshot's ``node_gpus`` summed) and no node in a
mode needing more GPUs than its ``node_gpus``; per node ``sum_b kv*c <= (u + eps) * cap[m]``
where ``u`` is the cluster's current KV demand over current capacity (the KV-balance
constraint).
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
    lat: F64
    kv: F64
    cap: F64
    mode_gpus: I64
    mig: F64
    switch: F64
    kv_limit: float
    beta: float
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


def build_problem(
    snap: ClusterSnapshot,
    remaining: NDArray[np.float64],
    *,
    tail: NDArray[np.float64] | None = None,
    cand: I64,
    model: ModelSpec,
    hw: HardwareSpec,
    bs_max: int,
    bucket: int,
    kv_tolerance: float,
    beta: float | None,
    gpu_budget: int | None,
) -> PlanProblem:
    """Group the snapshot's pending requests into buckets and compute every coefficient."""
    q = snap.requests
    if len(remaining) != len(q):
        raise ConfigError(f"remaining has {len(remaining)} entries, snapshot {len(q)} requests")
    n_nodes = len(snap.node_mode)
    modes = snap.modes
    est = np.maximum(np.asarray(remaining, dtype=np.float64), 1.0)
    raw = np.ceil(est / bucket).astype(np.int64)
    uniq, req_bucket = np.unique(raw, return_inverse=True)
    nb = len(uniq)
    blen = uniq.astype(np.float64) * bucket
    count = np.bincount(req_bucket, minlength=nb).astype(np.int64)
    ctx = q.context.astype(np.float64)
    ctx_b = np.bincount(req_bucket, weights=ctx, minlength=nb) / np.maximum(count, 1)
    tail_b = blen.copy()
    if tail is not None:
        if len(tail) != len(q):
            raise ConfigError(f"tail has {len(tail)} entries, snapshot {len(q)} requests")
        np.maximum.at(tail_b, req_bucket, np.asarray(tail, dtype=np.float64))
    req_node = snap.replicas.node[q.replica].astype(np.int64)
    holdings = np.zeros((n_nodes, nb), dtype=np.int64)
    np.add.at(holdings, (req_node, req_bucket), 1)

    m_all = len(modes)
    per_node = hw.gpus_per_node
    reps = np.array([per_node // md.gpus for md in modes], dtype=np.int64)
    mean_foot = float(np.mean(ctx + blen[req_bucket] / 2)) if len(q) else 1.0
    x_b = ctx_b + blen / 2
    work = np.zeros((m_all, nb))
    lat = np.zeros((m_all, nb))
    cap = np.zeros(m_all)
    for j, md in enumerate(modes):
        b_sat = saturated_concurrency(md, mean_foot, bs_max, model, hw)
        per_tok = step_time(md, b_sat, b_sat * x_b, model, hw) / b_sat
        work[j] = blen * per_tok / max(reps[j], 1)
        lat[j] = tail_b * step_time(md, 1.0, ctx_b + tail_b / 2, model, hw)
        cap[j] = reps[j] * kv_capacity_tokens(md, model, hw)
    mode_gpus = reps * np.array([md.gpus for md in modes], dtype=np.int64)
    kv = ctx_b + blen
    _, mig = kv_move_cost(ctx_b, modes[int(cand[0])] if len(cand) else modes[0], model, hw)
    sw = np.array([switch_time(md, model, hw) for md in modes])
    switch = np.tile(sw, (n_nodes, 1))
    cur = snap.node_mode.astype(np.int64)
    on = cur >= 0
    switch[np.nonzero(on)[0], cur[on]] = 0.0
    demand = float(kv @ count)
    cur_cap = float(cap[cur[on]].sum()) if on.any() else float(cap.max() * n_nodes)
    kv_limit = demand / max(cur_cap, 1.0) + kv_tolerance
    budget = int(snap.node_gpus.sum()) if gpu_budget is None else int(gpu_budget)
    allowed = mode_gpus[None, :] <= snap.node_gpus[:, None]
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
        lat=lat,
        kv=kv,
        cap=cap,
        mode_gpus=mode_gpus,
        mig=np.asarray(mig, dtype=np.float64),
        switch=switch,
        kv_limit=kv_limit,
        beta=(1.0 / max(n_nodes, 1)) if beta is None else float(beta),
        allowed=allowed,
    )


def node_times(p: PlanProblem, mode: I64, c: I64) -> F64:
    """Predicted busy time of every node under ``mode``/``c`` (0 for an idle node)."""
    out = np.zeros(p.n_nodes)
    on = mode >= 0
    if not on.any():
        return out
    idx = np.nonzero(on)[0]
    m = mode[idx]
    sw = p.switch[idx, m]
    thr = sw + np.einsum("nb,nb->n", p.work[m], c[idx])
    lat = np.where(c[idx] > 0, p.lat[m] + sw[:, None], 0.0).max(axis=1, initial=0.0)
    out[idx] = np.where(c[idx].sum(axis=1) > 0, np.maximum(thr, lat), sw)
    return out


def moved_counts(p: PlanProblem, mode: I64, c: I64) -> I64:
    keep = np.where((mode == p.current)[:, None], c, 0)
    return np.maximum(p.holdings - keep, 0)


def evaluate(p: PlanProblem, mode: I64, c: I64) -> Evaluation:
    """Score a plan with the objective in the module docstring (feasibility not checked)."""
    mode = np.asarray(mode, dtype=np.int64)
    c = np.asarray(c, dtype=np.int64)
    t = node_times(p, mode, c)
    if np.any((mode < 0) & (c.sum(axis=1) > 0)):
        t = np.full_like(t, np.inf)
    moved = moved_counts(p, mode, c)
    mig = float((moved * p.mig[None, :]).sum())
    on = mode >= 0
    sw = float(p.switch[np.nonzero(on)[0], mode[on]].sum())
    span = float(t.max(initial=0.0))
    return Evaluation(
        objective=span + p.beta * (mig + sw),
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

"""Generated planning instances: the planner's model on clusters the simulator does not build.

:func:`plan_instance` draws a :class:`~flowrl.sched.problem.PlanProblem` with what makes
planning hard: parallel modes that use different GPU counts (besides TP1/2/4/8 on a whole
node, *half-node* modes that run half the replicas on 4 of its 8 GPUs), a GPU budget of
``8k + 4`` that forces one node into a half-node mode, nodes already running modes
(switching costs), and heavy-tailed remaining lengths (KV limits bind on the small modes).

A half-node variant of a mode keeps the mode's per-replica coefficients: per node it does
half the work (``work`` and ``co`` double, being per-node seconds per request), holds half
the KV (``cap`` halves), uses half the GPUs, and has the mode's own latency and switch time
(every change of mode restarts the node).
Everything else comes from :func:`~flowrl.sched.problem.build_problem` on a synthetic
snapshot, so the coefficients are the cost model's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flowrl.sched.costmodel import ParallelMode, switch_time
from flowrl.sched.forecast import RemainingEstimate
from flowrl.sched.problem import PlanProblem, build_problem
from flowrl.sched.snapshot import ClusterSnapshot, ReplicaView, RequestView
from flowrl.sim.cluster import DEFAULT_MODES, ClusterSpec

__all__ = ["plan_instance"]


def _snapshot(
    c: ClusterSpec, current: np.ndarray, n_req: int, rng: np.random.Generator
) -> tuple[ClusterSnapshot, RemainingEstimate]:
    per = c.hw.gpus_per_node
    reps = [per // c.modes[m].gpus for m in current]
    node = np.repeat(np.arange(c.nodes), reps)
    n_rep = len(node)
    rep = rng.integers(0, n_rep, n_req)
    prompt = rng.integers(200, 2000, n_req)
    generated = np.minimum(rng.lognormal(np.log(800), 1.0, n_req), 16000).astype(np.int64)
    remaining = np.minimum(rng.lognormal(np.log(1500), 1.05, n_req), 24000)
    running = rng.random(n_req) < 0.8
    zero = np.zeros(n_rep, dtype=np.int64)
    snap = ClusterSnapshot(
        t=0.0,
        step=0,
        total=n_req,
        finished=0,
        modes=c.modes,
        node_mode=current,
        node_gpus=np.full(c.nodes, per),
        replicas=ReplicaView(
            node=node,
            mode=np.asarray(current)[node],
            running=np.bincount(rep[running], minlength=n_rep),
            waiting=np.bincount(rep[~running], minlength=n_rep),
            kv_used=zero,
            kv_capacity=zero,
            bs_max=np.full(n_rep, c.bs_max),
            token_rate=np.zeros(n_rep),
        ),
        requests=RequestView(
            rid=np.arange(n_req), replica=rep, prompt=prompt, generated=generated, running=running
        ),
    )
    return snap, RemainingEstimate.known(remaining)


def plan_instance(
    seed: int,
    *,
    gpus: int,
    n_modes: int,
    switch_costs: bool,
    latency_bound: bool,
    requests_per_gpu: int = 24,
    bucket: int = 2048,
) -> PlanProblem:
    """One instance on ``gpus`` GPUs with ``n_modes`` candidate modes (2-7) and a budget of
    ``gpus - 4 - 8k`` GPUs (``k`` random), so one node must run a half-node mode.

    ``switch_costs=False`` zeroes every switch time (a layout decided from scratch);
    ``latency_bound`` selects the tail's model (the bulk's has ``lat = co = 0``).
    """
    rng = np.random.default_rng([seed, gpus, n_modes, switch_costs, latency_bound])
    c = ClusterSpec(gpus=gpus, modes=DEFAULT_MODES)
    full = len(c.modes)
    split = [j for j, m in enumerate(c.modes) if c.hw.gpus_per_node // m.gpus >= 2]
    halves = tuple(
        ParallelMode(name=f"{c.modes[j].name}-half", gpus=c.modes[j].gpus, tp=c.modes[j].tp)
        for j in split
    )
    n_modes = int(np.clip(n_modes, 2, full + len(halves)))
    n_half = int(rng.integers(max(1, n_modes - full), min(len(halves), n_modes - 1) + 1))
    cand = np.sort(
        np.concatenate(
            [
                rng.choice(full, n_modes - n_half, replace=False),
                full + rng.choice(len(halves), n_half, replace=False),
            ]
        )
    )
    whole = cand[cand < full]
    current = rng.choice(whole, c.nodes)
    snap, est = _snapshot(c, current, requests_per_gpu * gpus, rng)
    base = build_problem(
        snap,
        est,
        cand=np.arange(full),
        model=c.model,
        hw=c.hw,
        bs_max=c.bs_max,
        bucket=bucket,
        kv_tolerance=0.25,
        mig_weight=1.0,
        switch_weight=None,
        gpu_budget=gpus - 4 - 8 * int(rng.integers(0, max(c.nodes // 4, 1))),
        latency_bound=latency_bound,
    )
    src = np.array(split)
    half_sw = [switch_time(m, c.model, c.hw) for m in halves]
    switch = np.hstack([base.switch, np.tile(half_sw, (c.nodes, 1))])
    if not switch_costs:
        switch[:] = 0.0
    mode_gpus = np.concatenate([base.mode_gpus, base.mode_gpus[src] // 2])
    cap = np.concatenate([base.cap, base.cap[src] / 2])
    demand = float(base.kv @ base.count)
    smallest = min(float(cap[m]) * c.nodes for m in cand)
    return replace(
        base,
        modes=c.modes + halves,
        cand=cand.astype(np.int64),
        work=np.vstack([base.work, 2 * base.work[src]]),
        co=np.vstack([base.co, 2 * base.co[src]]),
        lat=np.vstack([base.lat, base.lat[src]]),
        cap=cap,
        mode_gpus=mode_gpus,
        switch=switch,
        kv_limit=demand / smallest + 0.25,
        allowed=mode_gpus[None, :] <= snap.node_gpus[:, None],
    )

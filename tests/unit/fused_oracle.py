"""Oracles for fused pipeline schedules, written apart from flowrl's scheduler: they read only
the problem's definition (docs/scheduling.md) and a schedule's ops with their times.

- :func:`violations` — an independent validity check: the op set derived here from the
  problem, durations, data dependencies, one op at a time per GPU stage, and the activation
  held over time (a micro-batch holds from its forward's start to its backward's end).
- :func:`milp_optimum` — the exact optimum by a disjunctive MILP solved with HiGHS (order
  binaries per pair of ops on a stage; memory as a linear count over those binaries).
- :func:`brute_force_optimum` — every per-stage order of a tiny instance, timed by a
  recursion of its own.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

Op = tuple[int, int, int, int, str]  # model, pipeline, microbatch, local stage, "F" | "B"


def ops_of(problem: Any) -> dict[Op, tuple[int, float, float]]:
    """Every op of ``problem``: its GPU stage, duration and activation (+ taken by F)."""
    out: dict[Op, tuple[int, float, float]] = {}
    n = problem.gpu_stages
    for k, m in enumerate(problem.models):
        for p in range(n // m.stages):
            for s in range(m.stages):
                gpu = p * m.stages + s
                if m.reverse:
                    gpu = n - 1 - gpu
                for mb in range(m.microbatches):
                    out[(k, p, mb, s, "F")] = (gpu, m.forward_s, m.activation)
                    out[(k, p, mb, s, "B")] = (gpu, m.backward_s, -m.activation)
    return out


def inputs_of(problem: Any, op: Op) -> Op | None:
    """The op whose output ``op`` reads: the previous stage's F, the next stage's B, or on
    the last stage the micro-batch's own F."""
    k, p, mb, s, phase = op
    last = problem.models[k].stages - 1
    if phase == "F":
        return (k, p, mb, s - 1, "F") if s > 0 else None
    return (k, p, mb, s, "F") if s == last else (k, p, mb, s + 1, "B")


def violations(schedule: Any, tol: float = 1e-6) -> list[str]:
    """Everything wrong with ``schedule`` (empty: valid)."""
    problem = schedule.problem
    want = ops_of(problem)
    got: dict[Op, tuple[int, float, float]] = {}
    errors = []
    for gpu, ops in enumerate(schedule.gpus):
        for o in ops:
            key = (o.model, o.pipeline, o.microbatch, o.stage, o.phase)
            if key not in want or want[key][0] != gpu or key in got:
                errors.append(f"{key} unknown, on the wrong GPU stage or repeated")
                continue
            got[key] = (gpu, o.start, o.end)
            if abs(o.end - o.start - want[key][1]) > tol or o.start < -tol:
                errors.append(f"{key} runs {o.start}..{o.end}, its cost is {want[key][1]}")
    if set(want) - set(got):
        errors.append(f"{len(set(want) - set(got))} ops missing")
    for key, (_gpu, start, _end) in got.items():
        src = inputs_of(problem, key)
        if src is not None and src in got and start < got[src][2] - tol:
            errors.append(f"{key} starts at {start} before its input ends at {got[src][2]}")
    by_gpu: dict[int, list[tuple[float, float, Op]]] = {}
    for key, (gpu, start, end) in got.items():
        by_gpu.setdefault(gpu, []).append((start, end, key))
    for gpu, spans in by_gpu.items():
        spans.sort()
        for (_s0, e0, a), (s1, _e1, b) in itertools.pairwise(spans):
            if s1 < e0 - tol:
                errors.append(f"GPU stage {gpu}: {a} and {b} overlap")
        # activation over time: +a at each F's start, -a at each B's end (ends first on ties)
        events = []
        for start, end, key in spans:
            act = want[key][2]
            events.append((start, 1, act) if act > 0 else (end, 0, act))
        level = peak = 0.0
        for _t, _order, act in sorted(events):
            level += act
            peak = max(peak, level)
        if problem.memory_limit is not None and peak > problem.memory_limit + tol:
            errors.append(f"GPU stage {gpu} holds {peak} > memory_limit {problem.memory_limit}")
    if got and abs(max(e for _g, _s, e in got.values()) - schedule.makespan) > tol:
        errors.append(f"makespan {schedule.makespan} is not when the last op ends")
    return errors


def milp_optimum(problem: Any, time_limit: float = 60.0) -> float:
    """The optimal makespan, by HiGHS on a disjunctive model built here from scratch."""
    import highspy

    ops = ops_of(problem)
    keys = list(ops)
    horizon = sum(d for _g, d, _a in ops.values())
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", time_limit)
    start = {k: h.addVariable(lb=0.0, ub=horizon) for k in keys}
    span = h.addVariable(lb=0.0, ub=horizon)
    for k in keys:
        h.addConstr(span - start[k] >= ops[k][1])
        src = inputs_of(problem, k)
        if src is not None:
            h.addConstr(start[k] - start[src] >= ops[src][1])
    before: dict[tuple[Op, Op], Any] = {}  # before[a, b]: 1 when a runs before b
    for a, b in itertools.combinations(keys, 2):
        if ops[a][0] != ops[b][0]:
            continue
        y = h.addVariable(lb=0.0, ub=1.0, type=highspy.HighsVarType.kInteger)
        h.addConstr(start[b] - start[a] + horizon * (1 - y) >= ops[a][1])
        h.addConstr(start[a] - start[b] + horizon * y >= ops[b][1])
        before[(a, b)] = y
        before[(b, a)] = 1 - y
    if problem.memory_limit is not None:
        for f in keys:
            gpu, _d, act = ops[f]
            if act <= 0:
                continue
            held = act + sum(
                ops[o][2] * before[(o, f)] for o in keys if o != f and ops[o][0] == gpu
            )
            h.addConstr(held <= problem.memory_limit)
    h.minimize(span)
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS did not prove optimality: {h.modelStatusToString(status)}")
    return float(h.getInfo().objective_function_value)


def brute_force_optimum(problem: Any) -> float:
    """Every per-stage order (each F before its own B) of a tiny instance: the best makespan
    among those that neither deadlock nor exceed the memory limit."""
    ops = ops_of(problem)
    stages = sorted({g for g, _d, _a in ops.values()})
    per_stage = []
    for g in stages:
        mine = [k for k in ops if ops[k][0] == g]
        orders = []
        for perm in itertools.permutations(mine):
            pos = {k: i for i, k in enumerate(perm)}
            if any(k[4] == "B" and pos[(*k[:4], "F")] > pos[k] for k in perm):
                continue
            level, peak = 0.0, 0.0
            for k in perm:
                level += ops[k][2]
                peak = max(peak, level)
            if problem.memory_limit is None or peak <= problem.memory_limit + 1e-9:
                orders.append(perm)
        per_stage.append(orders)
    best = math.inf
    for combo in itertools.product(*per_stage):
        span = _makespan(problem, ops, combo)
        if span is not None:
            best = min(best, span)
    return best


def _makespan(
    problem: Any, ops: dict[Op, tuple[int, float, float]], orders: tuple[tuple[Op, ...], ...]
) -> float | None:
    """Makespan of per-stage ``orders`` (None: they deadlock), by memoised recursion."""
    prev = {k: (seq[i - 1] if i else None) for seq in orders for i, k in enumerate(seq)}
    end: dict[Op, float] = {}
    visiting: set[Op] = set()

    def finish(k: Op) -> float | None:
        if k in end:
            return end[k]
        if k in visiting:
            return None  # a cycle
        visiting.add(k)
        ready = 0.0
        for dep in (inputs_of(problem, k), prev[k]):
            if dep is not None:
                t = finish(dep)
                if t is None:
                    return None
                ready = max(ready, t)
        end[k] = ready + ops[k][1]
        return end[k]

    spans = [finish(k) for k in ops]
    return None if any(t is None for t in spans) else max(t for t in spans if t is not None)

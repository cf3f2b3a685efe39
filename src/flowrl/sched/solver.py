"""Solvers for :class:`~flowrl.sched.problem.PlanProblem`: greedy, LP + rounding, exact MILP.

- :func:`assign_greedy` — modes fixed; a bisection on the target makespan ``theta`` (a fixed
  number of rounds), each round packing the buckets, longest first, under ``theta``: a node
  may take ``k`` requests of bucket ``b`` only if its throughput bound and its latency bound
  (``max(lat) + sum co*c``) both stay within ``theta`` and its KV limit holds.
  *Latency-critical* buckets (whose lone latency exceeds the balanced throughput time) go to
  the nodes already at that latency level first, then to the least loaded — so the tail is
  concentrated on few nodes that carry little other work; the other buckets are water-filled.
  Milliseconds even at 512 GPUs: the "feasible plan fast" path. The kernel
  (:mod:`flowrl.sched._greedy`) runs many layouts at once.
- :func:`assign_lp` — modes fixed; the greedy fixes which nodes host which latency level,
  then an LP (HiGHS) re-balances the counts with migration cost; largest-remainder rounding
  and a KV repair follow; both assignments are then improved by :func:`refine` and the
  better is returned.
- :func:`refine` — steepest descent over single-request moves (any node to any node) and
  swaps (with the node that finishes last), scored in one numpy pass per round
  (:mod:`flowrl.sched._refine`; :func:`~flowrl.sched._refine.refine_many` descends many
  assignments in lockstep).
- :func:`solve_relaxed` — the LP relaxation of the full MILP picks a mode *mix* (fractional
  node counts per mode, rounded by largest remainder), plus the current and every
  homogeneous layout as starts, each brought within the GPU budget by :func:`fit_budget`
  (nodes step down to modes on fewer GPUs — a half node — before any goes off). A descent
  over layouts follows: every layout one or two node changes away (any node to any
  candidate mode or off, nodes represented per class of current and present mode) and
  every group move (one, half or all of a mode's nodes) is ranked by a fluid estimate of
  its objective (:func:`flowrl.sched._mix_score.fluid_scores`, vectorised over thousands
  of layouts); the ``probe`` best get :func:`assign_roles` (which node takes which mode:
  an assignment problem over switches and migration) and the greedy assignment, scored
  by its makespan, switches and the migration the layout needs at the least; the search
  moves to the best while it improves (at most ``max_evals`` greedy assignments). Two
  changes at once is what crossing the GPU budget needs: a half node traded for a node
  off, a slow mode taken off for a fast one kept. The best ``finalists`` layouts get
  three assignments each (the greedy's, an LP polish, keep what you hold), all refined
  together, and the best plan wins.
- :func:`solve_milp` — the full MILP (binary modes and bucket-presence indicators, integer
  counts) with HiGHS branch-and-cut, optionally warm-started, under a time limit. The
  planner's ``method="milp"`` warm-starts it from the fast plan; tests compare the fast plan
  with :func:`flowrl.sched.oracle.solve_exact` instead, written and solved independently.

Quality (``tests/unit/test_sched_planner_exact.py``, ``benchmarks/sched_sim.py``):
:func:`solve_relaxed` is a heuristic with no proven bound; measured within 1.03x of the
exact optimum on generated half-node instances of 8-128 GPUs and on the simulator's tail
snapshots.

Speed: on a planner's clusters (tens of nodes) numpy's per-call overhead, not arithmetic,
sets the pace, so the search gives the greedy its ``probe`` layouts in one batch and the
finalists' assignments descend together; every row's result is what it would be alone.

Every budget but :func:`solve_milp`'s is counted (bisection rounds, evaluated mixes, simplex
iterations), never timed, so a plan depends only on its inputs.

Invariant (asserted by tests): every plan these return is ``feasible`` for the problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import final

import numpy as np
from numpy.typing import NDArray
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from flowrl.sched import _highs
from flowrl.sched._greedy import assign_greedy_many, water_fill
from flowrl.sched._mix_score import fluid_scores
from flowrl.sched._refine import refine, refine_many
from flowrl.sched.problem import PlanProblem, evaluate, feasible, moved_counts, node_times

__all__ = [
    "Solution",
    "assign_greedy",
    "assign_lp",
    "assign_roles",
    "fit_budget",
    "refine",
    "solve_milp",
    "solve_relaxed",
]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
MAX_EVALS = 60  # mixes the search gives the greedy assignment (PlannerConfig.max_evals)


@final
@dataclass(frozen=True, slots=True)
class Solution:
    mode: I64
    counts: I64
    objective: float
    method: str
    bound: float = float("nan")


def assign_greedy(p: PlanProblem, mode: I64) -> I64 | None:
    """Counts for fixed ``mode`` (:func:`flowrl.sched._greedy.assign_greedy_many`)."""
    return assign_greedy_many(p, np.asarray(mode, dtype=np.int64)[None, :])[0]


def _round_counts(p: PlanProblem, mode: I64, frac: F64, elig: NDArray[np.bool_]) -> I64 | None:
    c = np.floor(frac + 1e-9).astype(np.int64)
    rem = frac - c
    for b in range(p.n_buckets):
        short = int(p.count[b] - c[:, b].sum())
        if short > 0:
            r = np.where(elig[:, b], rem[:, b], -1.0)
            c[np.argsort(-r, kind="stable")[:short], b] += 1
    return _repair_kv(p, mode, c, elig)


def _repair_kv(p: PlanProblem, mode: I64, c: I64, elig: NDArray[np.bool_]) -> I64 | None:
    on = mode >= 0
    limit = np.where(on, p.kv_limit * p.cap[np.maximum(mode, 0)], 0.0)
    for _ in range(4 * p.n_nodes * p.n_buckets):
        load = c @ p.kv
        over = np.nonzero(load > limit + 1e-6)[0]
        if not len(over):
            return c
        n = over[0]
        bs = np.nonzero(c[n] > 0)[0]
        b = bs[np.argmin(p.kv[bs])]
        slack = limit - load
        dest = np.nonzero(elig[:, b] & (slack >= p.kv[b]) & (np.arange(p.n_nodes) != n))[0]
        if not len(dest):
            return None
        d = dest[np.argmax(slack[dest])]
        k = int(min(c[n, b], np.ceil((load[n] - limit[n]) / p.kv[b]), slack[d] // p.kv[b]))
        c[n, b] -= max(k, 1)
        c[d, b] += max(k, 1)
    return None


def _polish(p: PlanProblem, mode: I64, start: I64) -> I64 | None:
    """LP over counts, each node limited to the latency level ``start`` gives it."""
    n, nb = p.n_nodes, p.n_buckets
    on = mode >= 0
    mm = np.maximum(mode, 0)
    sw = np.where(on, p.switch[np.arange(n), mm], 0.0)
    lat = p.lat[mm]
    level = np.where(start > 0, lat, 0.0).max(axis=1)
    elig = on[:, None] & (lat <= level[:, None] + 1e-9)
    pairs = np.argwhere(elig)  # (k, 2): node, bucket
    k = len(pairs)
    node, bkt = pairs[:, 0], pairs[:, 1]
    hosts = np.nonzero(level > 0)[0]
    held = np.flatnonzero(p.holdings.ravel() > 0)  # only these can have requests leave
    nh = len(held)
    t_col = k + nh
    nv = t_col + 1
    r_tot, r_thr, r_lat = 0, nb, nb + n
    r_kv = r_lat + len(hosts)
    r_mv = r_kv + n
    n_rows = r_mv + nh
    host_row = np.full(n, -1)
    host_row[hosts] = r_lat + np.arange(len(hosts))
    lat_pairs = host_row[node] >= 0
    held_row = np.full(n * nb, -1)
    held_row[held] = np.arange(nh)
    stays = held_row[node * nb + bkt]
    kept = stays >= 0
    rows = np.concatenate(
        [
            r_tot + bkt,
            r_thr + node,
            r_thr + np.arange(n),
            host_row[node][lat_pairs],
            host_row[hosts],
            r_kv + node,
            r_mv + stays[kept],
            r_mv + np.arange(nh),
        ]
    )
    cols = np.concatenate(
        [
            np.arange(k),
            np.arange(k),
            np.full(n, t_col),
            np.arange(k)[lat_pairs],
            np.full(len(hosts), t_col),
            np.arange(k),
            np.arange(k)[kept],
            k + np.arange(nh),
        ]
    )
    vals = np.concatenate(
        [
            np.ones(k),
            p.work[mm[node], bkt],
            -np.ones(n),
            p.co[mm[node], bkt][lat_pairs],
            -np.ones(len(hosts)),
            p.kv[bkt],
            -np.ones(int(kept.sum())),
            -np.ones(nh),
        ]
    )
    lo = np.concatenate([p.count.astype(float), np.full(n + len(hosts) + n + nh, -np.inf)])
    hi = np.concatenate(
        [
            p.count.astype(float),
            -sw,
            -(sw + level)[hosts],
            np.where(on, p.kv_limit * p.cap[mm], 0.0),
            -p.holdings.ravel()[held].astype(float),
        ]
    )
    a = sparse.csr_matrix((vals, (rows, cols)), shape=(n_rows, nv))
    cost = np.zeros(nv)
    cost[k:t_col] = p.mig_weight * np.tile(p.mig, n)[held]
    cost[t_col] = 1.0
    res = _highs.solve(cost, a, lo, hi, np.zeros(nv), np.full(nv, np.inf))
    if not res.ok:
        return None
    frac = np.zeros((n, nb))
    frac[node, bkt] = np.maximum(res.x[:k], 0.0)
    return _round_counts(p, mode, frac, elig)


def assign_lp(p: PlanProblem, mode: I64) -> I64 | None:
    """Counts for fixed ``mode``: the greedy's latency levels, counts re-balanced by an LP,
    then single-request moves off the bottleneck (:func:`refine`)."""
    mode = np.asarray(mode, dtype=np.int64)
    start = assign_greedy(p, mode)
    if start is None:
        return None
    start = refine(p, mode, start)
    c = _polish(p, mode, start)
    c = None if c is None else refine(p, mode, c)
    if c is None or evaluate(p, mode, c).objective >= evaluate(p, mode, start).objective:
        return start
    return c


def _row_times(p: PlanProblem, node: I64, m: I64, rows: F64) -> F64:
    """Node time (problem docstring) of ``rows[..., b]`` counts on ``node`` in mode ``m``."""
    thr = (rows * p.work[m]).sum(axis=-1)
    tail = np.where(rows > 0, p.lat[m], 0.0).max(axis=-1) + (rows * p.co[m]).sum(axis=-1)
    return p.switch[node, m] + np.where(rows.sum(axis=-1) > 0, np.maximum(thr, tail), 0.0)


def _keep_start(p: PlanProblem, mode: I64) -> I64 | None:
    """Counts that move only what must move: nodes that stay on keep what they hold; the
    requests of nodes going off are water-filled onto the others, longest bucket first; a
    KV repair follows where a node's new mode holds less."""
    on = mode >= 0
    if not on.any():
        return None
    idx = np.nonzero(on)[0]
    m = mode[idx]
    c = np.where(on[:, None], p.holdings, 0)
    for b in np.argsort(-p.bucket_len, kind="stable"):
        n_req = int(p.holdings[~on, b].sum())
        if not n_req:
            continue
        load = _row_times(p, idx, m, c[idx].astype(np.float64))
        room = (p.kv_limit * p.cap[m] - c[idx] @ p.kv) // p.kv[b]
        got, ok = water_fill(
            n_req, load[None], np.maximum(p.work[m, b], 1e-9)[None], np.maximum(room, 0)[None]
        )
        if not ok[0]:
            return None
        c[idx, b] += got[0]
    return _repair_kv(p, mode, c, np.repeat(on[:, None], p.n_buckets, axis=1))


# -- the full model ---------------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class _Layout:
    n: int
    mc: int
    nb: int
    nh: int  # (node, bucket) pairs holding requests: one "moved" variable each

    def x(self, i: int, j: int) -> int:
        return i * self.mc + j

    @property
    def c0(self) -> int:
        return self.n * self.mc

    @property
    def z0(self) -> int:
        return self.c0 + self.n * self.mc * self.nb

    @property
    def mv0(self) -> int:
        return self.z0 + self.n * self.mc * self.nb

    @property
    def u0(self) -> int:
        return self.mv0 + self.nh

    @property
    def t(self) -> int:
        return self.u0 + self.n

    @property
    def size(self) -> int:
        return self.t + 1


def _full_model(p: PlanProblem, relaxed: bool = False):
    """The MILP's arrays. ``relaxed``: its LP relaxation without the presence variables
    ``z``: a fractional ``z`` is best at ``c / N_b`` (it only weighs on the latency rows), so
    ``c <= N_b x`` and latency rows on ``c / N_b`` give the same optimum with a third fewer
    rows and columns (the ``z`` columns stay, fixed at 0, so the layout is shared)."""
    n, nb = p.n_nodes, p.n_buckets
    cand = p.cand
    mc = len(cand)
    held = np.flatnonzero(p.holdings.ravel() > 0)
    lay = _Layout(n, mc, nb, len(held))
    nmb = n * mc * nb
    idx_nm = np.arange(n * mc)
    node_of_nm = idx_nm // mc
    mode_of_nm = cand[idx_nm % mc]
    idx = np.arange(nmb)
    nm_of = idx // nb
    b_of = idx % nb
    node_of = nm_of // mc
    mode_of = cand[nm_of % mc]
    rows: list[NDArray] = []
    cols: list[NDArray] = []
    vals: list[NDArray] = []
    lo: list[NDArray] = []
    hi: list[NDArray] = []
    r = 0

    def add(rr: NDArray, cc: NDArray, vv: NDArray) -> None:
        rows.append(np.asarray(rr))
        cols.append(np.asarray(cc))
        vals.append(np.asarray(vv, dtype=np.float64))

    # R1 one mode per node
    add(r + node_of_nm, idx_nm, np.ones(n * mc))
    lo.append(np.full(n, -np.inf))
    hi.append(np.ones(n))
    r += n
    # R2 GPU budget
    add(np.full(n * mc, r), idx_nm, p.mode_gpus[mode_of_nm])
    lo.append(np.array([-np.inf]))
    hi.append(np.array([float(p.gpu_budget)]))
    r += 1
    # R3 bucket totals
    add(r + b_of, lay.c0 + idx, np.ones(nmb))
    lo.append(p.count.astype(float))
    hi.append(p.count.astype(float))
    r += nb
    # R4 c - N_b z <= 0, R5 z - x <= 0 (relaxed: c - N_b x <= 0)
    add(r + idx, lay.c0 + idx, np.ones(nmb))
    add(r + idx, nm_of if relaxed else lay.z0 + idx, -p.count[b_of].astype(float))
    lo.append(np.full(nmb, -np.inf))
    hi.append(np.zeros(nmb))
    r += nmb
    if not relaxed:
        add(r + idx, lay.z0 + idx, np.ones(nmb))
        add(r + idx, nm_of, -np.ones(nmb))
        lo.append(np.full(nmb, -np.inf))
        hi.append(np.zeros(nmb))
        r += nmb
    # R6 throughput per node
    add(r + node_of_nm, idx_nm, p.switch[node_of_nm, mode_of_nm])
    add(r + node_of, lay.c0 + idx, p.work[mode_of, b_of])
    add(r + np.arange(n), np.full(n, lay.t), -np.ones(n))
    lo.append(np.full(n, -np.inf))
    hi.append(np.zeros(n))
    r += n
    # R7 u_n = what co-runners add on node n
    add(r + node_of, lay.c0 + idx, p.co[mode_of, b_of])
    add(r + np.arange(n), lay.u0 + np.arange(n), -np.ones(n))
    lo.append(np.zeros(n))
    hi.append(np.zeros(n))
    r += n
    # R8 latency: (switch + lat) z + u_n <= T (relaxed: z = c / N_b)
    presence = p.lat[mode_of, b_of] + p.switch[node_of, mode_of]
    if relaxed:
        add(r + idx, lay.c0 + idx, presence / p.count[b_of])
    else:
        add(r + idx, lay.z0 + idx, presence)
    add(r + idx, lay.u0 + node_of, np.ones(nmb))
    add(r + idx, np.full(nmb, lay.t), -np.ones(nmb))
    lo.append(np.full(nmb, -np.inf))
    hi.append(np.zeros(nmb))
    r += nmb
    # R9 KV balance
    add(r + nm_of, lay.c0 + idx, p.kv[b_of])
    add(r + idx_nm, idx_nm, -p.kv_limit * p.cap[mode_of_nm])
    lo.append(np.full(n * mc, -np.inf))
    hi.append(np.zeros(n * mc))
    r += n * mc
    # R10 moved >= holdings - what stays on the node (pairs that hold requests only)
    nh = lay.nh
    held_row = np.full(n * nb, -1)
    held_row[held] = np.arange(nh)
    stay = held_row[node_of * nb + b_of]
    add(r + np.arange(nh), lay.mv0 + np.arange(nh), -np.ones(nh))
    add(r + stay[stay >= 0], lay.c0 + idx[stay >= 0], -np.ones(int((stay >= 0).sum())))
    lo.append(np.full(nh, -np.inf))
    hi.append(-p.holdings.ravel()[held].astype(float))
    r += nh
    a = sparse.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(r, lay.size),
    )
    cost = np.zeros(lay.size)
    cost[: lay.c0] = p.switch_weight * p.switch[node_of_nm, mode_of_nm]
    cost[lay.mv0 : lay.u0] = p.mig_weight * np.tile(p.mig, n)[held]
    cost[lay.t] = 1.0
    col_hi = np.full(lay.size, np.inf)
    col_hi[: lay.c0] = p.allowed[node_of_nm, mode_of_nm].astype(float)
    col_hi[lay.c0 : lay.z0] = p.count[b_of]
    col_hi[lay.z0 : lay.mv0] = 0.0 if relaxed else 1.0
    integer = np.zeros(lay.size, dtype=bool)
    integer[: lay.mv0] = True
    return lay, cost, a, np.concatenate(lo), np.concatenate(hi), np.zeros(lay.size), col_hi, integer


def _encode(p: PlanProblem, lay: _Layout, sol: Solution) -> F64 | None:
    pos = {int(m): j for j, m in enumerate(p.cand)}
    v = np.zeros(lay.size)
    mm = np.maximum(sol.mode, 0)
    for i in range(p.n_nodes):
        m = int(sol.mode[i])
        if m < 0:
            continue
        if m not in pos:
            return None
        j = pos[m]
        v[lay.x(i, j)] = 1.0
        base = (i * lay.mc + j) * lay.nb
        v[lay.c0 + base : lay.c0 + base + lay.nb] = sol.counts[i]
        v[lay.z0 + base : lay.z0 + base + lay.nb] = sol.counts[i] > 0
    v[lay.mv0 : lay.u0] = moved_counts(p, sol.counts).ravel()[p.holdings.ravel() > 0]
    v[lay.u0 : lay.t] = np.where(sol.mode >= 0, (p.co[mm] * sol.counts).sum(axis=1), 0.0)
    v[lay.t] = node_times(p, sol.mode, sol.counts).max(initial=0.0)
    return v


def _decode(p: PlanProblem, lay: _Layout, x: F64) -> tuple[I64, I64]:
    xs = x[: lay.c0].reshape(p.n_nodes, lay.mc)
    mode = np.where(xs.max(axis=1) > 0.5, p.cand[np.argmax(xs, axis=1)], -1)
    cs = np.rint(x[lay.c0 : lay.z0]).reshape(p.n_nodes, lay.mc, lay.nb)
    counts = cs.sum(axis=1).astype(np.int64)
    return mode.astype(np.int64), counts


def solve_milp(
    p: PlanProblem, *, time_limit: float | None, start: Solution | None = None
) -> Solution | None:
    """Exact MILP (HiGHS); ``bound`` is the solver's proven lower bound on the objective.

    The one timed budget in the planner: with ``time_limit`` the result may depend on
    machine speed (the benchmark's optimality check and ``PlannerConfig(method="milp")``).
    """
    lay, cost, a, lo, hi, clo, chi, integer = _full_model(p)
    warm = _encode(p, lay, start) if start is not None else None
    res = _highs.solve(
        cost, a, lo, hi, clo, chi, integer=integer, time_limit=time_limit, start=warm
    )
    if not res.ok:
        return None
    mode, counts = _decode(p, lay, res.x)
    if feasible(p, mode, counts) is not None:
        return None
    return Solution(mode, counts, evaluate(p, mode, counts).objective, "milp", res.bound)


def _round_mix(p: PlanProblem, xs: F64) -> I64:
    """Largest-remainder rounding of per-mode node counts; nodes get modes they prefer."""
    n, mc = xs.shape
    mass = np.append(xs.sum(axis=0), 0.0)  # idle nodes help nobody unless the budget binds
    mass *= n / max(mass.sum(), 1e-12)
    k = np.floor(mass + 1e-9).astype(np.int64)
    short = n - int(k.sum())
    k[np.argsort(-(mass - k), kind="stable")[:short]] += 1
    pref = np.hstack([np.where(p.allowed[:, p.cand], xs, -np.inf), np.zeros((n, 1))])
    cur = p.current
    for j, m in enumerate(p.cand):
        pref[cur == m, j] += 0.5  # staying put avoids a switch
    mode = np.full(n, -2, dtype=np.int64)
    order = np.dstack(np.unravel_index(np.argsort(-pref, axis=None), pref.shape))[0]
    for i, j in order:
        if mode[i] == -2 and k[j] > 0 and np.isfinite(pref[i, j]):
            mode[i] = p.cand[j] if j < mc else -1
            k[j] -= 1
    mode[mode == -2] = -1
    return fit_budget(p, mode)


def fit_budget(p: PlanProblem, mode: I64, fixed: NDArray[np.bool_] | None = None) -> I64:
    """Bring a layout within the GPU budget, stepping nodes down rather than off.

    Of the nodes that have a candidate mode on fewer GPUs (never one in ``fixed``), the one
    holding fewest requests moves to such a mode: the largest that closes the excess (the
    fastest of equal size), else the smallest. Only when no node can step down does one
    (the least loaded) go off. A budget of ``8k + 4`` on 8-GPU
    nodes thus gets a half-node mode, not a node fewer.
    """
    mode = mode.copy()
    mode[(mode >= 0) & ~p.allowed[np.arange(p.n_nodes), np.maximum(mode, 0)]] = -1
    load = p.holdings.sum(axis=1)
    movable = np.ones(p.n_nodes, dtype=bool) if fixed is None else ~fixed
    speed = -(p.work[p.cand] @ p.count)  # higher is faster; ties between equal GPU counts
    while (excess := int(p.mode_gpus[mode[mode >= 0]].sum()) - p.gpu_budget) > 0:
        on = np.nonzero((mode >= 0) & movable)[0]
        if not len(on):
            return fit_budget(p, mode) if fixed is not None else mode
        g_on = p.mode_gpus[mode[on]]
        down = (p.allowed[on][:, p.cand] & (p.mode_gpus[p.cand] < g_on[:, None])).any(axis=1)
        if not down.any():
            mode[on[np.argmin(load[on])]] = -1
            continue
        i = on[down][np.argmin(load[on[down]])]
        g = p.mode_gpus[mode[i]]
        ok = p.allowed[i, p.cand] & (p.mode_gpus[p.cand] < g)
        saved = g - p.mode_gpus[p.cand]
        closes = ok & (saved >= excess)
        pool = closes if closes.any() else ok
        key = np.where(pool, -saved if closes.any() else saved, -np.inf)
        best = np.flatnonzero(key == key.max())
        mode[i] = p.cand[best[np.argmax(speed[best])]]
    return mode


def _fair_share(p: PlanProblem, mode: I64) -> F64:
    """Requests each node would hold if all ran at their mode's throughput to the same end."""
    mm = np.maximum(mode, 0)
    speed = np.where(mode >= 0, 1.0 / np.maximum(p.work[mm] @ p.count, 1e-12), 0.0)
    return p.count.sum() * speed / max(speed.sum(), 1e-12)


def _excess_cost(p: PlanProblem, share: F64) -> F64:
    """``[node, slot]``: seconds to move what a node holds beyond a slot's ``share``, at the
    mean cost of moving one of that node's requests."""
    held = p.holdings.sum(axis=1)
    per = (p.holdings @ p.mig) / np.maximum(held, 1)
    return p.mig_weight * per[:, None] * np.maximum(held[:, None] - share[None, :], 0.0)


def _migration_floor(p: PlanProblem, mode: I64) -> float:
    """Migration a layout needs at the least: what each node holds beyond its fair share
    (an off node's share is zero)."""
    return float(np.diagonal(_excess_cost(p, _fair_share(p, mode))).sum())


def assign_roles(p: PlanProblem, mode: I64) -> I64:
    """The same mode mix, given to the nodes it suits (an assignment problem).

    A node pays for a mode its switch (downtime on its own clock and the objective's switch
    term) and the migration of what it holds beyond the mode's fair share of the requests
    (the share of its throughput in the mix). Keeping current modes and giving the slower
    modes to the nodes holding least is what this buys; the mix, and so the GPU count, is
    unchanged.
    """
    on = mode >= 0
    if not on.any():
        return mode
    slots = np.sort(mode)
    mm = np.maximum(slots, 0)
    share = _fair_share(p, slots)
    sw = np.where(slots >= 0, p.switch[:, mm], 0.0)
    cost = sw * (p.switch_weight + 1.0 / int(on.sum())) + _excess_cost(p, share)
    cost = np.where((slots < 0) | p.allowed[:, mm], cost, 1e18)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty_like(mode)
    out[rows] = slots[cols]
    return out


def _neighbours(p: PlanProblem, mode: I64) -> list[I64]:
    """Mixes reached by moving 1, half or all of one mode's nodes (or of the off nodes) to
    another mode, stepping other nodes down (:func:`fit_budget`) where that breaks the
    budget, or by switching one node off.

    Makespan is a max over nodes, so single-node moves often sit on a plateau; moving a
    group at once crosses it. Nodes already in the target mode, then those holding fewest
    requests, are moved first (fewest switches and re-layouts).
    """
    out = []
    for m_from in np.unique(mode):
        nodes = np.nonzero(mode == m_from)[0]
        for m_to in (*p.cand, -1):
            if m_to == m_from:
                continue
            ok = nodes[p.allowed[nodes, m_to]] if m_to >= 0 else nodes
            if not len(ok):
                continue
            key = np.lexsort((p.holdings[ok].sum(axis=1), p.current[ok] != m_to))
            ranked = ok[key]
            sizes = {1, (len(ranked) + 1) // 2, len(ranked)} if m_to >= 0 else {1}
            for k in sorted(sizes):
                nb = mode.copy()
                nb[ranked[:k]] = m_to
                if int(p.mode_gpus[nb[nb >= 0]].sum()) > p.gpu_budget:
                    fixed = np.zeros(p.n_nodes, dtype=bool)
                    fixed[ranked[:k]] = True
                    nb = fit_budget(p, nb, fixed)
                if not np.array_equal(nb, mode):
                    out.append(nb)
    return out


def _coarsen(p: PlanProblem, groups: int) -> PlanProblem:
    """The problem with its buckets merged into at most ``groups`` runs of equal count.

    Counts, holdings and KV add up; per-request coefficients are count-weighted means and
    the latency of a run is its longest bucket's. Only the relaxation's mode mix reads it.
    """
    if p.n_buckets <= groups:
        return p
    order = np.argsort(p.bucket_len, kind="stable")
    share = np.cumsum(p.count[order]) / max(int(p.count.sum()), 1)
    run = np.minimum((share * groups - 1e-9).astype(np.int64), groups - 1)
    gid = np.empty(p.n_buckets, dtype=np.int64)
    gid[order] = np.unique(run, return_inverse=True)[1]
    k = int(gid.max()) + 1
    w = np.maximum(p.count, 1).astype(np.float64)
    tot = np.bincount(gid, weights=w, minlength=k)

    def mean(coef: F64) -> F64:  # count-weighted mean over each run, per leading axis
        return np.stack([np.bincount(gid, weights=row * w, minlength=k) for row in coef]) / tot

    lat = np.zeros((len(p.modes), k))
    np.maximum.at(lat.T, gid, p.lat.T)
    hold = np.zeros((p.n_nodes, k), dtype=np.int64)
    np.add.at(hold.T, gid, p.holdings.T)
    return replace(
        p,
        bucket_len=np.bincount(gid, weights=p.bucket_len * w, minlength=k) / tot,
        count=np.bincount(gid, weights=p.count, minlength=k).astype(np.int64),
        holdings=hold,
        req_bucket=gid[p.req_bucket],
        work=mean(p.work),
        co=mean(p.co),
        lat=lat,
        kv=mean(p.kv[None, :])[0],
        mig=mean(p.mig[None, :])[0],
    )


def _moves(p: PlanProblem, mode: I64) -> I64:
    """Layouts one or two node changes away from ``mode`` (rows), budget not yet checked.

    Nodes are represented per class (same current mode, same mode): the two holding fewest
    requests, so a layout over many identical nodes has few neighbours. One change: a node
    to any candidate mode or off. Two: any two such changes together (one steps down or
    off, the other takes the GPUs it freed: a half node traded for an off one, a slow mode
    for a fast one), and every group move of :func:`_neighbours`.
    """
    held = p.holdings.sum(axis=1)
    reps: list[int] = []
    for cls in np.unique(np.stack([p.current, mode], axis=1), axis=0):
        members = np.nonzero((p.current == cls[0]) & (mode == cls[1]))[0]
        reps += members[np.argsort(held[members], kind="stable")[:2]].tolist()
    targets = [*p.cand.tolist(), -1]
    single = [(i, m) for i in reps for m in targets if m != mode[i]]
    node, to = np.array([(i, m) for i, m in single if m < 0 or p.allowed[i, m]]).reshape(-1, 2).T
    a, b = np.triu_indices(len(node), k=1)
    a, b = a[node[a] != node[b]], b[node[a] != node[b]]
    # one change each, then every pair of changes on two different nodes
    rows = np.repeat(mode[None, :], len(node) + len(a), axis=0)
    rows[np.arange(len(node)), node] = to
    pairs = np.arange(len(node), len(rows))
    rows[pairs, node[a]] = to[a]
    rows[pairs, node[b]] = to[b]
    groups = _neighbours(p, mode)
    return np.concatenate([rows, np.array(groups, dtype=np.int64).reshape(-1, p.n_nodes)])


def _search_mixes(
    p: PlanProblem, starts: list[I64], *, max_evals: int, probe: int
) -> list[tuple[float, I64, I64]]:
    """Descent over mode layouts: every layout one or two node changes away
    (:func:`_moves`) is ranked by the fluid estimate (:func:`fluid_scores`), the ``probe``
    best not yet seen get the greedy assignment, and the search moves to the best of them
    while that improves; at most ``max_evals`` greedy assignments (starts included).

    A layout's score is the greedy's makespan, its switches and the migration it needs at
    the least (not what the greedy moves: the finalists' assignment handles that).
    """
    tried: list[tuple[float, I64, I64]] = []
    seen: set[bytes] = set()

    def score(layouts: Iterable[I64], want: int) -> list[tuple[float, I64, I64]]:
        """Give the greedy the first ``want`` of ``layouts`` it can assign that were not
        seen (after role assignment), in batches of what is still wanted: the same
        layouts, scored the same, as one at a time."""
        todo = iter(layouts)
        got: list[tuple[float, I64, I64]] = []
        while len(got) < want and len(seen) < max_evals:
            batch: list[I64] = []
            for md in todo:
                md = assign_roles(p, md)
                if (key := md.tobytes()) in seen:
                    continue
                seen.add(key)
                batch.append(md)
                if len(batch) >= want - len(got) or len(seen) >= max_evals:
                    break
            if not batch:
                break
            for md, c in zip(batch, assign_greedy_many(p, np.array(batch)), strict=True):
                if c is not None:
                    ev = evaluate(p, md, c)
                    floor = _migration_floor(p, md)
                    got.append((ev.makespan + p.switch_weight * ev.switch_s + floor, md, c))
        tried.extend(got)
        return got

    # the starts are ranked by the fluid estimate too: only the best few get the greedy
    ranked = np.argsort(fluid_scores(p, np.array(starts)), kind="stable")[: max(probe, 1)]
    score((starts[int(k)] for k in ranked), len(ranked))
    while tried and len(seen) < max_evals:
        best = min(tried, key=lambda e: e[0])
        cand = _moves(p, best[1])
        if not len(cand):
            break
        fl = fluid_scores(p, cand)
        order = np.argsort(fl, kind="stable")
        got = score((cand[int(k)] for k in order if np.isfinite(fl[k])), probe)
        if not got or min(e[0] for e in got) >= best[0] - 1e-9:
            break
    tried.sort(key=lambda e: e[0])
    return tried


def solve_relaxed(
    p: PlanProblem,
    *,
    max_evals: int = MAX_EVALS,
    lp_iterations: int = 20000,
    lp_buckets: int = 32,
    polish: bool = True,
    finalists: int = 3,
    probe: int = 4,
) -> Solution | None:
    """LP relaxation -> mode-mix rounding -> greedy local search -> LP polish (see module).

    The relaxation runs on the problem with its buckets merged into ``lp_buckets`` runs
    (:func:`_coarsen`: it only has to pick a mode mix) under ``lp_iterations`` simplex
    iterations; when that binds, the search starts from the current and homogeneous layouts.
    """
    lay, cost, a, lo, hi, clo, chi, _ = _full_model(_coarsen(p, lp_buckets), relaxed=True)
    res = _highs.solve(cost, a, lo, hi, clo, chi, iteration_limit=lp_iterations)
    starts = [fit_budget(p, p.current)]
    if res.ok:
        starts.insert(0, _round_mix(p, res.x[: lay.c0].reshape(p.n_nodes, lay.mc)))
    for m in p.cand:  # homogeneous layouts: cheap, and often where the optimum sits
        starts.append(fit_budget(p, np.where(p.allowed[:, m], m, -1).astype(np.int64)))
    tried = _search_mixes(p, starts, max_evals=max_evals, probe=probe)
    # the best few mixes get three assignments each (the greedy's, the LP polish, keep what
    # you hold), each improved by single moves (all descend together)
    found: list[tuple[I64, I64, str]] = []
    for _, mode, c in tried[: finalists if polish else 1]:
        found.append((mode, c, "greedy"))
        if polish:
            found += [
                (mode, x, how)
                for x, how in ((_polish(p, mode, c), "lp"), (_keep_start(p, mode), "keep"))
                if x is not None
            ]
    if polish and found:
        done = refine_many(p, np.array([f[0] for f in found]), np.array([f[1] for f in found]))
        found = [(mode, cc, how) for (mode, _, how), cc in zip(found, done, strict=True)]
    out: tuple[float, I64, I64, str] | None = None
    for mode, cc, how in found:
        obj = evaluate(p, mode, cc).objective
        if out is None or obj < out[0] - 1e-9:
            out = (obj, mode, cc, how)
    if out is None:
        return None
    _, mode, c, method = out
    bound = res.objective if res.status == "Optimal" else float("nan")
    return Solution(mode, c, evaluate(p, mode, c).objective, f"relaxed+{method}", bound)

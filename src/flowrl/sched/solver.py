"""Solvers for :class:`~flowrl.sched.problem.PlanProblem`: greedy, LP + rounding, exact MILP.

- :func:`assign_greedy` — modes fixed; buckets longest first are water-filled onto the nodes
  allowed by a latency threshold ``theta`` (a node may take bucket ``b`` only if
  ``switch + lat <= theta``), respecting the KV limit; ``theta`` is searched over the
  distinct latency values. Milliseconds even at 512 GPUs: the "feasible plan fast" path.
- :func:`assign_lp` — modes fixed; the same ``theta`` search, each step an LP (HiGHS) over
  counts with migration cost, then largest-remainder rounding and a KV repair.
- :func:`solve_relaxed` — the LP relaxation of the full MILP picks a mode *mix* (fractional
  node counts per mode, rounded by largest remainder, given to the nodes the relaxation
  prefers, current mode first), plus the current and every homogeneous layout as starts; a
  greedy local search moves one, half or all of a mode's nodes to another mode (at most
  ``max_evals`` mixes, so results do not depend on machine speed unless the deadline cuts
  in); the best mix is polished by :func:`assign_lp`.
- :func:`solve_milp` — the full MILP (binary modes and bucket-presence indicators, integer
  counts) with HiGHS branch-and-cut, warm-started, under a time limit.

Invariant (asserted by tests): every plan these return is ``feasible`` for the problem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray
from scipy import sparse

from flowrl.sched import _highs
from flowrl.sched.problem import PlanProblem, evaluate, feasible

__all__ = ["Solution", "assign_greedy", "assign_lp", "fit_budget", "solve_milp", "solve_relaxed"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class Solution:
    mode: I64
    counts: I64
    objective: float
    method: str
    bound: float = float("nan")


def _thetas(p: PlanProblem, mode: I64) -> F64:
    on = np.nonzero(mode >= 0)[0]
    vals = (p.lat[mode[on]] + p.switch[on, mode[on]][:, None]).ravel()
    return np.unique(vals)


def _fill_bucket(n_req: int, loads: F64, a: F64, cap: I64) -> I64 | None:
    """Integer water-filling of ``n_req`` requests (cost ``a`` each) onto ``loads``."""
    if cap.sum() < n_req:
        return None
    order = np.argsort(loads)
    ls, inv = loads[order], 1.0 / a[order]
    lam = (n_req + np.cumsum(ls * inv)) / np.cumsum(inv)
    nxt = np.append(ls[1:], np.inf)
    k = int(np.argmax(lam <= nxt))
    x = np.zeros(len(loads))
    x[order[: k + 1]] = np.maximum(lam[k] - ls[: k + 1], 0.0) * inv[: k + 1]
    x = np.minimum(x, cap)
    out = np.floor(x).astype(np.int64)
    short = n_req - int(out.sum())
    while short > 0:
        room = cap - out
        after = loads + (out + 1) * a
        after[room <= 0] = np.inf
        take = np.argsort(after, kind="stable")[: min(short, int((room > 0).sum()))]
        if not len(take) or np.isinf(after[take[0]]):
            return None
        out[take] += 1
        short -= len(take)
    return out


def _greedy_at(p: PlanProblem, mode: I64, theta: float) -> I64 | None:
    on = np.nonzero(mode >= 0)[0]
    m = mode[on]
    loads = p.switch[on, m].astype(np.float64)
    kvleft = p.kv_limit * p.cap[m]
    c = np.zeros((p.n_nodes, p.n_buckets), dtype=np.int64)
    for b in np.argsort(-p.bucket_len, kind="stable"):
        n_req = int(p.count[b])
        if not n_req:
            continue
        ok = p.switch[on, m] + p.lat[m, b] <= theta + 1e-9
        cap = np.where(ok, np.floor(kvleft / p.kv[b] + 1e-9), 0).astype(np.int64)
        got = _fill_bucket(n_req, loads, p.work[m, b], cap)
        if got is None:
            return None
        c[on, b] = got
        loads += got * p.work[m, b]
        kvleft -= got * p.kv[b]
    return c


def _search_theta(p: PlanProblem, mode: I64, assign) -> I64 | None:
    """Binary search on the latency threshold; returns the best counts found."""
    thetas = _thetas(p, mode)
    lo, hi = 0, len(thetas) - 1
    best: tuple[float, I64] | None = None
    tried: dict[int, I64 | None] = {}

    def run(i: int) -> I64 | None:
        if i not in tried:
            tried[i] = assign(p, mode, float(thetas[i]))
            c = tried[i]
            if c is not None:
                nonlocal best
                obj = evaluate(p, mode, c).objective
                if best is None or obj < best[0]:
                    best = (obj, c)
        return tried[i]

    while lo < hi:
        mid = (lo + hi) // 2
        c = run(mid)
        if c is not None and evaluate(p, mode, c).makespan <= thetas[mid] + 1e-9:
            hi = mid
        else:
            lo = mid + 1
    run(lo)
    if lo + 1 < len(thetas):
        run(lo + 1)
    if lo > 0:
        run(lo - 1)
    return None if best is None else best[1]


def assign_greedy(p: PlanProblem, mode: I64) -> I64 | None:
    """Counts for fixed ``mode`` by water-filling (``None`` if KV limits make it infeasible)."""
    return _search_theta(p, np.asarray(mode, dtype=np.int64), _greedy_at)


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


def _lp_at(p: PlanProblem, mode: I64, theta: float) -> I64 | None:
    n, nb = p.n_nodes, p.n_buckets
    on = mode >= 0
    mm = np.maximum(mode, 0)
    sw = np.where(on, p.switch[np.arange(n), mm], 0.0)
    elig = on[:, None] & (p.lat[mm] + sw[:, None] <= theta + 1e-9)
    if np.any(p.count > 0) and not np.all(elig[:, p.count > 0].any(axis=0)):
        return None
    pairs = np.argwhere(elig)  # (k, 2): node, bucket
    k = len(pairs)
    nv = k + n * nb + 1  # counts, moved, T
    t_col = nv - 1
    rows, cols, vals = [], [], []
    lo, hi = [], []
    r = 0
    # bucket totals
    rows += list(r + pairs[:, 1])
    cols += list(range(k))
    vals += [1.0] * k
    lo += list(p.count.astype(float))
    hi += list(p.count.astype(float))
    r += nb
    # throughput: sum work*c - T <= -switch
    rows += list(r + pairs[:, 0])
    cols += list(range(k))
    vals += list(p.work[mm[pairs[:, 0]], pairs[:, 1]])
    rows += list(r + np.arange(n))
    cols += [t_col] * n
    vals += [-1.0] * n
    lo += [-np.inf] * n
    hi += list(-sw)
    r += n
    # KV
    rows += list(r + pairs[:, 0])
    cols += list(range(k))
    vals += list(p.kv[pairs[:, 1]])
    lo += [-np.inf] * n
    hi += list(np.where(on, p.kv_limit * p.cap[mm], 0.0))
    r += n
    # moved >= holdings - kept
    keeps = mode == p.current
    kept = keeps[pairs[:, 0]]
    rows += list(r + pairs[kept, 0] * nb + pairs[kept, 1])
    cols += list(np.nonzero(kept)[0])
    vals += [-1.0] * int(kept.sum())
    rows += list(r + np.arange(n * nb))
    cols += list(k + np.arange(n * nb))
    vals += [-1.0] * (n * nb)
    lo += [-np.inf] * (n * nb)
    hi += list(-p.holdings.ravel().astype(float))
    r += n * nb
    a = sparse.csr_matrix((vals, (rows, cols)), shape=(r, nv))
    cost = np.zeros(nv)
    cost[k : k + n * nb] = p.beta * np.tile(p.mig, n)
    cost[t_col] = 1.0
    res = _highs.solve(cost, a, np.array(lo), np.array(hi), np.zeros(nv), np.full(nv, np.inf))
    if not res.ok:
        return None
    frac = np.zeros((n, nb))
    frac[pairs[:, 0], pairs[:, 1]] = np.maximum(res.x[:k], 0.0)
    return _round_counts(p, mode, frac, elig)


def assign_lp(p: PlanProblem, mode: I64) -> I64 | None:
    """Counts for fixed ``mode``: latency-threshold search over HiGHS LPs, then rounding."""
    return _search_theta(p, np.asarray(mode, dtype=np.int64), _lp_at)


# -- the full model ---------------------------------------------------------------------------


@final
@dataclass(frozen=True, slots=True)
class _Layout:
    n: int
    mc: int
    nb: int

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
    def t(self) -> int:
        return self.mv0 + self.n * self.nb

    @property
    def size(self) -> int:
        return self.t + 1


def _full_model(p: PlanProblem):
    n, nb = p.n_nodes, p.n_buckets
    cand = p.cand
    mc = len(cand)
    lay = _Layout(n, mc, nb)
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
    # R4 c - N_b z <= 0
    add(r + idx, lay.c0 + idx, np.ones(nmb))
    add(r + idx, lay.z0 + idx, -p.count[b_of].astype(float))
    lo.append(np.full(nmb, -np.inf))
    hi.append(np.zeros(nmb))
    r += nmb
    # R5 z - x <= 0
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
    # R7 latency
    add(r + idx, lay.z0 + idx, p.lat[mode_of, b_of] + p.switch[node_of, mode_of])
    add(r + idx, np.full(nmb, lay.t), -np.ones(nmb))
    lo.append(np.full(nmb, -np.inf))
    hi.append(np.zeros(nmb))
    r += nmb
    # R8 KV balance
    add(r + nm_of, lay.c0 + idx, p.kv[b_of])
    add(r + idx_nm, idx_nm, -p.kv_limit * p.cap[mode_of_nm])
    lo.append(np.full(n * mc, -np.inf))
    hi.append(np.zeros(n * mc))
    r += n * mc
    # R9 moved >= holdings - kept (kept only if the node keeps its current mode)
    mv_idx = np.arange(n * nb)
    add(r + mv_idx, lay.mv0 + mv_idx, -np.ones(n * nb))
    keep = mode_of == p.current[node_of]
    add(r + node_of[keep] * nb + b_of[keep], lay.c0 + idx[keep], -np.ones(int(keep.sum())))
    lo.append(np.full(n * nb, -np.inf))
    hi.append(-p.holdings.ravel().astype(float))
    r += n * nb
    a = sparse.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(r, lay.size),
    )
    cost = np.zeros(lay.size)
    cost[: lay.c0] = p.beta * p.switch[node_of_nm, mode_of_nm]
    cost[lay.mv0 : lay.t] = p.beta * np.tile(p.mig, n)
    cost[lay.t] = 1.0
    col_hi = np.full(lay.size, np.inf)
    col_hi[: lay.c0] = p.allowed[node_of_nm, mode_of_nm].astype(float)
    col_hi[lay.c0 : lay.z0] = p.count[b_of]
    col_hi[lay.z0 : lay.mv0] = 1.0
    integer = np.zeros(lay.size, dtype=bool)
    integer[: lay.mv0] = True
    return lay, cost, a, np.concatenate(lo), np.concatenate(hi), np.zeros(lay.size), col_hi, integer


def _encode(p: PlanProblem, lay: _Layout, sol: Solution) -> F64 | None:
    pos = {int(m): j for j, m in enumerate(p.cand)}
    v = np.zeros(lay.size)
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
    from flowrl.sched.problem import moved_counts, node_times

    v[lay.mv0 : lay.t] = moved_counts(p, sol.mode, sol.counts).ravel()
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
    """Exact MILP (HiGHS); ``bound`` is the solver's proven lower bound on the objective."""
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


def fit_budget(p: PlanProblem, mode: I64) -> I64:
    """Turn off the nodes holding fewest requests until the GPU budget holds."""
    mode = mode.copy()
    mode[(mode >= 0) & ~p.allowed[np.arange(p.n_nodes), np.maximum(mode, 0)]] = -1
    while int(p.mode_gpus[mode[mode >= 0]].sum()) > p.gpu_budget:
        on = np.nonzero(mode >= 0)[0]
        mode[on[np.argmin(p.holdings[on].sum(axis=1))]] = -1
    return mode


def _neighbours(p: PlanProblem, mode: I64) -> list[I64]:
    """Mixes reached by moving 1, half or all of one mode's nodes to another mode.

    Makespan is a max over nodes, so single-node moves often sit on a plateau; moving a
    group at once crosses it. Nodes already in the target mode, then those holding fewest
    requests, are moved first (fewest switches and re-layouts).
    """
    out = []
    for m_from in np.unique(mode[mode >= 0]):
        nodes = np.nonzero(mode == m_from)[0]
        for m_to in p.cand:
            if m_to == m_from:
                continue
            ok = nodes[p.allowed[nodes, m_to]]
            if not len(ok):
                continue
            key = np.lexsort((p.holdings[ok].sum(axis=1), p.current[ok] != m_to))
            ranked = ok[key]
            for k in sorted({1, (len(ranked) + 1) // 2, len(ranked)}):
                nb = mode.copy()
                nb[ranked[:k]] = m_to
                if int(p.mode_gpus[nb[nb >= 0]].sum()) <= p.gpu_budget:
                    out.append(nb)
    return out


def solve_relaxed(
    p: PlanProblem, *, deadline: float, max_evals: int = 40, polish: bool = True
) -> Solution | None:
    """LP relaxation -> mode-mix rounding -> greedy local search -> LP polish (see module)."""
    lay, cost, a, lo, hi, clo, chi, _ = _full_model(p)
    res = _highs.solve(
        cost, a, lo, hi, clo, chi, time_limit=max(deadline - time.perf_counter(), 0.01)
    )
    starts = [fit_budget(p, p.current)]
    if res.ok:
        starts.insert(0, _round_mix(p, res.x[: lay.c0].reshape(p.n_nodes, lay.mc)))
    for m in p.cand:  # homogeneous layouts: cheap, and often where the optimum sits
        starts.append(fit_budget(p, np.where(p.allowed[:, m], m, -1).astype(np.int64)))
    best: tuple[float, I64, I64] | None = None
    seen: set[bytes] = set()
    for mode in starts:
        frontier = [mode]
        while frontier and time.perf_counter() < deadline and len(seen) < max_evals:
            nxt = []
            for md in frontier:
                key = md.tobytes()
                if key in seen:
                    continue
                seen.add(key)
                c = assign_greedy(p, md)
                if c is None:
                    continue
                obj = evaluate(p, md, c).objective
                if best is None or obj < best[0] - 1e-9:
                    best = (obj, md, c)
                    nxt = _neighbours(p, md)
                if time.perf_counter() >= deadline or len(seen) >= max_evals:
                    break
            frontier = nxt
    if best is None:
        return None
    _, mode, c = best
    method = "greedy"
    if polish and time.perf_counter() < deadline:
        c2 = assign_lp(p, mode)
        if c2 is not None and evaluate(p, mode, c2).objective < best[0]:
            c, method = c2, "lp"
    bound = res.objective if res.ok else float("nan")
    return Solution(mode, c, evaluate(p, mode, c).objective, f"relaxed+{method}", bound)

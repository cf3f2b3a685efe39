"""The planner's greedy assignment of requests to nodes, for many mode layouts at once.

For a fixed layout (a mode per node, ``-1`` off), :func:`assign_greedy_many` bisects on the
target makespan ``theta`` (a fixed number of rounds); each round packs the buckets, longest
first, under ``theta``: a node may take ``k`` requests of bucket ``b`` only if its
throughput bound and its latency bound (``max(lat) + sum co*c``) both stay within
``theta`` and its KV limit holds. *Latency-critical* buckets (whose lone latency exceeds
the balanced throughput time) go to the nodes already at that latency level first, then to
the least loaded — so the tail is concentrated on few nodes that carry little other work;
the other buckets are water-filled. The best plan any round found (by the objective of
:func:`~flowrl.sched.problem.evaluate`) is the answer.

Every array has a leading *row* axis, one row per layout, and every node (an off node
takes nothing): the mode-mix search (:mod:`flowrl.sched.solver`) scores its few best
layouts in one pass, which costs little more than one layout, since on a planner's
clusters (tens of nodes) numpy's per-call overhead, not arithmetic, sets the pace. A row
gives the answer it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.sched.problem import PlanProblem

__all__ = ["BISECTION_ROUNDS", "assign_greedy_many", "water_fill"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
B = NDArray[np.bool_]
BISECTION_ROUNDS = 12


def water_fill(n_req: int, loads: F64, a: F64, cap: NDArray) -> tuple[I64, B]:
    """Integer water-filling of ``n_req`` requests (cost ``a`` each) onto ``loads``, per row
    (rows x nodes): ``(counts, ok)``, ``ok`` False where ``cap`` cannot hold them. A node
    with infinite load and cost takes none (callers silence the ``inf * 0`` that gives).

    The fluid level fills the least loaded nodes first; its floor, then one request at a
    time to the node that ends lowest with it, place the rest. (Flat indices and array
    methods: on a few nodes numpy's call overhead is the cost.)
    """
    n_rows, n = loads.shape
    loads, a = np.ascontiguousarray(loads), np.ascontiguousarray(a)
    base = np.arange(0, n_rows * n, n)[:, None]
    ok = np.add.reduce(cap, axis=1) >= n_req
    order = loads.argsort(axis=1, kind="stable") + base  # flat indices
    ls = loads.ravel()[order]
    inv = 1.0 / a.ravel()[order]
    lam = (n_req + np.add.accumulate(ls * inv, axis=1)) / np.add.accumulate(inv, axis=1)
    nxt = np.concatenate([ls[:, 1:], np.full((n_rows, 1), np.inf)], axis=1)
    k = (lam <= nxt).argmax(axis=1)  # the level is at most the next node's load
    fluid = np.empty(n_rows * n)
    fluid[order] = np.maximum(lam.ravel()[base[:, 0] + k][:, None] - ls, 0.0) * inv
    out = np.floor(np.minimum(fluid.reshape(n_rows, n), cap)).astype(np.int64)
    short = n_req - np.add.reduce(out, axis=1)
    short[~ok] = 0
    room = cap - out > 0
    has = np.add.reduce(room, axis=1)
    while (full := (short >= has) & (has > 0)).any():  # every node with room takes one
        give = room & full[:, None]
        out += give
        short -= np.add.reduce(give, axis=1)
        room = cap - out > 0
        has = np.add.reduce(room, axis=1)
    ok &= (short == 0) | (has > 0)
    short[~ok] = 0
    if short.any():  # then one each to the nodes that end lowest with it
        after = loads + (out + 1) * a
        after[~room] = np.inf
        top = int(short.max())
        take = after.argsort(axis=1, kind="stable")[:, :top] + base
        out.ravel()[take] += np.arange(top) < short[:, None]
    return out, ok


def _pack(n_req: int, order: I64, cap: I64) -> tuple[I64, B]:
    """First-fit of ``n_req`` requests onto nodes in ``order``, each up to ``cap``, per row."""
    n_rows, n = cap.shape
    flat = order + np.arange(0, n_rows * n, n)[:, None]
    take = cap.ravel()[flat]
    before = np.add.accumulate(take, axis=1) - take
    out = np.empty(n_rows * n, dtype=np.int64)
    out[flat] = np.minimum(np.maximum(n_req - before, 0), take)
    return out.reshape(n_rows, n), np.add.reduce(cap, axis=1) >= n_req


@final
@dataclass(frozen=True, slots=True)
class _Rows:
    """The layouts' coefficients, per bucket a (rows, nodes) array; an off node has zero
    coefficients, no KV room and ``off = inf`` (added to its load and cost: it takes
    nothing)."""

    on: B
    off: F64
    sw: F64
    work: F64  # (buckets, rows, nodes)
    co: F64
    lat: F64
    kv_room: F64
    critical: B  # (buckets, rows)
    some_critical: list[bool]
    all_critical: list[bool]

    @classmethod
    def of(cls, p: PlanProblem, modes: I64) -> _Rows:
        on = modes >= 0
        mm = np.maximum(modes, 0)
        sw = np.where(on, p.switch[np.arange(p.n_nodes)[None, :], mm], 0.0)

        def per_bucket(coef: F64) -> F64:
            return np.ascontiguousarray(np.where(on, coef.T[:, mm], 0.0))

        lat = per_bucket(p.lat)
        n_on = on.sum(axis=1)
        alone = np.where(on, (p.work @ p.count)[mm], 0.0).sum(axis=1)
        balanced = (sw.sum(axis=1) + alone / n_on) / n_on
        critical = np.where(on, lat, np.inf).min(axis=2) > balanced
        return cls(
            on=on,
            off=np.where(on, 0.0, np.inf),
            sw=sw,
            work=per_bucket(p.work),
            co=per_bucket(p.co),
            lat=lat,
            kv_room=np.where(on, p.kv_limit * p.cap[mm], 0.0),
            critical=critical,
            some_critical=critical.any(axis=1).tolist(),
            all_critical=critical.all(axis=1).tolist(),
        )


def _greedy_at(p: PlanProblem, g: _Rows, theta: F64) -> tuple[I64, B, F64, F64]:
    """One packing under ``theta`` per row: ``(counts, ok, makespan, objective)``. Call it
    with floating-point warnings silenced: off nodes divide by zero and multiply inf by 0.

    Without a latency bound (the wave's bulk: ``lat = co = 0``) a node's time is its
    throughput bound alone, and the latency terms are skipped (they would add zeros)."""
    n_rows, n = g.on.shape
    latency = bool(p.lat.any() or p.co.any())
    thr = np.zeros((n_rows, n))
    co = np.zeros((n_rows, n))
    longest = np.zeros((n_rows, n))
    kvleft = g.kv_room.copy()
    c = np.zeros((n_rows, n, p.n_buckets), dtype=np.int64)
    ok = np.ones(n_rows, dtype=bool)
    slack = theta[:, None] - g.sw
    for b in np.argsort(-p.bucket_len, kind="stable").tolist():
        n_req, kv = int(p.count[b]), float(p.kv[b])
        if not n_req:
            continue
        w = g.work[b]
        room = (slack - thr) / w
        if latency:
            k, lat = g.co[b], g.lat[b]
            level = np.maximum(longest, lat)
            tail = level + co
            room = np.minimum(room, (slack - level - co) / k)  # co is 0 for an off node
            load = g.sw + np.maximum(thr, tail) + g.off
            cost = np.where(thr >= tail, w, k) + g.off
        else:
            load = g.sw + thr + g.off
            cost = w + g.off
        room = np.minimum(np.minimum(room, kvleft / kv + 1e-9), n_req)
        cap = np.floor(np.fmax(room, 0.0)).astype(np.int64)  # nan (0 / 0): none
        if g.some_critical[b]:
            got, fit = _pack(n_req, np.lexsort((load, longest < lat)), cap)
            crit = g.critical[b]
            ok &= ~crit | fit
        if not g.all_critical[b]:
            filled, fit = water_fill(n_req, load, cost, cap)
            if g.some_critical[b]:
                got = np.where(crit[:, None], got, filled)
                ok &= crit | fit
            else:
                got, ok = filled, ok & fit
        if not ok.any():  # every row failed: what the rest would place is never read
            break
        c[:, :, b] = got
        thr += got * w
        kvleft -= got * kv
        if latency:
            co += got * k
            longest = np.where(got > 0, level, longest)
    busy = c.any(axis=2)
    t = np.where(g.on, g.sw + np.where(busy, np.maximum(thr, longest + co), 0.0), 0.0)
    span = t.max(axis=1)
    mig = (np.maximum(p.holdings - c, 0) * p.mig).sum(axis=(1, 2))
    return c, ok, span, span + p.mig_weight * mig + p.switch_weight * g.sw.sum(axis=1)


def assign_greedy_many(p: PlanProblem, modes: I64) -> list[I64 | None]:
    """Counts for each row of ``modes`` (layouts x nodes): the bisection of the module
    docstring; ``None`` for a layout with no node on or whose KV limits admit no
    assignment."""
    modes = np.atleast_2d(np.asarray(modes, dtype=np.int64))
    out: list[I64 | None] = [None] * len(modes)
    rows = np.flatnonzero((modes >= 0).any(axis=1))
    if not len(rows):
        return out
    g = _Rows.of(p, modes[rows])
    n_rows = len(rows)
    live = np.ones(n_rows, dtype=bool)
    hi = np.full(n_rows, np.inf)
    lo = np.zeros(n_rows)
    best = np.full(n_rows, np.inf)
    best_c = np.zeros((n_rows, p.n_nodes, p.n_buckets), dtype=np.int64)
    for _ in range(BISECTION_ROUNDS + 1):
        theta = np.where(np.isinf(hi), hi, 0.5 * (lo + hi))
        with np.errstate(divide="ignore", invalid="ignore"):
            c, ok, span, obj = _greedy_at(p, g, theta)
        live &= ok | np.isfinite(hi)  # fails unconstrained: the KV limits admit nothing
        lo = np.where(ok, lo, theta)
        better = ok & (obj < best)
        best = np.where(better, obj, best)
        best_c[better] = c[better]
        hi = np.where(ok, np.minimum(theta, span), hi)
    for r, row in enumerate(rows):
        if live[r] and np.isfinite(best[r]):
            out[row] = best_c[r]
    return out

"""Steepest descent over single-request moves and swaps, for fixed mode layouts.

:func:`refine_many` is the last step of every assignment the planner's solvers make
(:mod:`flowrl.sched.solver`). Every round scores every (source, destination, bucket) move
at once — the two nodes' new times against the other nodes' latest, plus the migration it
adds or saves (moving a request back to the node that holds it saves one) — and, when no
move helps, every swap of one request between the node that finishes last and another
node. Of the three best-scored, it takes the first that lowers the objective, or keeps it
with fewer nodes at the makespan (a plateau step: the makespan is a max); with none, it
stops.

A round costs a fixed number of numpy operations whatever the layout: a node's time with
one request more or fewer is read off its throughput and co-runner sums and the top two
latencies of the buckets it holds (the node-time model of :mod:`flowrl.sched.problem`),
and a move's score *is* its objective (less the terms no move changes), so no candidate is
re-evaluated from scratch. Many assignments descend at once, in lockstep (a leading *row*
axis; an off node has no KV room, so nothing moves to it, and holds nothing): on a
planner's clusters numpy's per-call overhead, not arithmetic, sets the pace. A row gives
the answer it would alone.

Invariant (asserted by tests): the result is never worse than the input under
:func:`~flowrl.sched.problem.evaluate`, keeps every bucket's total, and keeps every node
within its KV limit if the input was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.sched.problem import PlanProblem

__all__ = ["refine", "refine_many"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
B = NDArray[np.bool_]
#: rows refined together at most hold this many (node, node, bucket) move scores
CHUNK_ELEMENTS = 1 << 20
TOP = 3  # candidates a round tries, best score first


def _rest_max(t: F64) -> F64:
    """``[r, i, d]``: the latest of row ``r``'s node times other than nodes ``i`` and ``d``."""
    n_rows, n = t.shape
    top = np.argsort(-t, axis=1, kind="stable")[:, :3]
    rows = np.arange(n_rows)
    rest = np.zeros((n_rows, n, n))
    idx = np.arange(n)
    for q in range(top.shape[1] - 1, -1, -1):
        i = top[:, q][:, None, None]
        keep = (idx[None, :, None] != i) & (idx[None, None, :] != i)
        rest = np.where(keep, t[rows, top[:, q]][:, None, None], rest)
    return rest


def _top(score: F64) -> tuple[tuple[I64, ...], F64]:
    """The ``TOP`` best-scored candidates of every row, ties to the lower index (a stable
    sort's first ``TOP``, by repeated ``argmin``): their indices into ``score[r]`` (a tuple
    of (rows, TOP) arrays) and their scores."""
    rows = np.arange(len(score))
    flat = score.reshape(len(score), -1).copy()
    top = np.empty((len(score), min(TOP, flat.shape[1])), dtype=np.int64)
    s = np.empty(top.shape)
    for q in range(top.shape[1]):
        top[:, q] = flat.argmin(axis=1)
        s[:, q] = flat[rows, top[:, q]]
        flat[rows, top[:, q]] = np.inf  # an inf score is never taken: repeats are harmless
    return np.unravel_index(top, score.shape[1:]), s


def _choose(s: F64, t: F64, changes: list[tuple[I64, F64]]) -> I64:
    """Per row, which of its top candidates (``-1``: none) lowers the objective, or keeps
    it with fewer nodes at the makespan: the first such. ``s`` is the candidates' objective
    relative to ``t.max()``; ``changes`` the nodes each changes and their new times."""
    base = t.max(axis=1)[:, None]
    rows = np.arange(len(t))[:, None]
    trial = np.repeat(t[:, None, :], s.shape[1], axis=1)
    for node, value in changes:
        trial[rows, np.arange(s.shape[1])[None, :], node] = value
    crowd = (trial >= trial.max(axis=2, keepdims=True) - 1e-9).sum(axis=2)
    at_span = (t >= base - 1e-9).sum(axis=1)[:, None]
    better = (s < base) | ((s == base) & (crowd < at_span))
    return np.where(better.any(axis=1), np.argmax(better, axis=1), -1)


Changes = Callable[[tuple[I64, ...]], list[tuple[I64, F64]]]


def _move_changes(ix: tuple[I64, ...], *, t_out: F64, t_in: F64) -> list[tuple[I64, F64]]:
    """Moves ``(source, destination, bucket)``: the two nodes' new times."""
    i, d, b = ix
    rows = np.arange(len(i))[:, None]
    return [(i, t_out[rows, i, b]), (d, t_in[rows, d, b])]


def _swap_changes(ix: tuple[I64, ...], *, j: I64, tj: F64, td: F64) -> list[tuple[I64, F64]]:
    """Swaps ``(d, o, i)`` with node ``j``: the two nodes' new times."""
    d, o, i = ix
    rows = np.arange(len(d))[:, None]
    return [(np.broadcast_to(j[:, None], d.shape), tj[rows, o, i]), (d, td[rows, d, o, i])]


def _pick(score: F64, t: F64, changes: Changes) -> tuple[tuple[I64, ...], B]:
    """Per row, the candidate :func:`_choose` takes from its top ``TOP``: its index into
    ``score[r]`` (a tuple of per-row arrays) and whether there is one. ``changes`` gives
    the nodes candidates change and their new times (only needed on a plateau, where a
    best score equals the objective: otherwise the best candidate alone decides)."""
    rows = np.arange(len(score))
    flat = score.reshape(len(score), -1)
    first = flat.argmin(axis=1)
    best, base = flat[rows, first], t.max(axis=1)
    if not (best == base).any():
        return np.unravel_index(first, score.shape[1:]), best < base
    ix, s = _top(score)
    q = _choose(s, t, changes(ix))
    return tuple(x[rows, np.maximum(q, 0)] for x in ix), q >= 0


@final
@dataclass(frozen=True, slots=True)
class _Nodes:
    """Per-row node coefficients of the layouts (an off node: zeros and no KV room)."""

    w: F64  # (rows, nodes, buckets)
    co: F64
    lat: F64
    sw: F64  # (rows, nodes)
    limit: F64
    latency: bool  # False in the wave's bulk (lat = co = 0): the tail terms are skipped

    @classmethod
    def of(cls, p: PlanProblem, modes: I64) -> _Nodes:
        on = modes >= 0
        mm = np.maximum(modes, 0)
        return cls(
            w=np.where(on[..., None], p.work[mm], 0.0),
            co=np.where(on[..., None], p.co[mm], 0.0),
            lat=np.where(on[..., None], p.lat[mm], 0.0),
            sw=np.where(on, p.switch[np.arange(p.n_nodes)[None, :], mm], 0.0),
            limit=np.where(on, p.kv_limit * p.cap[mm] + 1e-6, -np.inf),
            latency=bool(p.lat.any() or p.co.any()),
        )


@final
@dataclass(frozen=True, slots=True)
class _Times:
    """Node times under the current counts and after one request more or fewer."""

    t: F64  # (rows, nodes)
    out: F64  # (rows, nodes, buckets): one request of the bucket fewer
    into: F64  # one more
    thr: F64  # throughput sums
    cos: F64 | None  # co-runner sums (None without a latency bound)
    drop: F64 | None  # the longest latency left when one request of the bucket goes

    @classmethod
    def of(cls, g: _Nodes, cur: I64) -> _Times:
        thr = np.einsum("rkb,rkb->rk", g.w, cur)
        sw = g.sw[..., None]
        if not g.latency:  # max(thr, 0) is thr: every count and coefficient is >= 0
            return cls(
                g.sw + thr,
                sw + np.maximum(thr[..., None] - g.w, 0.0),
                sw + (thr[..., None] + g.w),
                thr,
                None,
                None,
            )
        held = np.where(cur > 0, g.lat, 0.0)
        top2 = np.sort(np.concatenate([held, np.zeros((*held.shape[:2], 1))], axis=2), axis=2)
        longest, second = top2[..., -1:], top2[..., -2:-1]
        drop = np.where((cur == 1) & (held >= longest), second, longest)
        cos = np.einsum("rkb,rkb->rk", g.co, cur)
        busy = cur.sum(axis=2)
        t = g.sw + np.where(busy > 0, np.maximum(thr, longest[..., 0] + cos), 0.0)
        out = sw + np.where(
            busy[..., None] > 1,
            np.maximum(thr[..., None] - g.w, drop + (cos[..., None] - g.co)),
            0.0,
        )
        into = sw + np.maximum(
            thr[..., None] + g.w, np.maximum(longest, g.lat) + (cos[..., None] + g.co)
        )
        return cls(t, out, into, thr, cos, drop)

    def swapped(self, g: _Nodes, j: I64) -> tuple[F64, F64]:
        """``(tj, td)``: node ``j``'s time after giving one request of bucket ``o`` and
        taking one of ``i`` (``[r, o, i]``), and node ``d``'s after taking ``o`` and giving
        ``i`` (``[r, d, o, i]``)."""
        ar = np.arange(len(j))
        wj = g.w[ar, j]
        thr_j = self.thr[ar, j][:, None, None] - wj[:, :, None] + wj[:, None, :]
        thr_d = self.thr[..., None, None] + g.w[..., :, None] - g.w[..., None, :]
        sw_j, sw_d = g.sw[ar, j][:, None, None], g.sw[..., None, None]
        if self.cos is None or self.drop is None:  # no latency bound
            return sw_j + np.maximum(thr_j, 0.0), sw_d + np.maximum(thr_d, 0.0)
        coj = g.co[ar, j]
        tail_j = np.maximum(self.drop[ar, j][:, :, None], g.lat[ar, j][:, None, :]) + (
            self.cos[ar, j][:, None, None] - coj[:, :, None] + coj[:, None, :]
        )
        tail_d = np.maximum(self.drop[:, :, None, :], g.lat[..., :, None]) + (
            self.cos[..., None, None] + g.co[..., :, None] - g.co[..., None, :]
        )
        return sw_j + np.maximum(thr_j, tail_j), sw_d + np.maximum(thr_d, tail_d)


def _descend(p: PlanProblem, modes: I64, counts: I64, rounds: int) -> I64:
    """:func:`refine_many` on one chunk of rows."""
    n = p.n_nodes
    hold = p.holdings[None]
    mig = p.mig_weight * p.mig
    node = np.arange(n)
    other = node[:, None] != node[None, :]
    dkv = p.kv[:, None] - p.kv[None, :]  # [o, i]: KV a node gains taking o for i
    distinct = ~np.eye(p.n_buckets, dtype=bool)
    out = counts.copy()
    rows = np.arange(len(modes))  # the rows of `out` that the working arrays hold
    g, ar, cur = _Nodes.of(p, modes), np.arange(len(rows)), counts.copy()
    active = (modes >= 0).sum(axis=1) >= 2
    for _ in range(rounds):
        if 2 * active.sum() <= len(active):  # drop the rows that have stopped
            out[rows] = cur
            rows, cur = rows[active], cur[active]
            if not len(rows):
                break
            g, ar, active = _Nodes.of(p, modes[rows]), np.arange(len(rows)), active[active]
        tm = _Times.of(g, cur)
        t = tm.t
        rest = _rest_max(t)
        present = cur > 0
        # one more request leaves its holder / comes back to it: +-mig, exactly 0 if both
        leave = (cur <= hold).astype(np.float64)
        back = (cur < hold).astype(np.float64)
        span = np.maximum(rest[..., None], np.maximum(tm.out[:, :, None, :], tm.into[:, None]))
        kv = cur @ p.kv
        fits = kv[..., None] + p.kv <= g.limit[..., None]  # [r, d, b]
        ok = present[:, :, None, :] & fits[:, None, :, :] & other[None, :, :, None]
        dmig = mig * (leave[:, :, None, :] - back[:, None, :, :])
        (i, d, b), found = _pick(
            np.where(ok, span + dmig, np.inf),
            t,
            partial(_move_changes, t_out=tm.out, t_in=tm.into),
        )
        moved = active & found
        cur[ar[moved], i[moved], b[moved]] -= 1
        cur[ar[moved], d[moved], b[moved]] += 1
        stuck = active & ~found
        if not stuck.any():
            continue
        # swaps: j, the node that finishes last, gives one of bucket o and takes one of i
        j = np.argmax(t, axis=1)
        tj, td = tm.swapped(g, j)
        kj = kv[ar, j][:, None, None, None]
        fit = (kv[..., None, None] + dkv <= g.limit[..., None, None]) & (
            kj - dkv <= g.limit[ar, j][:, None, None, None]
        )
        have = (present[ar, j][:, :, None] & distinct)[:, None] & present[:, :, None, :]
        gain = mig[:, None] * (leave[ar, j][:, None, :, None] - back[..., None]) + mig * (
            leave[:, :, None, :] - back[ar, j][:, None, None, :]
        )
        sc = np.maximum(rest[ar, j][..., None, None], np.maximum(tj[:, None], td)) + gain
        not_j = node[None, :] != j[:, None]
        sc = np.where(fit & have & not_j[..., None, None], sc, np.inf)
        (d, o, i), found = _pick(sc, t, partial(_swap_changes, j=j, tj=tj, td=td))
        swapped = stuck & found
        r = ar[swapped]
        cur[r, j[r], o[r]] -= 1
        cur[r, j[r], i[r]] += 1
        cur[r, d[r], o[r]] += 1
        cur[r, d[r], i[r]] -= 1
        active &= ~stuck | swapped
    out[rows] = cur
    return out


def refine_many(p: PlanProblem, modes: I64, counts: I64, rounds: int | None = None) -> I64:
    """Improve each row's counts (``counts[r]`` for ``modes[r]``) by single moves and swaps
    (module docstring); at most ``rounds`` rounds a row (default ``8 * nodes``): a counted
    budget."""
    modes = np.atleast_2d(np.asarray(modes, dtype=np.int64))
    counts = np.asarray(counts, dtype=np.int64).reshape(len(modes), p.n_nodes, p.n_buckets)
    budget = 8 * p.n_nodes if rounds is None else rounds
    step = max(1, CHUNK_ELEMENTS // max(p.n_nodes**2 * p.n_buckets, 1))
    parts = [
        _descend(p, modes[a : a + step], counts[a : a + step], budget)
        for a in range(0, len(modes), step)
    ]
    return np.concatenate(parts) if parts else counts.copy()


def refine(p: PlanProblem, mode: I64, c: I64, rounds: int | None = None) -> I64:
    """:func:`refine_many` for one assignment."""
    return refine_many(p, np.asarray(mode)[None], np.asarray(c)[None], rounds)[0]

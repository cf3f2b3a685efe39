"""Steepest descent over single-request moves and swaps, for a fixed mode layout.

:func:`refine` is the last step of every assignment the planner's solvers make
(:mod:`flowrl.sched.solver`). Every round scores every (source, destination, bucket) move
at once — the two nodes' new times against the other nodes' latest, plus the migration it
adds or saves (moving a request back to the node that holds it saves one) — and, when no
move helps, every swap of one request between the node that finishes last and another
node. It takes the best move that lowers the objective, or keeps it with fewer nodes at the
makespan (a plateau step: the makespan is a max).

A round costs a fixed number of numpy operations on ``(nodes, nodes, buckets)`` arrays,
whatever the layout: a node's time with one request more or fewer is read off its
throughput and co-runner sums and the top two latencies of the buckets it holds (the
node-time model of :mod:`flowrl.sched.problem`), and a move's score *is* its objective
(less the terms no move changes), so no candidate is re-evaluated from scratch.

Invariant (asserted by tests): the result is never worse than the input under
:func:`~flowrl.sched.problem.evaluate`, keeps every bucket's total, and keeps every node
within its KV limit if the input was.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from flowrl.sched.problem import PlanProblem

__all__ = ["refine"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


def _rest_max(t: F64) -> F64:
    """``[i, d]``: the latest of the node times ``t`` other than nodes ``i`` and ``d``."""
    k = len(t)
    top = np.argsort(-t, kind="stable")[:3]
    rest = np.zeros((k, k))
    idx = np.arange(k)
    for i in top[::-1]:
        rest = np.where((idx[:, None] != i) & (idx[None, :] != i), t[i], rest)
    return rest


def _first_better(score: F64, t: F64, *changes: tuple[NDArray, F64]) -> tuple[int, ...] | None:
    """The first of the three best-scored candidates that lowers the objective, or keeps it
    with fewer nodes at the makespan. ``score`` is the objective relative to ``t.max()``;
    each of ``changes`` gives, broadcast to ``score``'s shape, a node a candidate changes
    and that node's new time."""
    base = float(t.max())
    at_span = int((t >= base - 1e-9).sum())
    for flat in np.argsort(score, axis=None, kind="stable")[:3]:
        s = float(score.flat[flat])
        if not s <= base:  # sorted: nothing later is better (inf and nan included)
            return None
        ix = tuple(int(v) for v in np.unravel_index(flat, score.shape))
        if s < base:
            return ix
        trial = t.copy()
        for node, value in changes:
            trial[np.broadcast_to(node, score.shape)[ix]] = np.broadcast_to(value, score.shape)[ix]
        if int((trial >= trial.max() - 1e-9).sum()) < at_span:
            return ix
    return None


def refine(p: PlanProblem, mode: I64, c: I64, rounds: int | None = None) -> I64:
    """Improve counts ``c`` for ``mode`` by single moves and swaps (module docstring); at
    most ``rounds`` rounds (default ``8 * nodes``): a counted budget."""
    on = np.nonzero(mode >= 0)[0]
    k = len(on)
    if k < 2:
        return c
    m = mode[on]
    w, co, lat = p.work[m], p.co[m], p.lat[m]  # (k, nb)
    sw = p.switch[on, m]
    limit = p.kv_limit * p.cap[m] + 1e-6
    hold = p.holdings[on]
    mig = p.mig_weight * p.mig
    other = ~np.eye(k, dtype=bool)
    pair = np.arange(k)
    dkv = p.kv[:, None] - p.kv[None, :]  # [o, i]: KV a node gains taking o for i
    distinct = ~np.eye(p.n_buckets, dtype=bool)
    cur = c[on].copy()
    for _ in range(8 * p.n_nodes if rounds is None else rounds):
        present = cur > 0
        held = np.where(present, lat, 0.0)
        top2 = np.sort(np.hstack([held, np.zeros((k, 1))]), axis=1)[:, -2:]
        longest, second = top2[:, 1], top2[:, 0]
        # the longest latency left when one request of bucket b goes
        drop = np.where((cur == 1) & (held >= longest[:, None]), second[:, None], longest[:, None])
        thr = np.einsum("kb,kb->k", w, cur)
        cos = np.einsum("kb,kb->k", co, cur)
        n = cur.sum(axis=1)
        t = sw + np.where(n > 0, np.maximum(thr, longest + cos), 0.0)
        rest = _rest_max(t)
        t_out = sw[:, None] + np.where(
            n[:, None] > 1,
            np.maximum(thr[:, None] - w, drop + (cos[:, None] - co)),
            0.0,
        )
        t_in = sw[:, None] + np.maximum(
            thr[:, None] + w, np.maximum(longest[:, None], lat) + (cos[:, None] + co)
        )
        # one more request leaves its holder / comes back to it: +-mig, exactly 0 if both
        leave = (cur <= hold).astype(np.float64)
        back = (cur < hold).astype(np.float64)
        span = np.maximum(rest[:, :, None], np.maximum(t_out[:, None, :], t_in[None, :, :]))
        kv = cur @ p.kv
        ok = present[:, None, :] & (kv[:, None] + p.kv <= limit[:, None])[None] & other[..., None]
        dmig = mig * (leave[:, None, :] - back[None, :, :])
        score = np.where(ok, span + dmig, np.inf)
        mv = _first_better(
            score, t, (pair[:, None, None], t_out[:, None, :]), (pair[None, :, None], t_in[None])
        )
        if mv is not None:
            i, d, b = mv
            cur[i, b] -= 1
            cur[d, b] += 1
            continue
        j = int(np.argmax(t))  # swaps: j gives one of bucket o and takes one of bucket i
        tj = sw[j] + np.maximum(
            thr[j] - w[j][:, None] + w[j][None, :],
            np.maximum(drop[j][:, None], lat[j][None, :]) + (cos[j] - co[j][:, None] + co[j]),
        )  # [o, i]
        td = sw[:, None, None] + np.maximum(
            thr[:, None, None] + w[:, :, None] - w[:, None, :],
            np.maximum(drop[:, None, :], lat[:, :, None])
            + (cos[:, None, None] + co[:, :, None] - co[:, None, :]),
        )  # [d, o, i]: d takes o, gives i
        fit = (kv[:, None, None] + dkv <= limit[:, None, None]) & (kv[j] - dkv <= limit[j])
        have = (present[j][:, None] & distinct)[None] & present[:, None, :]
        gain = mig[:, None] * (leave[j][:, None] - back[:, :, None]) + mig * (
            leave[:, None, :] - back[j][None, None, :]
        )
        sc = np.maximum(rest[j][:, None, None], np.maximum(tj[None], td)) + gain
        sc = np.where(fit & have & other[j][:, None, None], sc, np.inf)
        sw_ix = _first_better(sc, t, (np.array(j), tj[None]), (pair[:, None, None], td))
        if sw_ix is None:
            break
        d, o, i = sw_ix
        cur[j, o] -= 1
        cur[j, i] += 1
        cur[d, o] += 1
        cur[d, i] -= 1
    out = c.copy()
    out[on] = cur
    return out

"""Improving a fused pipeline schedule: justification and a critical-path tabu search.

A fused schedule is a job shop: every micro-batch of every pipeline is a job (its forwards
then its backwards, one op per pipeline stage), every GPU stage a machine, and an op order's
times are the longest paths of its disjunctive graph (:func:`~flowrl.sched.pipeline_schedule.
longest_paths`). Two classic improvers for that shape, both memory-aware:

- :func:`justify` — forward-backward improvement (justification, from project scheduling):
  place every op as late as possible in order of its latest finish, then as early as
  possible in order of its start, each op into the first gap of its GPU stage that is long
  enough and keeps the stage's activation within the limit. An op can so jump into an idle
  gap ahead of others, which no adjacent swap does in one step; a round is kept only if it
  shortens the makespan.
- :func:`tabu_search` — swaps of two adjacent ops on a critical path (Nowicki-Smutnicki's N5
  neighbourhood: the first and last pair of each block of the path that shares one GPU
  stage), each move rated in O(1) by Taillard's estimate from the heads and tails of the
  current order; the best non-tabu move is taken even when it is worse, so the search
  crosses plateaus; the reverse swap is tabu for a few iterations. Swapping adjacent
  critical ops never creates a cycle, so every order visited is deadlock-free.

Invariants (asserted by tests through :func:`~flowrl.sched.pipeline_search.search_schedule`):
both return an order no longer than the one they were given, every op on its own GPU stage
once, deadlock-free and within ``limit`` whenever the given order was. Budgets are counted
(rounds, iterations), never timed.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence

from flowrl.sched.pipeline_schedule import Layout, Order, longest_paths

__all__ = ["justify", "swap_fits", "tabu_search"]

_EPS = 1e-9


def _place(
    lay: Layout,
    ops: Sequence[int],
    dep: Sequence[int],
    mem: Sequence[float],
    limit: float,
) -> list[float] | None:
    """Insert ``ops`` in turn, each at the earliest gap after ``dep[op]`` finishes where it
    fits and the stage's activation stays within ``limit`` (``mem``: + takes, - frees).
    Finish times, or None when an op fits nowhere."""
    n_stages = max(lay.gpu) + 1
    starts: list[list[float]] = [[] for _ in range(n_stages)]
    ends: list[list[float]] = [[] for _ in range(n_stages)]
    deltas: list[list[float]] = [[] for _ in range(n_stages)]
    total = [0.0] * n_stages  # the level after each stage's last op
    finish = [-1.0] * lay.n
    for op in ops:
        g, d, p, a = lay.gpu[op], dep[op], lay.dur[op], mem[op]
        s, e, m = starts[g], ends[g], deltas[g]
        t = finish[d] if d >= 0 else 0.0
        k0 = k = bisect.bisect_right(e, t)
        # high[j - k0]: the highest level from slot j on (all of which ``op`` would raise);
        # ops are placed roughly in time order, so slots from k0 on are few
        high: list[float] = []
        if a > 0 and limit < math.inf:
            level = total[g]
            high = [level] * (len(s) - k0 + 1)
            for j in range(len(s) - 1, k0 - 1, -1):
                level -= m[j]
                high[j - k0] = max(level, high[j - k0 + 1])
        while k < len(s) and (s[k] - t < p - _EPS or (high and high[k - k0] + a > limit + _EPS)):
            t = max(t, e[k])
            k += 1
        if k == len(s) and high and high[k - k0] + a > limit + _EPS:
            return None
        s.insert(k, t)
        e.insert(k, t + p)
        m.insert(k, a)
        total[g] += a
        finish[op] = t + p
    return finish


def _by_finish(lay: Layout, finish: Sequence[float]) -> Order:
    order: Order = [[] for _ in range(max(lay.gpu) + 1)]
    for op in sorted(range(lay.n), key=finish.__getitem__):
        order[lay.gpu[op]].append(op)
    return order


def justify(lay: Layout, order: Order, limit: float, *, rounds: int = 6) -> Order:
    """Forward-backward improvement of ``order`` (see the module docstring)."""
    first = longest_paths(order, lay.pred, lay.dur)
    if first is None:
        return order
    finish: list[float] = first
    best, best_span = order, max(finish)
    freed = [-x for x in lay.mem]  # run backwards, a backward takes what its forward frees
    for _ in range(rounds):
        late = _place(lay, sorted(range(lay.n), key=lambda i: -finish[i]), lay.succ, freed, limit)
        if late is None:
            break
        early = _place(lay, sorted(range(lay.n), key=lambda i: -late[i]), lay.pred, lay.mem, limit)
        if early is None:
            break
        cand = _by_finish(lay, early)
        new = longest_paths(cand, lay.pred, lay.dur)
        if new is None or max(new) >= best_span - _EPS:
            break
        best, best_span, finish = cand, max(new), new
    return best


def _critical_path(
    order: Order, lay: Layout, finish: list[float], where: list[int], rng: random.Random
) -> list[int]:
    """One longest path, first op first; ties between the two predecessors drawn at random."""
    span = max(finish)
    op = rng.choice([seq[-1] for seq in order if seq and finish[seq[-1]] >= span - _EPS])
    path = [op]
    while finish[op] - lay.dur[op] > _EPS:
        start = finish[op] - lay.dur[op]
        seq = order[lay.gpu[op]]
        before = seq[where[op] - 1] if where[op] > 0 else -1
        tight = [x for x in (before, lay.pred[op]) if x >= 0 and abs(finish[x] - start) < _EPS]
        op = rng.choice(tight)
        path.append(op)
    path.reverse()
    return path


def _n5_moves(path: list[int], lay: Layout, where: list[int]) -> set[tuple[int, int]]:
    """First and last adjacent pair of each critical block (all of a lone block's ends)."""
    blocks: list[list[int]] = [[path[0]]]
    for a, b in itertools.pairwise(path):
        if lay.gpu[a] == lay.gpu[b] and where[b] == where[a] + 1:
            blocks[-1].append(b)
        else:
            blocks.append([b])
    moves = set()
    for i, block in enumerate(blocks):
        if len(block) < 2:
            continue
        if i > 0 or len(blocks) == 1:
            moves.add((block[0], block[1]))
        if i < len(blocks) - 1 or len(blocks) == 1:
            moves.add((block[-2], block[-1]))
    return moves


def _estimate(lay: Layout, seq: list[int], j: int, finish: list[float], tail: list[float]) -> float:
    """Taillard's estimate of the longest path through ``seq[j]``, ``seq[j+1]`` once swapped
    (``tail[x]``: the longest path from ``x``'s start to the end)."""
    u, v = seq[j], seq[j + 1]
    pred, succ, dur = lay.pred, lay.succ, lay.dur
    machine_before = finish[seq[j - 1]] if j > 0 else 0.0
    machine_after = tail[seq[j + 2]] if j + 2 < len(seq) else 0.0
    head_v = max(finish[pred[v]] if pred[v] >= 0 else 0.0, machine_before)
    head_u = max(finish[pred[u]] if pred[u] >= 0 else 0.0, head_v + dur[v])
    tail_u = max(tail[succ[u]] if succ[u] >= 0 else 0.0, machine_after)
    tail_v = max(tail[succ[v]] if succ[v] >= 0 else 0.0, tail_u + dur[u])
    return max(head_v + dur[v] + tail_v, head_u + dur[u] + tail_u)


def swap_fits(lay: Layout, seq: list[int], j: int, limit: float) -> bool:
    """Memory stays within ``limit`` after swapping positions ``j, j+1`` of ``seq`` (only a
    forward moved ahead of a backward can raise a level)."""
    a, b = seq[j], seq[j + 1]
    if limit == math.inf or lay.mem[b] <= lay.mem[a]:
        return True
    return sum(lay.mem[op] for op in seq[:j]) + lay.mem[b] <= limit + _EPS


def tabu_search(
    lay: Layout,
    order: Order,
    limit: float,
    bound: float,
    *,
    iterations: int,
    rng: random.Random,
    tenure: int = 8,
) -> Order:
    """Tabu search over critical adjacent swaps from ``order`` (see the module docstring);
    stops at ``bound``. Returns the shortest order visited."""
    cur = [list(s) for s in order]
    where = [0] * lay.n
    for seq in cur:
        for j, op in enumerate(seq):
            where[op] = j
    best, best_span = [list(s) for s in cur], math.inf
    tabu: dict[tuple[int, int], int] = {}
    for it in range(iterations + 1):
        finish = longest_paths(cur, lay.pred, lay.dur)
        if finish is None:  # pragma: no cover - critical swaps keep the graph acyclic
            break
        span = max(finish)
        if span < best_span - _EPS:
            best, best_span = [list(s) for s in cur], span
        if best_span <= bound + _EPS or it == iterations:
            break
        tail = longest_paths([s[::-1] for s in cur], lay.succ, lay.dur)
        if tail is None:  # pragma: no cover - the reverse of an acyclic graph is acyclic
            break
        path = _critical_path(cur, lay, finish, where, rng)
        rated = []
        for u, v in _n5_moves(path, lay, where):
            seq = cur[lay.gpu[u]]
            if lay.key[u][:4] == lay.key[v][:4] or not swap_fits(lay, seq, where[u], limit):
                continue
            est = _estimate(lay, seq, where[u], finish, tail)
            allowed = tabu.get((u, v), -1) < it or est < best_span - _EPS
            rated.append((not allowed, est, rng.random(), u, v))
        if not rated:
            break
        *_, u, v = min(rated)
        seq = cur[lay.gpu[u]]
        j = where[u]
        seq[j], seq[j + 1] = v, u
        where[u], where[v] = j + 1, j
        tabu[(v, u)] = it + tenure + rng.randrange(tenure)
    return best

"""Searching fused pipeline schedules (RLHFuse §5.2): greedy, the paper's annealing, ours.

- :func:`greedy_schedule` — the paper's baseline: list scheduling that always runs a ready
  op when a GPU stage is free (memory permitting), preferring the larger model, then
  backward over forward, then the older micro-batch.
- :func:`anneal_schedule` — the paper's Algorithms 1-3 as FlexFusion (its public code) runs
  them: simulated annealing over the op-order matrix from the greedy schedule; neighbour =
  swap of two adjacent ops of a random stage, redrawn until the schedule is valid (distinct
  streams, no deadlock, memory); energy = makespan with the sum of finish times breaking
  ties; a worse neighbour accepted with probability ``exp(-increase / T)``; ``T`` cools
  geometrically every iteration; then a second annealing on peak memory that accepts only
  moves that do not lengthen the makespan.
- :func:`concurrent_1f1b` — a baseline: every model in its own 1F1B order, side by side.
- :func:`search_schedule` — ours, for seconds on one core where FlexFusion uses 768 cores:
  (1) candidates: list schedules under a portfolio of priority rules (the paper's greedy;
  critical path, HEFT's upward rank; backward first) and caps on a model's in-flight
  micro-batches per stage; *1F1B-stream* schedules, where every model keeps its own 1F1B
  order (warm-up 0, 2 or 4 forwards longer) and the stages interleave the models; the
  serial orders; one micro-batch at a time (always fits); ``samples`` randomised
  critical-path list schedules; (2) every 1F1B-stream candidate and the best few others are
  *justified* (:func:`~flowrl.sched.pipeline_improve.justify`): a stream schedule is slow as
  built but light, and justification packs it, often to the bound; (3) from the ``starts``
  best, a critical-path tabu search (:func:`~flowrl.sched.pipeline_improve.tabu_search`,
  ``iterations`` moves each), then justification again; it stops as soon as the makespan
  reaches :func:`~flowrl.sched.pipeline_schedule.lower_bound` (Jackson's, tighter than the
  paper's, so "optimal" is claimed only when proven); (4) the paper's memory phase. Budgets
  are counted, never timed: a result depends only on its inputs and seed.

Invariants (asserted by tests): every schedule returned passes
:func:`~flowrl.sched.pipeline_schedule.validate_schedule` (memory limit included) and an
independent checker; the annealing never returns a longer makespan than its start; the
memory phase never lengthens the makespan; :func:`search_schedule` is no worse than
:func:`greedy_schedule`, than serial 1F1B and than :func:`concurrent_1f1b` whenever they fit
the memory limit (they are among its candidates and nothing after lengthens), and
deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence

from flowrl.errors import ConfigError
from flowrl.sched.pipeline_improve import justify, swap_fits, tabu_search
from flowrl.sched.pipeline_schedule import (
    FusedProblem,
    FusedSchedule,
    Layout,
    Order,
    layout,
    lower_bound,
    one_f_one_b_streams,
    order_of,
    peaks,
    serial_order,
    simulate,
    timed,
)

__all__ = ["anneal_schedule", "concurrent_1f1b", "greedy_schedule", "search_schedule"]

Priority = Callable[[int], tuple[float, ...]]
Candidate = tuple[tuple[float, float], str, Order]  # (makespan, peak), name, op order
EXTRA = (0, 2, 4)  # warm-up forwards added to 1F1B in the stream starts
STREAMS = "1f1b-streams"


def _list_schedule(
    problem: FusedProblem,
    lay: Layout,
    priority: Priority,
    cap: Sequence[int] | None = None,
    streams: Sequence[Sequence[int]] | None = None,
) -> Order | None:
    """Non-delay list scheduling: a free stage starts its ready op of least ``priority``
    whose activation fits the memory limit (and, with ``cap``, keeps its model's in-flight
    micro-batches on that stage within ``cap[op]``; with ``streams``, is the next op of its
    stream). None when memory deadlocks."""
    stream_of, rank = [0] * lay.n, [0] * lay.n
    for i, ops in enumerate(streams or ()):
        for r, op in enumerate(ops):
            stream_of[op], rank[op] = i, r
    head = [0] * len(streams or ())
    n_st = problem.gpu_stages
    limit = math.inf if problem.memory_limit is None else problem.memory_limit + 1e-9
    ready: list[list[int]] = [[] for _ in range(n_st)]
    for i in range(lay.n):
        if lay.pred[i] < 0:
            ready[lay.gpu[i]].append(i)
    level = [0.0] * n_st
    inflight: dict[tuple[int, int], int] = {}
    busy = [False] * n_st
    order: Order = [[] for _ in range(n_st)]
    events: list[tuple[float, int]] = []
    now = 0.0
    done = 0
    while done < lay.n:
        for g in range(n_st):
            if busy[g] or not ready[g]:
                continue
            best, best_key = -1, None
            for op in ready[g]:
                k = lay.key[op][0]
                if streams is not None and head[stream_of[op]] != rank[op]:
                    continue
                if lay.mem[op] > 0 and (
                    level[g] + lay.mem[op] > limit
                    or (cap is not None and inflight.get((g, k), 0) >= cap[op])
                ):
                    continue
                key = priority(op)
                if best_key is None or key < best_key:
                    best, best_key = op, key
            if best < 0:
                continue
            ready[g].remove(best)
            if streams is not None:
                head[stream_of[best]] += 1
            level[g] += lay.mem[best]
            k = lay.key[best][0]
            inflight[(g, k)] = inflight.get((g, k), 0) + (1 if lay.key[best][4] == 0 else -1)
            busy[g] = True
            order[g].append(best)
            heapq.heappush(events, (now + lay.dur[best], best))
        if not events:
            return None
        now, op = heapq.heappop(events)
        batch = [op]
        while events and events[0][0] <= now:
            batch.append(heapq.heappop(events)[1])
        for op in batch:
            done += 1
            busy[lay.gpu[op]] = False
            nxt = lay.succ[op]
            if nxt >= 0:
                ready[lay.gpu[nxt]].append(nxt)
    return order


def _size(problem: FusedProblem, k: int) -> float:
    m = problem.models[k]
    return m.stages * (m.forward_s + m.backward_s)


def greedy_schedule(problem: FusedProblem) -> FusedSchedule:
    """The paper's greedy: larger model first, then backward, then the older micro-batch."""
    lay = layout(problem)
    size = [_size(problem, k) for k in range(len(problem.models))]

    def rule(op: int) -> tuple[float, ...]:
        k, _p, mb, _s, phase = lay.key[op]
        return (-size[k], -phase, mb)

    order = _list_schedule(problem, lay, rule)
    if order is None:  # memory deadlock: one micro-batch at a time per model, then globally
        order = _list_schedule(problem, lay, rule, cap=[1] * lay.n) or _one_at_a_time(lay)
    return timed(problem, order, method="greedy")


def _one_at_a_time(lay: Layout) -> Order:
    """One micro-batch at a time through its whole pipeline and back: deadlock-free, and no
    stage ever holds more than one activation (``FusedProblem`` checks that one fits)."""
    order: Order = [[] for _ in range(max(lay.gpu) + 1)]
    for op in sorted(range(lay.n), key=lambda i: (*lay.key[i][:3], lay.key[i][4], -lay.tail[i])):
        order[lay.gpu[op]].append(op)
    return order


def _inflight_caps(problem: FusedProblem, lay: Layout, share: float | None) -> list[int]:
    """Per-op cap on its model's in-flight micro-batches on its stage.

    ``share=None``: 1F1B's own warm-up (``min(P - s, M)``). Otherwise the stage's memory is
    split between the models: the first model (on each stage the one whose pipeline is
    deeper there) gets ``share`` of it, the others the rest, each at least one micro-batch
    and at most its 1F1B warm-up. Each model then runs within memory reserved for it, so
    list scheduling cannot deadlock on memory (a model's oldest micro-batch always moves).
    """
    natural = []
    for k, _p, _mb, s, _ph in lay.key:
        m = problem.models[k]
        natural.append(min(m.stages - s, m.microbatches))
    if share is None or problem.memory_limit is None:
        return natural
    limit = problem.memory_limit
    caps = list(natural)
    by_stage: dict[int, dict[int, int]] = {}
    for i, (k, *_rest) in enumerate(lay.key):
        by_stage.setdefault(lay.gpu[i], {})[k] = natural[i]
    stage_caps: dict[tuple[int, int], int] = {}
    for g, nat in by_stage.items():
        first = max(nat, key=lambda k: nat[k])
        rest = [k for k in nat if k != first]
        act = {k: max(problem.models[k].activation, 1e-12) for k in nat}
        room = limit - sum(act[k] for k in rest)  # the others keep one micro-batch each
        c_first = min(nat[first], int(limit * share / act[first]), int(room / act[first] + 1e-9))
        stage_caps[(g, first)] = max(1, c_first)
        left = (limit - stage_caps[(g, first)] * act[first]) / max(len(rest), 1)
        for k in rest:
            stage_caps[(g, k)] = max(1, min(nat[k], int(left / act[k] + 1e-9)))
    for i, (k, *_rest) in enumerate(lay.key):
        caps[i] = stage_caps[(lay.gpu[i], k)]
    return caps


def _cap_sets(problem: FusedProblem, lay: Layout) -> list[tuple[str, list[int] | None]]:
    """In-flight caps tried by the search: none, 1F1B's warm-up (x1, x2, x3) and, under a
    memory limit, the limit split between the models (see :func:`_inflight_caps`)."""
    natural = _inflight_caps(problem, lay, None)
    mbs = [problem.models[k].microbatches for k, *_r in lay.key]
    caps: list[tuple[str, list[int] | None]] = [("", None), ("/1f1b-cap", natural)]
    for f in (2, 3):
        scaled = [min(c * f, m) for c, m in zip(natural, mbs, strict=True)]
        caps.append((f"/1f1b-cap*{f}", scaled))
    if problem.memory_limit is not None:
        for share in (0.5, 0.7, 0.85):
            caps.append((f"/split{share:g}", _inflight_caps(problem, lay, share)))
    return caps


def _rules(problem: FusedProblem, lay: Layout) -> list[tuple[str, Priority]]:
    """The list-scheduling priorities: the paper's greedy; critical path (the longest chain
    left after the op first, HEFT's upward rank); backward first, then critical path."""
    size = [_size(problem, k) for k in range(len(problem.models))]

    def paper(op: int) -> tuple[float, ...]:
        k, _p, mb, _s, phase = lay.key[op]
        return (-size[k], -phase, mb)

    def critical(op: int) -> tuple[float, ...]:
        _k, _p, mb, _s, phase = lay.key[op]
        return (-(lay.tail[op] + lay.dur[op]), mb, -phase)

    def backward_critical(op: int) -> tuple[float, ...]:
        _k, _p, mb, _s, phase = lay.key[op]
        return (-phase, -(lay.tail[op] + lay.dur[op]), mb)

    return [("greedy", paper), ("critical-path", critical), ("backward-first", backward_critical)]


def _portfolio(
    problem: FusedProblem, lay: Layout, caps: list[tuple[str, list[int] | None]]
) -> list[tuple[str, Order]]:
    """Start orders from each list-scheduling rule under each cap (those that fit memory)."""
    out = []
    for rule_name, rule in _rules(problem, lay):
        for cap_name, cap in caps:
            order = _list_schedule(problem, lay, rule, cap)
            if order is not None:
                out.append((rule_name + cap_name, order))
    return out


def _stream_starts(problem: FusedProblem, lay: Layout) -> list[tuple[str, Order]]:
    """Start orders that keep every model's own 1F1B order on each stage (its warm-up 0, 2
    or 4 forwards longer; the first model's and the others' chosen apart), the stages
    interleaving the models by each rule; and the serial orders (the models one after the
    other in each order, each in 1F1B) — so a search from these is never worse than they."""
    out = []
    for extra in sorted({(a,) + (b,) * (len(problem.models) - 1) for a in EXTRA for b in EXTRA}):
        streams = one_f_one_b_streams(problem, extra)
        for rule_name, rule in _rules(problem, lay):
            order = _list_schedule(problem, lay, rule, streams=streams)
            if order is not None:
                out.append((f"{STREAMS}+{'/'.join(map(str, extra))}/{rule_name}", order))
    limit = _limit(problem)
    for models in itertools.islice(itertools.permutations(range(len(problem.models))), 6):
        order = serial_order(problem, models)
        if max(peaks(lay, order)) <= limit + 1e-9:
            out.append(("serial-" + "-".join(map(str, models)), order))
    return out


def concurrent_1f1b(problem: FusedProblem) -> FusedSchedule:
    """Every model keeps its own 1F1B order on each stage, the stages run them side by side
    (the paper's greedy picks between ready ops: larger model first, then backward).
    ``ConfigError`` when that deadlocks on the memory limit."""
    lay = layout(problem)
    rule = _rules(problem, lay)[0][1]
    order = _list_schedule(problem, lay, rule, streams=one_f_one_b_streams(problem))
    if order is None:
        raise ConfigError(
            f"concurrent 1F1B does not fit memory_limit={problem.memory_limit}; "
            "serial_1f1b needs the least memory"
        )
    return timed(problem, order, method="concurrent-1f1b")


def _memory_phase(lay: Layout, order: Order, *, iterations: int, rng: random.Random) -> Order:
    """The paper's second annealing: energy = peak memory (max, then sum over stages), moves
    accepted only if the makespan does not grow, the temperature cooling every move. Moves
    swap an ``F`` with the ``B`` right after it (the only adjacent swaps that can lower a
    peak)."""
    finish = simulate(lay, order)
    if finish is None:
        raise ConfigError("the start schedule deadlocks")
    span = max(finish)
    cur = [list(s) for s in order]

    def energy(o: Order) -> tuple[float, float]:
        p = peaks(lay, o)
        return max(p), sum(p)

    e_cur = energy(cur)
    best, e_best = [list(s) for s in cur], e_cur
    temp = max(e_cur[0], 1e-9)
    for _ in range(iterations):
        seq = cur[rng.randrange(len(cur))]
        cands = [
            j
            for j in range(len(seq) - 1)
            if lay.mem[seq[j]] > 0 > lay.mem[seq[j + 1]] and not _dependent(lay, seq[j], seq[j + 1])
        ]
        if not cands:
            continue
        j = cands[rng.randrange(len(cands))]
        seq[j], seq[j + 1] = seq[j + 1], seq[j]
        nf = simulate(lay, cur)
        if nf is None or max(nf) > span + 1e-9:
            seq[j], seq[j + 1] = seq[j + 1], seq[j]
            continue
        e_new = energy(cur)
        if e_new < e_best:
            best, e_best = [list(s) for s in cur], e_new
        delta = (e_cur[0] - e_new[0]) + (e_cur[1] - e_new[1]) / len(cur)
        temp *= 0.99
        if delta >= 0 or math.exp(delta / temp) > rng.random():
            e_cur = e_new
        else:
            seq[j], seq[j + 1] = seq[j + 1], seq[j]
    return best


def _limit(problem: FusedProblem) -> float:
    return math.inf if problem.memory_limit is None else problem.memory_limit


def _dependent(lay: Layout, a: int, b: int) -> bool:
    """``a`` and ``b`` are the F and B of one micro-batch on one stage (a swap deadlocks)."""
    return lay.key[a][:4] == lay.key[b][:4]


def _same_stream(lay: Layout, a: int, b: int) -> bool:
    """Both forwards (or both backwards) of one pipeline: swapping them only renumbers
    micro-batches (FlexFusion's schedule tokens are equal, it never swaps them)."""
    ka, kb = lay.key[a], lay.key[b]
    return ka[:2] == kb[:2] and ka[4] == kb[4]


def _neighbour(
    lay: Layout, cur: Order, limit: float, rng: random.Random, tries: int = 64
) -> tuple[list[int], int, list[float]] | None:
    """Algorithm 2: swap two adjacent ops of a random stage, retried until the schedule is
    valid (distinct streams, no deadlock, memory within ``limit``); the swapped sequence,
    position and new finish times, or None after ``tries`` invalid draws."""
    for _ in range(tries):
        seq = cur[rng.randrange(len(cur))]
        j = rng.randrange(len(seq) - 1)
        a, b = seq[j], seq[j + 1]
        if _same_stream(lay, a, b) or _dependent(lay, a, b) or not swap_fits(lay, seq, j, limit):
            continue
        seq[j], seq[j + 1] = b, a
        finish = simulate(lay, cur)
        if finish is not None:
            return seq, j, finish
        seq[j], seq[j + 1] = a, b
    return None


def _anneal(
    lay: Layout,
    order: Order,
    limit: float,
    *,
    iterations: int,
    temperature: float,
    rng: random.Random,
) -> Order:
    """Algorithm 1 over op orders, as FlexFusion runs it: the temperature cools
    geometrically every iteration, from ``temperature`` to a thousandth of the shortest op
    over ``iterations``; energy = (makespan, sum of finish times) — the sum breaks the
    makespan's ties so that equal-makespan moves toward earlier ops count as better; a worse
    neighbour is accepted with probability ``exp(-makespan increase / T)``."""
    cur = [list(s) for s in order]
    finish = simulate(lay, cur)
    if finish is None:
        raise ConfigError("the start schedule deadlocks")
    e_cur = (max(finish), sum(finish))
    best, e_best = [list(s) for s in cur], e_cur
    temp = temperature
    alpha = (1e-3 * min(lay.dur) / temperature) ** (1 / max(iterations, 1))
    for _ in range(iterations):
        temp *= alpha
        moved = _neighbour(lay, cur, limit, rng)
        if moved is None:
            continue
        seq, j, new_finish = moved
        e_new = (max(new_finish), sum(new_finish))
        if e_new < e_best:
            best, e_best = [list(s) for s in cur], e_new
        if e_new < e_cur or rng.random() < math.exp((e_cur[0] - e_new[0]) / temp):
            e_cur = e_new
        else:
            seq[j], seq[j + 1] = seq[j + 1], seq[j]
    return best


def anneal_schedule(
    problem: FusedProblem,
    start: FusedSchedule | None = None,
    *,
    iterations: int = 2000,
    temperature: float | None = None,
    memory_iterations: int = 0,
    seed: int = 0,
) -> FusedSchedule:
    """The paper's simulated annealing (Algorithms 1-3) from ``start`` (default: greedy) for
    ``iterations`` neighbours, starting at ``temperature``, then ``memory_iterations`` of
    its memory phase. Never longer than ``start``. The default temperature, a quarter of the
    shortest op, suits budgets of thousands of neighbours: FlexFusion starts at 4-200 time
    units (ops of 1-10) but runs millions of neighbours per seed; hotter, a short walk
    wanders off its start and never comes back below it (measured on its instances)."""
    if iterations < 0 or memory_iterations < 0 or (temperature is not None and temperature <= 0):
        raise ConfigError(
            f"anneal_schedule needs iterations >= 0, memory_iterations >= 0 and temperature "
            f"> 0, got {iterations}, {memory_iterations}, {temperature}"
        )
    if start is not None and start.problem != problem:
        raise ConfigError("anneal_schedule's start schedule is for a different problem")
    lay = layout(problem)
    begin = start if start is not None else greedy_schedule(problem)
    rng = random.Random(seed)
    order = _anneal(
        lay,
        order_of(begin),
        _limit(problem),
        iterations=iterations,
        temperature=temperature if temperature is not None else min(lay.dur) / 4,
        rng=rng,
    )
    if memory_iterations:
        order = _memory_phase(lay, order, iterations=memory_iterations, rng=rng)
    return timed(problem, order, method="anneal")


def _scored(lay: Layout, named: list[tuple[str, Order]]) -> list[Candidate]:
    """The deadlock-free ``named`` orders with their (makespan, peak), best first."""
    out = [(_score_of(lay, order), name, order) for name, order in named]
    return sorted((c for c in out if c[0][0] < math.inf), key=lambda c: c[0])


def _candidates(problem: FusedProblem, lay: Layout) -> list[Candidate]:
    """The portfolio, the 1F1B-stream and serial starts, one micro-batch at a time (always
    fits) and the greedy, scored (makespan, peak), best first."""
    named = _portfolio(problem, lay, _cap_sets(problem, lay)) + _stream_starts(problem, lay)
    named.append(("one-at-a-time", _one_at_a_time(lay)))
    if not any(name == "greedy" for name, _order in named):  # it deadlocked uncapped
        named.append(("greedy", order_of(greedy_schedule(problem))))
    return _scored(lay, named)


def _randomised(
    problem: FusedProblem, lay: Layout, samples: int, rng: random.Random
) -> list[Candidate]:
    """``samples`` randomised critical-path list schedules (random keys: each op's rank plus
    uniform noise of a random width, under a random cap), scored, best first."""
    caps = _cap_sets(problem, lay)
    named = []
    for _ in range(samples):
        width = rng.choice((0.5, 1.0, 2.0, 4.0)) * max(lay.dur)
        noise = [rng.random() * width for _ in range(lay.n)]
        cap_name, cap = caps[rng.randrange(len(caps))]

        def noisy(op: int, noise: list[float] = noise) -> tuple[float, ...]:
            return (noise[op] - lay.tail[op] - lay.dur[op],)

        order = _list_schedule(problem, lay, noisy, cap)
        if order is not None:
            named.append((f"randomised{cap_name}", order))
    return _scored(lay, named)


def _justified(lay: Layout, cands: list[Candidate], limit: float, bound: float) -> list[Candidate]:
    """Each candidate justified and rescored, until one reaches ``bound``."""
    out = []
    for _score, name, order in cands:
        order = justify(lay, order, limit)
        out.append((_score_of(lay, order), name + "+justify", order))
        if out[-1][0][0] <= bound * (1 + 1e-9):
            break
    return out


def _score_of(lay: Layout, order: Order) -> tuple[float, float]:
    """(makespan, peak activation) of a deadlock-free order."""
    finish = simulate(lay, order)
    return (math.inf if finish is None else max(finish)), max(peaks(lay, order))


def search_schedule(
    problem: FusedProblem,
    *,
    samples: int = 32,
    starts: int = 3,
    iterations: int = 300,
    memory_iterations: int = 200,
    seed: int = 0,
) -> FusedSchedule:
    """Ours (see the module docstring): candidates, then justification + tabu search +
    justification from the ``starts`` best distinct ones (``iterations`` tabu moves each),
    stopping at the lower bound, then the memory phase."""
    if samples < 0 or starts < 1 or iterations < 0 or memory_iterations < 0:
        raise ConfigError(
            "search_schedule needs samples >= 0, starts >= 1, iterations >= 0 and "
            f"memory_iterations >= 0, got {samples}, {starts}, {iterations}, {memory_iterations}"
        )
    lay = layout(problem)
    bound = lower_bound(problem)
    limit = _limit(problem)
    rng = random.Random(seed)
    cands = _candidates(problem, lay)

    def at_bound(score: tuple[float, float]) -> bool:
        return score[0] <= bound * (1 + 1e-9)

    # justify every 1F1B-stream start, then the best few of the rest: a stream start is
    # slow as built but light, and the room it leaves lets justification pack it, often to
    # the bound; randomised list schedules only if none got there
    pool = [c for c in cands if c[1].startswith(STREAMS)]
    pool += [c for c in cands if not c[1].startswith(STREAMS)][:starts]
    justified = _justified(lay, pool, limit, bound)
    if not any(at_bound(c[0]) for c in justified):
        justified += _justified(lay, _randomised(problem, lay, samples, rng)[:starts], limit, bound)
    justified.sort(key=lambda c: c[0])
    best_score, best_name, best = min(cands[0], justified[0], key=lambda c: c[0])
    seen: set[tuple[float, float]] = set()
    for score, name, order in justified:
        if at_bound(best_score) or len(seen) == starts:
            break
        if score in seen:
            continue
        seen.add(score)
        improved = tabu_search(lay, order, limit, bound, iterations=iterations, rng=rng)
        improved = justify(lay, improved, limit)
        if _score_of(lay, improved) < best_score:
            best_score, best_name, best = _score_of(lay, improved), name + "+tabu", improved
    if memory_iterations:
        best = _memory_phase(lay, best, iterations=memory_iterations, rng=rng)
    return timed(problem, best, method=f"search:{best_name}")

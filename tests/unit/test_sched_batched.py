"""The planner's vectorised kernels: the greedy assignment and the single-move descent run
many layouts at once (a leading row axis); each row must give what it gives alone, and the
descent must stop only where no single move helps (checked by brute force with
:func:`~flowrl.sched.problem.evaluate`, independent of the descent's incremental node
times)."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.sched._greedy import assign_greedy_many, water_fill
from flowrl.sched._refine import refine, refine_many
from flowrl.sched.problem import PlanProblem, evaluate, feasible
from flowrl.sched.solver import assign_greedy, fit_budget
from flowrl.sim.plan_instances import plan_instance

# (seed, gpus, modes, switch costs, latency bound): bulk and tail, with and without switches
INSTANCES = [(0, 16, 3, True, True), (1, 32, 4, False, False), (2, 64, 6, True, False)]


def _instance(seed: int, gpus: int, n_modes: int, switch: bool, tail: bool) -> PlanProblem:
    return plan_instance(
        seed,
        gpus=gpus,
        n_modes=n_modes,
        switch_costs=switch,
        latency_bound=tail,
        requests_per_gpu=4,
        bucket=2048,
    )


def _layouts(p: PlanProblem, k: int, seed: int) -> np.ndarray:
    """``k`` random layouts within the budget with two nodes or more on, some off."""
    rng = np.random.default_rng(seed)
    picks: list[np.ndarray] = []
    while len(picks) < k:
        mode = fit_budget(p, rng.choice(np.r_[p.cand, -1], p.n_nodes))
        if (mode >= 0).sum() >= 2:
            picks.append(mode)
    return np.array(picks, dtype=np.int64)


@pytest.mark.parametrize("case", INSTANCES)
def test_greedy_rows_give_what_they_give_alone(case: tuple) -> None:
    p = _instance(*case)
    modes = np.vstack([_layouts(p, 5, case[0]), np.full((1, p.n_nodes), -1)])
    batched = assign_greedy_many(p, modes)
    assert batched[-1] is None  # no node on: nothing to assign
    for mode, c in zip(modes[:-1], batched[:-1], strict=True):
        alone = assign_greedy(p, mode)
        assert (c is None) == (alone is None)
        if c is not None and alone is not None:
            assert np.array_equal(c, alone)
            assert feasible(p, mode, c) is None


def _no_move_helps(p: PlanProblem, mode: np.ndarray, c: np.ndarray) -> bool:
    """Brute force: no single request moved to a node with KV room for it lowers the
    objective."""
    base = evaluate(p, mode, c).objective
    on = np.flatnonzero(mode >= 0)
    room = p.kv_limit * p.cap[np.maximum(mode, 0)] + 1e-6 - c @ p.kv
    for i in on:
        for d in on[on != i]:
            for b in np.flatnonzero((c[i] > 0) & (p.kv <= room[d])):
                trial = c.copy()
                trial[i, b] -= 1
                trial[d, b] += 1
                if evaluate(p, mode, trial).objective < base - 1e-9:
                    return False
    return True


@pytest.mark.parametrize("case", INSTANCES)
def test_refine_rows_descend_alone_and_stop_at_a_local_optimum(case: tuple) -> None:
    p = _instance(*case)
    modes = _layouts(p, 4, case[0] + 10)
    rng = np.random.default_rng(case[0])
    starts = []
    for mode in modes:  # a scrambled assignment: every bucket's requests on random nodes
        on = np.flatnonzero(mode >= 0)
        c = np.zeros((p.n_nodes, p.n_buckets), dtype=np.int64)
        for b, n in enumerate(p.count):
            np.add.at(c[:, b], rng.choice(on, int(n)), 1)
        starts.append(c)
    out = refine_many(p, modes, np.array(starts), rounds=10_000)
    for mode, c0, c in zip(modes, starts, out, strict=True):
        assert np.array_equal(c, refine(p, mode, c0, rounds=10_000))
        assert np.array_equal(c.sum(axis=0), p.count)
        assert not c[mode < 0].any()
        assert evaluate(p, mode, c).objective <= evaluate(p, mode, c0).objective + 1e-9
        assert _no_move_helps(p, mode, c)


def test_refine_keeps_a_feasible_assignment_feasible() -> None:
    p = _instance(3, 32, 4, True, True)
    modes = _layouts(p, 3, 3)
    starts = [assign_greedy(p, m) for m in modes]
    assert all(c is not None for c in starts)
    for mode, c in zip(modes, refine_many(p, modes, np.array(starts)), strict=True):
        assert feasible(p, mode, c) is None


def test_water_fill_levels_the_loads_within_capacity() -> None:
    loads = np.array([[0.0, 1.0, 5.0, np.inf], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    cost = np.array([[1.0, 1.0, 1.0, np.inf], [1.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    cap = np.array([[9, 9, 9, 0], [9, 9, 9, 9], [1, 0, 1, 0]])
    with np.errstate(invalid="ignore"):  # the off node (inf load and cost)
        out, ok = water_fill(3, loads, cost, cap)
        rows = [water_fill(3, loads[r : r + 1], cost[r : r + 1], cap[r : r + 1]) for r in (0, 1)]
    assert ok.tolist() == [True, True, False]  # row 2 has room for 2 requests, not 3
    # row 0: nodes 0 and 1 fill to a level of 2 (node 2, at 5, takes none)
    assert out[0].tolist() == [2, 1, 0, 0]
    # row 1: three of the four equal nodes take one; the one that ends highest (cost 2) not
    assert out[1].tolist() == [1, 0, 1, 1]
    assert all(np.array_equal(o[0], out[r]) for r, (o, _) in enumerate(rows))

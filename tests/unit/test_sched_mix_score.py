"""The fluid estimate the planner's mode-mix search ranks layouts by
(:mod:`flowrl.sched._mix_score`), checked against hand computations."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flowrl.sched._mix_score import fluid_scores
from flowrl.sim.plan_instances import plan_instance


def _bulk():
    p = plan_instance(0, gpus=32, n_modes=2, switch_costs=False, latency_bound=False)
    return replace(p, mig_weight=0.0, gpu_budget=32)  # no migration term, whole budget


def test_equal_nodes_share_the_work_evenly() -> None:
    p = _bulk()
    m = int(p.cand[p.mode_gpus[p.cand] == 8][0])
    alone = float(p.work[m] @ p.count)
    got = fluid_scores(p, np.full((1, p.n_nodes), m))
    assert got[0] == pytest.approx(alone / p.n_nodes)


def test_a_node_joins_after_its_switch() -> None:
    """Two nodes, one switching for ``s``: ``(T - 0)/W + (T - s)/W = 1`` -> ``T = (W + s)/2``
    while ``s < T``; past that the switching node adds nothing."""
    p = _bulk()
    m = int(p.cand[p.mode_gpus[p.cand] == 8][0])
    w = float(p.work[m] @ p.count)
    layout = np.full(p.n_nodes, -1)
    layout[:2] = m
    for s, want in ((0.2 * w, 0.6 * w), (1.5 * w, w)):
        sw = np.zeros_like(p.switch)
        sw[1, m] = s
        q = replace(p, switch=sw, switch_weight=0.0)
        assert fluid_scores(q, layout[None, :])[0] == pytest.approx(want)


def test_layouts_over_the_budget_or_off_score_inf() -> None:
    p = _bulk()
    m = int(p.cand[p.mode_gpus[p.cand] == 8][0])
    full = np.full(p.n_nodes, m)
    over = replace(p, gpu_budget=8 * p.n_nodes - 1)
    assert np.isinf(fluid_scores(over, full[None, :])[0])
    assert np.isinf(fluid_scores(p, np.full((1, p.n_nodes), -1))[0])
    fewer = full.copy()
    fewer[0] = -1
    assert fluid_scores(p, fewer[None, :])[0] > fluid_scores(p, full[None, :])[0]


def test_tail_layouts_pay_the_longest_buckets_lone_latency() -> None:
    p = plan_instance(0, gpus=32, n_modes=2, switch_costs=False, latency_bound=True)
    m = int(p.cand[p.mode_gpus[p.cand] == 8][0])
    score = fluid_scores(replace(p, mig_weight=0.0), np.full((1, p.n_nodes), m))[0]
    assert score >= float(p.lat[m, p.count > 0].max()) - 1e-9

"""Invariants of the proactive planner (flowrl.sched.planner / problem / solver)."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import (
    ClusterSnapshot,
    PlannerConfig,
    build_problem,
    candidate_modes,
    evaluate,
    feasible,
    plan,
)
from flowrl.sched.solver import assign_greedy, assign_lp, solve_milp, solve_relaxed
from flowrl.sim import ClusterSpec, Scheme, Simulator, Workload

pytest.importorskip("highspy")
pytest.importorskip("statsmodels")

CLUSTER = ClusterSpec(gpus=32)
CFG = PlannerConfig(model=CLUSTER.model, hw=CLUSTER.hw, bs_max=CLUSTER.bs_max)


@pytest.fixture(scope="module")
def captured() -> list[tuple[ClusterSnapshot, np.ndarray, np.ndarray]]:
    sim = Simulator(
        CLUSTER,
        Workload(requests_per_step=1500),
        Scheme(name="p", initial_mode="tp2"),
        steps=1,
        seed=3,
        tick_s=0.5,
        capture_at=(0.0, 0.6, 0.95),
    )
    sim.run()
    return sim.captured


def _problem(snap, exp, tail, cfg=CFG, budget=None):
    cand = candidate_modes(
        snap.modes,
        snap.progress,
        snap.node_mode,
        keep=4,
        mean_ctx=2000.0,
        bs_max=cfg.bs_max,
        model=cfg.model,
        hw=cfg.hw,
    )
    return build_problem(
        snap,
        exp,
        tail=tail,
        cand=cand,
        model=cfg.model,
        hw=cfg.hw,
        bs_max=cfg.bs_max,
        bucket=cfg.bucket,
        kv_tolerance=cfg.kv_tolerance,
        beta=None,
        gpu_budget=budget,
    )


@pytest.mark.parametrize("method", ["greedy", "lp"])
def test_plan_is_feasible_and_never_worse_than_keeping(captured, method: str) -> None:
    for snap, exp, tail in captured:
        snap.validate()
        pl = plan(snap, exp, PlannerConfig(method=method, bs_max=CLUSTER.bs_max), tail=tail)
        p = _problem(snap, exp, tail)
        counts = np.zeros((p.n_nodes, p.n_buckets), dtype=np.int64)
        np.add.at(counts, (pl.target_node, p.req_bucket), 1)
        assert feasible(p, pl.node_mode, counts) is None or not pl.apply
        assert pl.predicted.objective <= pl.keep.objective
        if pl.apply:
            assert pl.predicted.objective < pl.keep.objective * (1 - CFG.min_gain)
            gpus = p.mode_gpus[pl.node_mode[pl.node_mode >= 0]].sum()
            assert gpus <= p.gpu_budget
        else:
            assert np.array_equal(pl.node_mode, snap.node_mode)
            assert np.array_equal(pl.target_node, p.req_node)


def test_solvers_respect_budget_and_kv(captured) -> None:
    snap, exp, tail = captured[1]
    p = _problem(snap, exp, tail, budget=24)  # one node must go off
    for mode in (np.array([1, 1, 1, -1]), np.array([3, 1, 1, -1])):
        for assign in (assign_greedy, assign_lp):
            c = assign(p, mode)
            assert c is not None
            assert feasible(p, mode, c) is None
    sol = solve_relaxed(p, deadline=float("inf"))
    assert sol is not None and feasible(p, sol.mode, sol.counts) is None
    assert int(p.mode_gpus[sol.mode[sol.mode >= 0]].sum()) <= 24


def test_milp_rounding_feasible_and_bounded_by_exact(captured) -> None:
    snap, exp, tail = captured[2]
    p = _problem(snap, exp, tail)
    fast = solve_relaxed(p, deadline=float("inf"))
    exact = solve_milp(p, time_limit=20.0, start=fast)
    assert fast is not None and exact is not None
    assert feasible(p, fast.mode, fast.counts) is None
    assert feasible(p, exact.mode, exact.counts) is None
    assert exact.objective <= fast.objective + 1e-6  # warm-started: never worse
    assert exact.bound <= exact.objective + 1e-6


def test_realised_targets_match_counts(captured) -> None:
    snap, exp, tail = captured[2]
    pl = plan(snap, exp, CFG, tail=tail)
    p = _problem(snap, exp, tail)
    counts = np.zeros((p.n_nodes, p.n_buckets), dtype=np.int64)
    np.add.at(counts, (pl.target_node, p.req_bucket), 1)
    assert evaluate(p, pl.node_mode, counts).objective == pytest.approx(pl.predicted.objective)


def test_wave_pruning_prefers_throughput_early_latency_late() -> None:
    modes = CLUSTER.modes
    none = np.array([-1])
    early = candidate_modes(
        modes, 0.0, none, keep=1, mean_ctx=3000, bs_max=256, model=CFG.model, hw=CFG.hw
    )
    late = candidate_modes(
        modes, 1.0, none, keep=1, mean_ctx=3000, bs_max=256, model=CFG.model, hw=CFG.hw
    )
    assert modes[early[0]].tp < modes[late[0]].tp
    kept = candidate_modes(
        modes, 1.0, np.array([0]), keep=1, mean_ctx=3000, bs_max=256, model=CFG.model, hw=CFG.hw
    )
    assert 0 in kept  # current modes always stay representable


def test_bad_inputs_raise(captured) -> None:
    snap, exp, _ = captured[0]
    with pytest.raises(ConfigError, match="remaining has"):
        plan(snap, exp[:-1], CFG)
    with pytest.raises(ConfigError):
        PlannerConfig(time_limit=0)

"""Invariants of the proactive planner (flowrl.sched.planner / problem / solver)."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import (
    ClusterSnapshot,
    PlannerConfig,
    RemainingEstimate,
    _highs,
    build_problem,
    candidate_modes,
    evaluate,
    feasible,
    plan,
)
from flowrl.sched.problem import node_times
from flowrl.sched.solver import _full_model, assign_greedy, assign_lp, solve_milp, solve_relaxed
from flowrl.sim import ClusterSpec, Scheme, Simulator, Workload
from flowrl.sim.plan_instances import plan_instance

pytest.importorskip("highspy")

CLUSTER = ClusterSpec(gpus=32)
CFG = PlannerConfig(model=CLUSTER.model, hw=CLUSTER.hw, bs_max=CLUSTER.bs_max)


@pytest.fixture(scope="module")
def captured() -> list[tuple[ClusterSnapshot, RemainingEstimate]]:
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


def _problem(snap, est, cfg=CFG, budget=None, latency_bound=True):
    return build_problem(
        snap,
        est,
        cand=np.arange(len(snap.modes)),
        model=cfg.model,
        hw=cfg.hw,
        bs_max=cfg.bs_max,
        bucket=cfg.bucket,
        kv_tolerance=cfg.kv_tolerance,
        mig_weight=cfg.migration_weight,
        switch_weight=None,
        gpu_budget=budget,
        latency_bound=latency_bound,
    )


@pytest.mark.parametrize("method", ["greedy", "lp"])
def test_plan_is_feasible_and_never_worse_than_keeping(captured, method: str) -> None:
    for snap, est in captured:
        snap.validate()
        cfg = PlannerConfig(method=method, bs_max=CLUSTER.bs_max)
        pl = plan(snap, est, cfg)
        _, tail = candidate_modes(
            snap.modes,
            len(snap.requests),
            snap.node_gpus,
            snap.node_mode,
            keep=cfg.keep_modes,
            mean_ctx=float(np.mean(snap.requests.context + est.mean / 2)),
            bs_max=cfg.bs_max,
            model=cfg.model,
            hw=cfg.hw,
        )
        p = _problem(snap, est, latency_bound=tail)
        counts = np.zeros((p.n_nodes, p.n_buckets), dtype=np.int64)
        np.add.at(counts, (pl.target_node, p.req_bucket), 1)
        assert feasible(p, pl.node_mode, counts) is None
        assert pl.predicted.objective <= pl.keep.objective
        assert evaluate(p, pl.node_mode, counts).objective == pytest.approx(pl.predicted.objective)
        if pl.apply:
            assert pl.predicted.objective < pl.keep.objective * (1 - CFG.min_gain)
            gpus = p.mode_gpus[pl.node_mode[pl.node_mode >= 0]].sum()
            assert gpus <= p.gpu_budget
        else:
            assert np.array_equal(pl.node_mode, snap.node_mode)
            assert np.array_equal(pl.target_node, p.req_node)
        assert plan(snap, est, cfg).target_node.tolist() == pl.target_node.tolist()  # pure


def test_solvers_respect_budget_and_kv(captured) -> None:
    snap, est = captured[1]
    p = _problem(snap, est, budget=24)  # one node must go off
    for mode in (np.array([1, 1, 1, -1]), np.array([3, 1, 1, -1])):
        for assign in (assign_greedy, assign_lp):
            c = assign(p, mode)
            assert c is not None
            assert feasible(p, mode, c) is None
    sol = solve_relaxed(p)
    assert sol is not None and feasible(p, sol.mode, sol.counts) is None
    assert int(p.mode_gpus[sol.mode[sol.mode >= 0]].sum()) <= 24


def test_milp_rounding_feasible_and_bounded_by_exact(captured) -> None:
    snap, est = captured[2]
    p = _problem(snap, est)
    fast = solve_relaxed(p)
    exact = solve_milp(p, time_limit=20.0)  # from scratch: not seeded by the plan it checks
    assert fast is not None and exact is not None
    assert feasible(p, fast.mode, fast.counts) is None
    assert feasible(p, exact.mode, exact.counts) is None
    assert exact.bound <= fast.objective + 1e-6  # a proven bound holds for any plan
    assert exact.bound <= exact.objective + 1e-6


def test_node_time_model_invariants(captured) -> None:
    snap, est = captured[2]
    p = _problem(snap, est)
    for coef in (p.work, p.co, p.lat, p.kv, p.mig, p.switch):
        assert np.all(coef >= 0)
    assert np.all(p.work >= p.co)  # saturated cost includes the per-iteration share
    mode = np.maximum(p.current, 0)
    c = p.holdings.copy()
    base = node_times(p, mode, c)
    for b in range(p.n_buckets):  # one more request never makes a node finish earlier
        more = c.copy()
        more[0, b] += 1
        assert np.all(node_times(p, mode, more) >= base - 1e-12)
    bulk = _problem(snap, est, latency_bound=False)
    assert not bulk.lat.any() and not bulk.co.any()


def test_second_moment_raises_predicted_work(captured) -> None:
    snap, est = captured[1]
    flat = RemainingEstimate(est.mean, est.mean**2, est.tail)
    assert np.all(_problem(snap, est).work >= _problem(snap, flat).work - 1e-12)
    assert np.any(_problem(snap, est).work > _problem(snap, flat).work)


def test_wave_pruning_prefers_throughput_in_bulk_latency_in_tail() -> None:
    modes = CLUSTER.modes
    gpus = np.full(4, 8)
    none = np.array([-1])
    kw = dict(keep=1, mean_ctx=3000, bs_max=256, model=CFG.model, hw=CFG.hw)
    early, in_tail = candidate_modes(modes, 50_000, gpus, none, **kw)
    late, tail = candidate_modes(modes, 10, gpus, none, **kw)
    assert not in_tail and tail
    assert modes[early[0]].tp < modes[late[0]].tp
    kept, _ = candidate_modes(modes, 10, gpus, np.array([0]), **kw)
    assert 0 in kept  # current modes always stay representable


def test_bad_inputs_raise(captured) -> None:
    snap, est = captured[0]
    short = RemainingEstimate(est.mean[:-1], est.second[:-1], est.tail[:-1])
    with pytest.raises(ConfigError, match="estimate has"):
        plan(snap, short, CFG)
    with pytest.raises(ConfigError):
        PlannerConfig(time_limit=0)
    with pytest.raises(ConfigError):
        RemainingEstimate(est.mean, est.second[:-1], est.tail)


@pytest.mark.parametrize("tail", [True, False])
def test_relaxation_without_presence_variables_has_the_same_optimum(tail: bool) -> None:
    """The mode-mix LP drops the presence variables (``z = c / N_b`` is optimal in the
    relaxation): the optimum must be the full model's LP relaxation's."""
    p = plan_instance(4, gpus=32, n_modes=4, switch_costs=True, latency_bound=tail)
    got = []
    for relaxed in (False, True):
        _, cost, a, lo, hi, clo, chi, _ = _full_model(p, relaxed=relaxed)
        res = _highs.solve(cost, a, lo, hi, clo, chi)  # no integrality: the LP relaxation
        assert res.status == "Optimal"
        got.append(res.objective)
    assert got[1] == pytest.approx(got[0], rel=1e-9)

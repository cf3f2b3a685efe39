"""benchmarks/sched_headroom.py's probes at a tiny size: the clairvoyant one must be a valid
run of the simulator (every request finishes once) that lays the step out by true length
and ends in TP8; its predictor ranks by a predictor of the given correlation; the oracle
run hands the planner and balancer the true remaining lengths (the figures belong to the
benchmark)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from flowrl.events import Put
from flowrl.sim.engine import DONE

BENCHMARK = "sched_headroom"  # the conftest's ``bench`` fixture imports it


def test_clairvoyant_probe_runs_every_request_once_and_ends_in_tp8(bench: ModuleType) -> None:
    sim = bench.clairvoyant_sim(1, 0.05, 0.2, seed=3, gpus=16, requests=400)
    events: list[Put] = []
    sim._observers.append(lambda ev: events.append(ev) if isinstance(ev, Put) else None)
    placed: dict[str, np.ndarray] = {}
    replan = sim._replan

    def spy(s: int, t: float, total: int, finished: int) -> None:
        replan(s, t, total, finished)
        if not placed:  # the layout right after step start
            placed["node"] = sim.st.rep // sim.slots
            placed["length"] = sim.st.length.copy()

    sim._replan = spy  # type: ignore[method-assign]
    result = sim.run()
    done = [i for ev in events if ev.columns == ("response",) for i in ev.indices]
    assert sorted(done) == list(range(400))
    longest = np.argsort(-placed["length"], kind="stable")[:20]
    assert (placed["node"][longest] == 0).all()  # the dedicated node holds the top 5 %
    assert (placed["node"][np.setdiff1d(np.arange(400), longest)] == 1).all()
    tp8 = sim.c.mode_index("tp8")
    assert (sim.node_mode == tp8).all() and result.steps[0].makespan > 0


def test_blind_probe_starts_in_tp2_everywhere_and_ends_in_tp8(bench: ModuleType) -> None:
    """No dedicated nodes: the blind policy sees only how many requests finished."""
    sim = bench.clairvoyant_sim(0, 0.0, 0.2, seed=3, gpus=16, requests=400)
    modes: list[np.ndarray] = []
    replan = sim._replan

    def spy(s: int, t: float, total: int, finished: int) -> None:
        replan(s, t, total, finished)
        if not modes:
            modes.append(sim.node_mode.copy())

    sim._replan = spy  # type: ignore[method-assign]
    result = sim.run()
    assert (modes[0] == sim.c.mode_index("tp2")).all()
    assert (sim.node_mode == sim.c.mode_index("tp8")).all() and result.steps[0].makespan > 0


def test_predictor_ablation_ranks_by_a_predictor_of_the_given_correlation(
    bench: ModuleType,
) -> None:
    """rho=1 ranks by the true length; lower correlations rank by a noisier predictor,
    rho=0 at random (the ablation of how much length knowledge the headroom needs)."""
    length = np.random.default_rng(5).lognormal(7.0, 1.0, 2000).astype(np.int64) + 1
    true_top = set(np.argsort(-length, kind="stable")[:100])
    hits = {}
    for rho in (1.0, 0.9, 0.0):
        order = bench.predicted_order(length, rho, 3)
        assert sorted(order) == list(range(2000))
        hits[rho] = len(true_top & set(order[:100]))
    assert hits[1.0] == 100 > hits[0.9] > hits[0.0]


def test_oracle_run_tells_the_planner_and_balancer_the_true_remaining_lengths(
    bench: ModuleType,
) -> None:
    sim = bench.oracle_sim(3, gpus=16, requests=400)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    estimates = sim.forecaster.estimates

    def spy(*args: object, **kw: object) -> object:
        est = estimates(*args, **kw)
        pending = np.nonzero(sim.st.state != DONE)[0]
        seen.append((est.mean, sim.st.length[pending] - sim.st.gen[pending]))
        return est

    sim.forecaster.estimates = spy
    result = sim.run()
    assert result.plans > 0 and len(seen) >= result.plans
    for got, true in seen:
        assert np.array_equal(got, true)

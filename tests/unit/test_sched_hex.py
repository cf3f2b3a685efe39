"""Invariants of heterogeneous allocation (AReaL-Hex): the rollout MILP and the knapsack are
optimal (brute force over replica counts), plans respect GPU counts, the exhaustive split
search is never slower than the paper's bisection, bad input is refused."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import HardwareSpec, ModelSpec
from flowrl.sched.hex_alloc import (
    GpuPool,
    HexWorkload,
    allocate,
    replica_configs,
    search_training,
    solve_rollout,
)

pytest.importorskip("highspy")

H800 = HardwareSpec()
H20 = HardwareSpec(hbm_bytes=96e9, hbm_bw=4.0e12, flops=148e12)
SMALL = ModelSpec(name="dense-7b", params=7.6e9, layers=28, hidden=3584, n_heads=28, n_kv_heads=4)


def _workload(n: int = 256, seed: int = 0) -> HexWorkload:
    rng = np.random.default_rng(seed)
    lens = np.minimum(np.exp(rng.normal(np.log(1200), 1.0, size=n)), 8192).round()
    return HexWorkload(model=SMALL, rollouts=512, prompt_tokens=256, response_lengths=tuple(lens))


def _pools(a: int, b: int) -> list[GpuPool]:
    return [
        GpuPool(name="H800", hw=H800, count=a, price_per_hour=5.28),
        GpuPool(name="H20", hw=H20, count=b, price_per_hour=1.85),
    ]


def _brute_force(
    pools: list[GpuPool], counts: tuple[int, ...], wl: HexWorkload, tails: bool
) -> float:
    configs = [c for c in replica_configs(pools, wl) if counts[c.pool] >= c.tp]
    best = float("inf")
    ranges = [range(counts[c.pool] // c.tp + 1) for c in configs]
    for y in itertools.product(*ranges):
        used = [0] * len(pools)
        for c, n in zip(configs, y, strict=True):
            used[c.pool] += c.tp * n
        if any(u > k for u, k in zip(used, counts, strict=True)):
            continue
        rate = sum(c.rate * n for c, n in zip(configs, y, strict=True))
        if rate <= 0:
            continue
        tail = max((c.tail_s for c, n in zip(configs, y, strict=True) if n), default=0.0)
        best = min(best, max(wl.rollouts * wl.mean_length / rate, tail if tails else 0.0))
    return best


@pytest.mark.parametrize("counts", [(2, 3), (4, 2), (3, 5), (0, 6)])
@pytest.mark.parametrize("tails", [True, False])
def test_milp_and_knapsack_are_optimal_against_brute_force(
    counts: tuple[int, int], tails: bool
) -> None:
    pools = _pools(8, 8)
    wl = _workload()
    truth = _brute_force(pools, counts, wl, tails)
    for method in ("milp", "knapsack"):
        plan = solve_rollout(pools, counts, wl, method=method, stragglers=tails)  # type: ignore[arg-type]
        assert plan.makespan == pytest.approx(truth, rel=1e-6), method
        used = [0, 0]
        for c, n in zip(plan.configs, plan.replicas, strict=True):
            used[c.pool] += c.tp * n
        assert all(u <= k for u, k in zip(used, counts, strict=True))
        assert sum(plan.assigned) == pytest.approx(wl.rollouts)
        for c, n, x in zip(plan.configs, plan.replicas, plan.assigned, strict=True):
            if n == 0:
                assert x == 0
            else:  # nobody's share outlasts the makespan
                assert x * wl.mean_length / (c.rate * n) <= plan.makespan * (1 + 1e-9)


def test_straggler_term_changes_the_plan_when_the_tail_dominates() -> None:
    pools = _pools(8, 8)
    long_tail = HexWorkload(
        model=SMALL, rollouts=64, prompt_tokens=256, response_lengths=(500.0,) * 63 + (30000.0,)
    )
    with_tail = solve_rollout(pools, (4, 4), long_tail)
    without = solve_rollout(pools, (4, 4), long_tail, stragglers=False)
    assert with_tail.makespan >= without.makespan
    # with the tail modelled, no used configuration decodes the longest response slower
    # than the chosen makespan
    assert all(
        c.tail_s <= with_tail.makespan + 1e-9
        for c, n in zip(with_tail.configs, with_tail.replicas, strict=True)
        if n
    )


def test_training_search_uses_exactly_the_gpus_and_fits_memory() -> None:
    pools = _pools(16, 16)
    wl = _workload()
    plan = search_training(pools, (8, 8), wl)
    assert plan is not None
    for (tp, stages), n in zip(plan.stages, (8, 8), strict=True):
        assert tp * stages * plan.dp == n
    assert search_training(pools, (0, 0), wl) is None
    # a 14B model does not train on one GPU: weights, grads and Adam states exceed 80 GB
    big = HexWorkload(model=ModelSpec(), response_lengths=(1000.0,))
    assert search_training(_pools(1, 0), (1, 0), big) is None


def test_allocate_exhaustive_is_never_slower_than_bisection() -> None:
    wl = _workload()
    for a, b in [(16, 16), (8, 24), (24, 8)]:
        pools = _pools(a, b)
        ours = allocate(pools, wl)
        paper = allocate(pools, wl, method="bisect")
        assert ours.step_s <= paper.step_s * (1 + 1e-9)
        for plan in (ours, paper):
            assert all(
                t + r == p.count
                for t, r, p in zip(plan.train_gpus, plan.rollout_gpus, pools, strict=True)
            )
            assert plan.step_s == max(plan.train_s, plan.rollout_s)
            assert plan.tokens_per_dollar == pytest.approx(
                plan.tokens_per_s * 3600 / plan.cost_per_hour
            )


def test_allocate_exhaustive_matches_evaluating_every_split() -> None:
    wl = _workload()
    pools = _pools(16, 8)
    ours = allocate(pools, wl)
    best = float("inf")
    for t800, t20 in itertools.product(range(0, 17, 8), range(0, 9, 8)):
        if 0 < t800 + t20 < 24:
            train = search_training(pools, (t800, t20), wl)
            if train is None:
                continue
            try:
                roll = solve_rollout(pools, (16 - t800, 8 - t20), wl)
            except ConfigError:
                continue
            c_i = roll.makespan + wl.model.weight_bytes / wl.sync_bw
            best = min(best, max(train.step_s, c_i))
    assert ours.step_s == pytest.approx(best)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="count"):
        GpuPool(name="x", hw=H800, count=-1, price_per_hour=1.0)
    with pytest.raises(ConfigError, match="response_lengths"):
        HexWorkload(response_lengths=())
    with pytest.raises(ConfigError, match="one GPU count per pool"):
        solve_rollout(_pools(8, 8), (1,), _workload())
    with pytest.raises(ConfigError, match="has 8 GPUs"):
        solve_rollout(_pools(8, 8), (9, 0), _workload())
    with pytest.raises(ConfigError, match="method"):
        allocate(_pools(8, 8), _workload(), method="anneal")  # type: ignore[arg-type]
    small = HardwareSpec(hbm_bytes=8e9)  # TP8 holds the weights, nothing holds Adam states
    with pytest.raises(ConfigError, match="training memory"):
        allocate([GpuPool(name="s", hw=small, count=16, price_per_hour=1.0)], _workload())
    tiny = HardwareSpec(hbm_bytes=1e9)
    with pytest.raises(ConfigError, match="no GPU type"):
        allocate([GpuPool(name="t", hw=tiny, count=8, price_per_hour=1.0)], _workload())


def test_a_solve_prints_nothing_on_stdout() -> None:
    """HiGHS's banner (printed from C on the first solver) would corrupt a caller's --json."""
    pytest.importorskip("highspy")
    code = (
        "import numpy as np; from flowrl.sched import _highs; "
        "r = _highs.solve(np.array([1.0]), np.array([[1.0]]), np.array([1.0]), "
        "np.array([np.inf]), np.array([0.0]), np.array([10.0])); print(r.ok)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "True\n"

"""Heterogeneous allocation (AReaL-Hex) against an independent exact reference
(``hex_oracle``: its own enumeration of replicas and splits, its own MILP by bisection on the
step, solved from scratch): ``allocate`` reaches the optimum of the full model (length classes,
cross-type and pipelined replicas, the split), its predicted makespan is the plan's true one,
plans respect GPU counts, replica costs agree with the cost model, bad input is refused."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import HardwareSpec, ModelSpec
from flowrl.sched.costmodel import ParallelMode, latency_per_token, saturated_token_rate
from flowrl.sched.hex_alloc import (
    GpuPool,
    HexWorkload,
    allocate,
    length_classes,
    replica_config,
    replica_configs,
    search_training,
    solve_rollout,
)

pytest.importorskip("highspy")
from hex_oracle import all_configs, reference, true_makespan

H800 = HardwareSpec()
H20 = HardwareSpec(hbm_bytes=96e9, hbm_bw=4.0e12, flops=148e12)
A100 = HardwareSpec(hbm_bytes=80e9, hbm_bw=2.0e12, flops=312e12)
L40S = HardwareSpec(hbm_bytes=48e9, hbm_bw=0.864e12, flops=362e12, link_bw=32e9)
HWS = {"H800": H800, "H20": H20, "A100": A100, "L40S": L40S}
PRICES = {"H800": 5.28, "H20": 1.85, "A100": 2.0, "L40S": 1.2}
SMALL = ModelSpec(name="dense-7b", params=7.6e9, layers=28, hidden=3584, n_heads=28, n_kv_heads=4)


def _workload(
    rollouts: int = 512, cap: float = 8192, seed: int = 0, model: ModelSpec = SMALL
) -> HexWorkload:
    rng = np.random.default_rng(seed)
    lens = np.minimum(np.exp(rng.normal(np.log(1200), 1.0, size=256)), cap).round()
    return HexWorkload(
        model=model, rollouts=rollouts, prompt_tokens=256, response_lengths=tuple(lens)
    )


def _pools(**counts: int) -> list[GpuPool]:
    return [
        GpuPool(name=k, hw=HWS[k], count=n, price_per_hour=PRICES[k]) for k, n in counts.items()
    ]


def _pools2(a: int, b: int) -> list[GpuPool]:
    return _pools(H800=a, H20=b)


# 24-96 GPUs, 2-4 types, partial nodes; tail-bound, throughput-bound and training-bound steps
INSTANCES = [
    ("24 gpus, 2 types", _pools(H800=16, H20=8), _workload(2048, 4096), True),
    ("32 gpus, 2 types, partial nodes", _pools(H800=12, H20=20), _workload(4096, 2048), True),
    ("64 gpus, 3 types", _pools(H800=24, H20=24, A100=16), _workload(4096, 4096, 1), True),
    (
        "64 gpus, 4 types, no stragglers",
        _pools(H800=16, H20=16, A100=16, L40S=16),
        _workload(4096, 8192, 2),
        False,
    ),
    (
        "96 gpus, 3 types, 14B",
        _pools(H800=32, H20=32, L40S=32),
        _workload(4096, 8192, 3, ModelSpec()),
        True,
    ),
]


@pytest.mark.parametrize(
    ("name", "pools", "wl", "stragglers"), INSTANCES, ids=[i[0] for i in INSTANCES]
)
def test_allocate_reaches_the_exact_optimum(
    name: str, pools: list[GpuPool], wl: HexWorkload, stragglers: bool
) -> None:
    plan = allocate(pools, wl, stragglers=stragglers)
    ref = reference(pools, wl, stragglers=stragglers)
    # the reference brackets the optimum in (lo, hi]; the allocator's plan is a feasible plan
    assert ref.lo * (1 - 1e-6) <= plan.step_s <= ref.hi * (1 + 1e-5), (plan.step_s, ref)
    # what the allocator predicts is what its replicas achieve
    truth = true_makespan(plan.rollout.configs, plan.rollout.replicas, wl, stragglers)
    assert plan.rollout.makespan == pytest.approx(truth, rel=1e-6)
    assert plan.step_s == pytest.approx(max(plan.train_s, plan.rollout_s))
    assert plan.rollout_s == pytest.approx(plan.rollout.makespan + wl.fixed_s)
    # GPUs: training and replicas within each pool
    used = np.array(plan.train_gpus) + sum(
        np.array(c.gpus) * n
        for c, n in zip(plan.rollout.configs, plan.rollout.replicas, strict=True)
    )
    assert np.all(used <= [p.count for p in pools])
    for (tp, stages), n in zip(plan.train.stages, plan.train_gpus, strict=True):
        assert tp * stages * plan.train.dp == n
    # every class is generated in full, nobody's load outlasts the makespan
    for w, cls in enumerate(plan.rollout.classes):
        assert sum(a[w] for a in plan.rollout.assigned) == pytest.approx(cls.rollouts)
    for c, n, a in zip(
        plan.rollout.configs, plan.rollout.replicas, plan.rollout.assigned, strict=True
    ):
        load = sum(x * s for x, s in zip(a, c.seconds, strict=True) if x > 0)
        assert load <= n * plan.rollout.makespan * (1 + 1e-6)
        if stragglers:
            assert all(
                c.tail_s[w] <= plan.rollout.makespan * (1 + 1e-9)
                for w, x in enumerate(a)
                if x > 1e-6
            )
    assert plan.tokens_per_dollar == pytest.approx(plan.tokens_per_s * 3600 / plan.cost_per_hour)


def test_bisection_is_feasible_and_never_beats_the_optimum() -> None:
    pools, wl = _pools(H800=24, H20=24), _workload(4096, 4096)
    ref = reference(pools, wl)
    paper = allocate(pools, wl, method="bisect")
    assert paper.step_s >= ref.lo * (1 - 1e-6)
    truth = true_makespan(paper.rollout.configs, paper.rollout.replicas, wl)
    assert paper.rollout.makespan == pytest.approx(truth, rel=1e-6)


@pytest.mark.parametrize("counts", [(2, 3), (0, 6)])
def test_solve_rollout_is_optimal_against_brute_force(counts: tuple[int, int]) -> None:
    pools, wl = _pools2(8, 8), _workload(1024, 4096)
    plan = solve_rollout(pools, counts, wl, max_stages=1)
    configs = [
        c
        for p, tp in itertools.product(range(2), (1, 2, 4))
        if tp <= counts[p] and (c := replica_config(((p, tp),), pools, wl)) is not None
    ]
    best = np.inf
    for y in itertools.product(
        *[range(counts[c.stages[0][0]] // c.gpus[c.stages[0][0]] + 1) for c in configs]
    ):
        used = sum(np.array(c.gpus) * n for c, n in zip(configs, y, strict=True))
        if any(y) and np.all(used <= counts):
            best = min(best, true_makespan(tuple(configs), y, wl))
    assert plan.makespan == pytest.approx(best, rel=1e-6)


def test_single_stage_costs_agree_with_the_cost_model() -> None:
    wl = HexWorkload(model=SMALL, rollouts=64, prompt_tokens=256, response_lengths=(1000.0,) * 3)
    (cls,) = length_classes(wl)
    pools = _pools(H800=8, H20=8)
    for p, tp in [(0, 1), (0, 4), (1, 2)]:
        cfg = replica_config(((p, tp),), pools, wl)
        assert cfg is not None
        ctx = wl.prompt_tokens + cls.mean_length / 2
        mode = ParallelMode.tensor(tp)
        rate = saturated_token_rate(mode, ctx, wl.bs_max, SMALL, pools[p].hw)
        assert cfg.seconds[0] == pytest.approx(cls.mean_length / rate, rel=1e-9)
        lone = latency_per_token(mode, wl.prompt_tokens + cls.max_length / 2, SMALL, pools[p].hw)
        assert cfg.tail_s[0] == pytest.approx(cls.max_length * float(lone), rel=1e-9)
        assert cfg.gpus[p] == tp and sum(cfg.gpus) == tp


def test_length_classes_split_the_rollouts_and_long_classes_run_slower() -> None:
    wl = _workload(4096, 16384)
    classes = length_classes(wl)
    assert sum(c.rollouts for c in classes) == pytest.approx(wl.rollouts)
    assert sum(c.rollouts * c.mean_length for c in classes) == pytest.approx(
        wl.rollouts * wl.mean_length
    )
    assert [c.mean_length for c in classes] == sorted(c.mean_length for c in classes)
    cfg = replica_config(((1, 1),), _pools2(8, 8), wl)
    assert cfg is not None
    per_token = [s / c.mean_length for s, c in zip(cfg.seconds, classes, strict=True)]
    assert per_token == sorted(per_token)  # longer contexts: fewer sequences, slower steps


def test_pipelined_cross_type_replicas_hold_what_no_single_node_holds() -> None:
    # 70B in bf16 (140 GB) exceeds an 8 x 16 GB node; two nodes of different types hold it
    big = ModelSpec(name="dense-70b", params=70e9, layers=80, hidden=8192, n_heads=64, n_kv_heads=8)
    small_a = HardwareSpec(hbm_bytes=16e9, hbm_bw=0.9e12, flops=120e12)
    small_b = HardwareSpec(hbm_bytes=12e9, hbm_bw=0.6e12, flops=60e12)
    pools = [
        GpuPool(name="a", hw=small_a, count=16, price_per_hour=1.0),
        GpuPool(name="b", hw=small_b, count=16, price_per_hour=1.0),
    ]
    wl = HexWorkload(model=big, rollouts=64, prompt_tokens=128, response_lengths=(256.0, 512.0))
    assert replica_configs(pools, wl, max_stages=1) == []
    configs = replica_configs(pools, wl, max_stages=2)
    assert configs and all(len(c.stages) == 2 for c in configs)
    cross = [c for c in configs if c.gpus[0] and c.gpus[1]]
    assert cross and sum(cross[0].layers) == big.layers
    plan = solve_rollout(pools, (16, 16), wl)
    # brute force over the counts of every two-stage replica, each evaluated exactly
    every = tuple(all_configs(pools, wl, 2))
    best = np.inf
    for y in itertools.product(*[range(3)] * len(every)):
        used = sum(np.array(c.gpus) * n for c, n in zip(every, y, strict=True))
        if any(y) and np.all(used <= 16):
            best = min(best, true_makespan(every, y, wl))
    assert plan.makespan == pytest.approx(best, rel=1e-6)


def test_training_search_uses_exactly_the_gpus_and_fits_memory() -> None:
    pools = _pools2(16, 16)
    wl = _workload()
    plan = search_training(pools, (8, 8), wl)
    assert plan is not None
    for (tp, stages), n in zip(plan.stages, (8, 8), strict=True):
        assert tp * stages * plan.dp == n
    assert search_training(pools, (0, 0), wl) is None
    # a 14B model does not train on one GPU: weights, grads and Adam states exceed 80 GB
    big = HexWorkload(model=ModelSpec(), response_lengths=(1000.0,))
    assert search_training(_pools2(1, 0), (1, 0), big) is None


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="count"):
        GpuPool(name="x", hw=H800, count=-1, price_per_hour=1.0)
    with pytest.raises(ConfigError, match="response_lengths"):
        HexWorkload(response_lengths=())
    with pytest.raises(ConfigError, match="length_classes"):
        HexWorkload(length_classes=0)
    with pytest.raises(ConfigError, match="one GPU count per pool"):
        solve_rollout(_pools2(8, 8), (1,), _workload())
    with pytest.raises(ConfigError, match="has 8 GPUs"):
        solve_rollout(_pools2(8, 8), (9, 0), _workload())
    with pytest.raises(ConfigError, match="max_stages"):
        allocate(_pools2(8, 8), _workload(), max_stages=0)
    with pytest.raises(ConfigError, match="method"):
        allocate(_pools2(8, 8), _workload(), method="anneal")  # type: ignore[arg-type]
    small = HardwareSpec(hbm_bytes=8e9)  # TP8 holds the weights, nothing holds Adam states
    with pytest.raises(ConfigError, match="training memory"):
        allocate([GpuPool(name="s", hw=small, count=16, price_per_hour=1.0)], _workload())
    tiny = HardwareSpec(hbm_bytes=1e9)
    with pytest.raises(ConfigError, match="no GPU type"):
        allocate([GpuPool(name="t", hw=tiny, count=8, price_per_hour=1.0)], _workload())


def test_a_solve_prints_nothing_on_stdout() -> None:
    """HiGHS's banner (printed from C on the first solver) would corrupt a caller's --json."""
    code = (
        "import numpy as np; from flowrl.sched import _highs; "
        "r = _highs.solve(np.array([1.0]), np.array([[1.0]]), np.array([1.0]), "
        "np.array([np.inf]), np.array([0.0]), np.array([10.0])); print(r.ok)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "True\n"

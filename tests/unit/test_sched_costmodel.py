"""Invariants of flowrl.sched.costmodel (see its module docstring)."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    kv_capacity_tokens,
    kv_move_cost,
    latency_per_token,
    saturated_token_rate,
    step_time,
    switch_time,
)

M, HW = ModelSpec(), HardwareSpec()
TP = [ParallelMode.tensor(t) for t in (1, 2, 4, 8)]


@pytest.mark.parametrize("mode", TP)
def test_step_time_positive_and_monotone(mode: ParallelMode) -> None:
    b = np.arange(1, 300)
    t_b = step_time(mode, b, 1000 * b, M, HW)
    assert np.all(t_b > 0) and np.all(np.diff(t_b) >= 0)
    k = np.linspace(0, 5e5, 50)
    t_k = step_time(mode, 64, k, M, HW)
    assert np.all(np.diff(t_k) >= 0)


def test_large_tp_wins_latency_small_tp_wins_throughput() -> None:
    lat = [float(latency_per_token(m, 10_000, M, HW)) for m in TP]
    assert lat == sorted(lat, reverse=True)
    per_gpu = [saturated_token_rate(m, 3000, 256, M, HW) / m.gpus for m in TP]
    assert max(per_gpu[:2]) > per_gpu[3] * 1.2


def test_moe_ep_and_afd_modes_are_plausible() -> None:
    moe = ModelSpec(
        name="moe",
        params=30e9,
        layers=48,
        hidden=2048,
        n_heads=32,
        n_kv_heads=4,
        n_experts=128,
        top_k=8,
        expert_params=28e9,
    )
    ep = ParallelMode(name="tp2ep2", gpus=2, tp=2, ep=2)
    afd = ParallelMode(name="afd", gpus=4, tp=2, ep=2, afd_attn=2)
    for mode in (ep, afd):
        t = step_time(mode, np.array([1, 64, 256]), np.array([1e3, 6e4, 2.5e5]), moe, HW)
        assert np.all(np.diff(t) > 0)
        assert kv_capacity_tokens(mode, moe, HW) > 0
    # few experts are touched by a small batch: decode at b=1 reads far less than all weights
    assert step_time(ep, 1, 0, moe, HW) < 0.5 * moe.weight_bytes / 2 / (HW.hbm_bw * HW.eta_mem)


def test_kv_move_picks_cheaper_and_switch_costs_time() -> None:
    use, cost = kv_move_cost(np.array([10, 50_000]), TP[1], M, HW)
    assert cost.shape == (2,) and np.all(cost > 0) and use.dtype == bool
    slow = HardwareSpec(net_bw=1e6)
    use_slow, _ = kv_move_cost(np.array([50_000]), TP[1], M, slow)
    assert not use_slow[0]  # with a crawling network recompute wins
    assert switch_time(TP[3], M, HW) >= HW.switch_fixed_s


def test_bad_config_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="tp and ep"):
        ParallelMode(name="x", gpus=2, tp=4)
    with pytest.raises(ConfigError, match="cannot hold"):
        kv_capacity_tokens(ParallelMode.tensor(1), ModelSpec(params=70e9), HW)
    with pytest.raises(ConfigError):
        HardwareSpec(hbm_bw=0)

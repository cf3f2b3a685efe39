"""Invariants of long-tail fusion."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import (
    FusionConfig,
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    choose_threshold,
    consolidation_size,
    flat_batch,
    select_targets,
)


def test_consolidation_size_bounds_and_monotone() -> None:
    sizes = [consolidation_size(r, r * 5000.0, 256, 600_000, 32) for r in range(0, 5000, 97)]
    assert all(1 <= m <= 32 for m in sizes)
    assert sizes == sorted(sizes)
    assert consolidation_size(1000, 1.0, 256, 1e9, 32) == 4  # batch saturation bound
    assert consolidation_size(10, 3e6, 256, 1e6, 32) == 3  # KV bound


def test_select_targets_takes_most_loaded() -> None:
    r = np.array([3, 9, 0, 9, 4])
    t = select_targets(r, 3)
    assert len(set(t.tolist())) == 3
    left = np.setdiff1d(np.arange(5), t)
    assert r[t].min() >= r[left].max()


def test_choose_threshold_never_predicts_worse_than_serial() -> None:
    rng = np.random.default_rng(0)
    lens = np.clip(np.exp(rng.normal(np.log(1500), 1.0, 2048)), 16, 32768)
    prompts = np.full(2048, 400.0)
    ch = choose_threshold(
        lens,
        prompts,
        n_replicas=8,
        mode=ParallelMode.tensor(2),
        total_gpus=16,
        model=ModelSpec(),
        hw=HardwareSpec(),
        config=FusionConfig(),
        unit_replicas=4,
    )
    assert ch.predicted_end <= ch.predicted_serial_end + 1e-9
    assert ch.fraction in ch.fractions
    assert ch.threshold == round(ch.fraction * 2048)
    with pytest.raises(ConfigError):
        FusionConfig(fractions=(1.5,))


def test_flat_batch_shrinks_with_context() -> None:
    m, hw, tp8 = ModelSpec(), HardwareSpec(), ParallelMode.tensor(8)
    short = flat_batch(tp8, 500, 256, m, hw, 0.25)
    long = flat_batch(tp8, 20_000, 256, m, hw, 0.25)
    assert 1 <= long < short <= 256

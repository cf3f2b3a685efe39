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


def _choice(remaining: np.ndarray, context: np.ndarray, total: int) -> object:
    return choose_threshold(
        remaining,
        context,
        total=total,
        next_tokens=float(total * 3000),
        n_units=8,
        unit_replicas=1,
        mode=ParallelMode.tensor(8),
        model=ModelSpec(),
        hw=HardwareSpec(),
        config=FusionConfig(),
    )


def test_choose_threshold_never_predicts_worse_than_serial() -> None:
    rng = np.random.default_rng(0)
    rem = np.clip(np.exp(rng.normal(np.log(6000), 0.8, 400)), 16, 30000)
    ctx = np.full(400, 4000.0)
    ch = _choice(rem, ctx, 8192)
    assert ch.predicted_end <= ch.predicted_serial_end + 1e-9
    assert ch.fraction in ch.fractions
    assert ch.threshold == round(ch.fraction * 8192)
    if ch.threshold:  # units within [RLHFuse's lower bound, all units]
        assert 1 <= ch.units <= 8
        assert min(ch.predicted) == ch.predicted_end
    with pytest.raises(ConfigError):
        FusionConfig(fractions=(1.5,))
    with pytest.raises(ConfigError):
        _choice(rem, ctx[:-1], 8192)


def test_a_long_tail_is_worth_consolidating() -> None:
    """A few very long requests on 8 nodes: freeing most nodes for the next stage wins."""
    rem = np.full(24, 20000.0)
    ch = _choice(rem, np.full(24, 8000.0), 8192)
    assert ch.threshold > 0 and ch.units < 8
    assert ch.predicted_end < ch.predicted_serial_end

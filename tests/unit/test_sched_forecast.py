"""Invariants of flowrl.sched.forecast."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.events import Put
from flowrl.sched.forecast import (
    ForecastConfig,
    LengthForecaster,
    bucket_relative_error,
    kaplan_meier,
)


def _lengths(step: int, n: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(step)
    return np.clip(np.exp(rng.normal(np.log(1500 * 1.1**step), 1.0, n)), 16, 32768).astype(int)


def test_survival_is_a_valid_distribution() -> None:
    f = LengthForecaster()
    for s in range(4):
        f.begin_step()
        f.record(_lengths(s))
        f.end_step()
    g = np.array([0, 100, 3000, 20000])
    d = f.distribution(g)
    assert d.surv[0] == 1.0 and d.surv[-1] == 0.0
    assert np.all(np.diff(d.surv) <= 1e-12)
    rem = d.expected_remaining(g)
    assert np.all(rem >= 0) and np.all(rem <= 32768 - g)
    probs = d.bucket_probs(g, 256)
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    est = f.estimates(g, g)
    assert np.all(est.tail >= est.mean)
    assert np.all(est.second >= est.mean**2 - 1e-6)  # variance >= 0


def test_remaining_moments_match_the_distribution() -> None:
    f = LengthForecaster(ForecastConfig(median=1500, sigma=1.0))
    d = f.prior()
    g = np.array([0.0, 2000.0])
    mean, second = d.remaining_moments(g)
    rng = np.random.default_rng(0)
    u = rng.random(400_000)
    for k, gk in enumerate(g):  # Monte Carlo from the same survival function
        r = d.remaining_quantile(np.full(len(u), gk), u)
        assert mean[k] == pytest.approx(r.mean(), rel=0.02)
        assert second[k] == pytest.approx((r**2).mean(), rel=0.03)


def test_arima_forecast_tracks_a_long_drifting_history() -> None:
    f = LengthForecaster(ForecastConfig(median=1500, sigma=1.0))
    for s in range(12):  # past 8 steps: the AR(1)-on-differences path
        f.begin_step()
        f.record(_lengths(s))
        f.end_step()
    med = f.statistics().forecast_median
    assert np.median(_lengths(11)) < med < np.median(_lengths(11)) * 1.25


def test_arima_prior_follows_drift() -> None:
    f = LengthForecaster(ForecastConfig(median=1500, sigma=1.0))
    for s in range(5):
        f.begin_step()
        f.record(_lengths(s))
        f.end_step()
    forecast = f.statistics().forecast_median
    assert forecast > np.median(_lengths(3))  # trend carried forward


def test_kaplan_meier_matches_empirical_without_censoring() -> None:
    x = np.array([1, 2, 2, 3, 5], dtype=float)
    surv, _ = kaplan_meier(x, [], np.array([0, 1, 2, 4, 5]))
    assert np.allclose(surv, [1.0, 0.8, 0.4, 0.2, 0.0])


def test_observe_events_and_score() -> None:
    f = LengthForecaster()
    lens = _lengths(0, 2000)
    f.observe(
        Put(
            seq=1,
            t=0.0,
            indices=tuple(range(2000)),
            columns=("prompt",),
            new=True,
            partition="step-0",
        )
    )
    done = lens < 1500
    f.observe(
        Put(
            seq=2,
            t=1.0,
            indices=tuple(np.nonzero(done)[0].tolist()),
            columns=("response",),
            tokens=tuple(lens[done].tolist()),
        )
    )
    assert f.statistics().finished_this_step == int(done.sum())
    g = np.full(int((~done).sum()), 1499)
    err = f.score(g, lens[~done] - g)
    assert 0.0 <= err < 0.6
    pred = f.predicted_buckets(g, g)
    assert abs(pred.sum() - len(g)) < 1e-6 * len(g) + 1e-6
    assert bucket_relative_error([1, 1], [1, 1]) == 0.0

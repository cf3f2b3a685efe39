"""benchmarks/pipeline_e2e.py at a tiny size: structure only (timings belong to the benchmark).

Both modes must train every sample exactly once; the synchronous mode (η = 0) never trains
a sample from an older version, the streaming mode (η = 1) never one more than a version
old — although its rollout is far faster than the trainer and would otherwise run ahead.
"""

from __future__ import annotations

import collections
from types import ModuleType

import pytest

BENCHMARK = "pipeline_e2e"  # the conftest's ``bench`` fixture imports it


def tiny(bench: ModuleType, **overrides: object) -> object:
    params = dict(
        steps=4,
        batch=8,
        rollout_workers=2,
        rollout_micro=1,
        micro=2,
        median_tokens=64,
        sigma=1.0,
        max_tokens=1024,
        rollout_us=4.0,
        reward_us=1.0,
        logprob_us=2.0,
        update_us=100.0,
        timeout_s=60.0,
    )
    params.update(overrides)
    return bench.Workload(**params)


def test_every_sample_trained_once_within_the_staleness_bound(bench: ModuleType) -> None:
    w = tiny(bench)
    n = w.steps * w.batch
    lengths = bench.response_lengths(w)
    assert lengths.shape == (n,) and lengths.min() >= 1 and lengths.max() <= w.max_tokens

    sync = bench.run_mode(w, "sync", lengths)
    stream = bench.run_mode(w, "stream", lengths)
    for run in (sync, stream):
        assert collections.Counter(run["trained_sids"]) == collections.Counter(range(n))
        assert len(run["waits_s"]) == len(run["lags"]) == w.steps
        assert 0.0 <= run["update_idle_fraction"] <= 1.0
    assert sync["lags"] == [0] * w.steps
    assert max(stream["lags"]) <= 1
    # trainer_order="step": whole steps, oldest first, so step k trains the prompts of step k
    for run in (sync, stream):
        steps = [sid // w.batch for sid in run["trained_sids"]]
        assert steps == [k for k in range(w.steps) for _ in range(w.batch)]


def test_report_has_every_figure(bench: ModuleType) -> None:
    report = bench.synthetic(tiny(bench, steps=2))
    for key in (
        "sync_s",
        "stream_s",
        "speedup",
        "p99_over_median",
        "update_idle_fraction",
        "update_idle_fraction_steady",
        "max_lag",
        "trained_exactly_once",
        "stage_busy_fraction",
        "targets",
    ):
        assert key in report, key
    for key in ("update_idle_fraction", "max_lag", "trained_exactly_once"):
        assert set(report[key]) == {"sync", "stream"}, key
    assert report["trained_exactly_once"] == {"sync": True, "stream": True}
    assert report["max_lag"]["sync"] == 0 and report["max_lag"]["stream"] <= 1
    assert report["speedup"] == pytest.approx(report["sync_s"] / report["stream_s"], rel=1e-2)
    assert set(report["stage_busy_fraction"]["stream"]) == {
        "prompts",
        "rollout",
        "reward",
        "logprob",
        "trainer",
    }


def test_sync_mode_needs_equal_rollout_shares(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="multiple of rollout_workers"):
        tiny(bench, batch=7)

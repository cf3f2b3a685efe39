"""Benchmarks at a tiny size: they run and report every figure (timings are the
benchmarks' business, not these tests'). Benchmarks use private APIs, so a refactor that
breaks one shows here rather than at the next measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(name: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def test_partial_rollouts_benchmark_reports_every_setting() -> None:
    report = run("partial_rollouts.py", "--rounds", "1", "--batches", "2")
    settings = report["settings"]
    assert set(settings) == {"0", "1", "2", "4"}
    assert settings["0"]["appends_per_batch"] == 0
    assert settings["1"]["appends_per_batch"] > 0  # one append per decoding step
    assert all(s["ms_per_batch"] > 0 for s in settings.values())


@pytest.mark.parametrize("transport", ["inproc", "zmq"])
def test_hub_throughput_benchmark_reports_the_issue_figures(transport: str) -> None:
    auth = ["--auth-rounds", "2"] if transport == "zmq" else []
    report = run("hub_throughput.py", "--transport", transport, "--samples", "256", *auth)
    figures = [
        "put_samples_per_s",
        "get_samples_per_s",
        "put_gib_per_s",
        "put_first_fill_gib_per_s",
        "put_async_gib_per_s",
        "put_batched_gib_per_s",
        "get_gib_per_s",
        "claim_p50_ms",
        "claim_p99_ms",
        "claim_p99_ms_1k",
        "claim_p99_ms_131k",
        "controller_cell_updates_per_s",
    ]
    if transport == "zmq":
        figures += [
            "put_to_claimable_p50_ms",
            "single_sample_puts_per_s",
            "metadata_round_trips_per_s",
            "metadata_round_trips_per_s_2_threads",
            "startup_s",
            "blocked_claim_put_latency_ratio",
            "zmq_echo_round_trips_per_s",
            "zmq_one_way_after_pause_ms",
            "stage_rounds_per_s",
            "stage_round_vs_echo",
            "stage_round_cpu_ms",
            "stage_round_legs_vs_echo",
            "stage_round_pipelined_vs_echo",
            "stage_round_prefetch8_vs_echo",
            "stage_round_prefetch32_vs_echo",
            "auth_get_ratio",  # the hub key's cost (issue 26, item 4)
            "auth_put_ratio",
            "auth_metadata_round_trips_ratio",
            "zmq_curve_large_echo_ratio",
        ]
    assert all(report[f] > 0 for f in figures), {f: report.get(f) for f in figures}
    if transport == "zmq":  # the producer, the storage unit, the controller (/proc counts
        # 10 ms ticks: a few puts may read 0)
        for key in ("put_async_cpu_ms", "put_batched_cpu_ms"):
            assert len(report[key]) == 3 and min(report[key]) >= 0
    assert report["transport"] == transport and report["samples"] == 256
    machine = report["machine"]  # the machine's own speed, to read the figures against
    assert machine["python_loop_mops"] > 0 and machine["memcpy_gib_per_s"] > 0
    assert machine["fresh_shm_gib_per_s"] is None or machine["fresh_shm_gib_per_s"] > 0


def test_observability_overhead_benchmark_reports_every_mode() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    report = run("observability_overhead.py", "--rounds", "1", "--passes", "1", "--samples", "256")
    for mode in ("metrics", "dashboard"):
        for figure in ("over_none", "lowest_round", "cpu_over_none"):
            assert report[f"{mode}_{figure}"] > 0, (mode, figure, report)
        assert f"{mode}_exporter_cpu_share" in report
    assert len(report["load_average"]) == 2


def test_tq_partitions_benchmark_reports_flat_counts() -> None:
    pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
    report = run("tq_partitions.py", "--steps", "20", "--window", "5", "--batch", "8")
    windows = report["windows"]
    assert [w["step"] for w in windows] == [5, 10, 15, 20]
    assert all(w["ms_per_step"] > 0 for w in windows) and report["growth"] > 0
    # a cleared partition leaves no task or column behind (they grew by one a step)
    assert {(w["tasks"], w["columns"]) for w in windows} == {(1, 4)}

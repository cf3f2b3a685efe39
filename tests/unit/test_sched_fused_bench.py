"""benchmarks/fused_schedules.py --quick: FlexFusion's instances, every schedule reported was
validated, ours is never worse than the greedy nor above the memory limit, and no bound
exceeds FlexFusion's published makespans."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "fused_schedules"  # the conftest's ``bench`` fixture imports it


def test_quick_run_reports_valid_schedules(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = bench.main(["--quick", "--json"])
    capsys.readouterr()
    rows = out["instances"]
    assert [(r["instance"], r["pp"], r["microbatches"]) for r in rows] == [
        ("exp2", [8, 4], [8, 4]),
        ("exp5", [8, 8], [8, 8]),
        ("exp8", [16, 8], [16, 8]),
    ]
    for r in rows:
        assert r["lb_paper"] <= r["lb"] <= r["flexfusion"]
        o = r["makespan_over_lb"]
        assert 1.0 <= o["search"] <= o["greedy"] + 1e-9
        assert o["anneal"] <= o["greedy"] + 1e-9
        assert o["search"] < o["serial"]
        assert r["peak_over_serial"]["search"] <= 1.7 + 1e-9
    summary = out["summary"]
    assert summary["geomean_makespan_over_lb"] >= 1.0
    assert summary["max_peak_over_serial"] <= 1.7 + 1e-9

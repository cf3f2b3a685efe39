"""benchmarks/fused_schedules.py --quick: every schedule it reports was validated, ours is
never worse than the greedy, and the settings follow the paper's Table 3 shapes."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "fused_schedules"  # the conftest's ``bench`` fixture imports it


def test_quick_run_reports_valid_schedules(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = bench.main(["--quick", "--json"])
    capsys.readouterr()
    rows = out["settings"]
    assert [(r["pp"], r["gbs"]) for r in rows] == [([8, 4], 8), ([8, 8], 8), ([16, 8], 16)]
    for r in rows:
        assert r["lb"] >= r["lb_paper"]
        assert 1.0 <= r["over_lb"]["search"] <= r["over_lb"]["greedy"] + 1e-9
        assert r["over_lb"]["search"] < r["over_lb"]["serial"]
        assert r["peak_memory"]["search"] <= 2.0 + 1e-9
    assert out["summary"]["geomean_search_over_lb"] >= 1.0

"""benchmarks/fabric.py --quick: the five fabrics run on the same loop; the non-blocking
fat-tree is the fastest static fabric and ours never stalls (the figures belong to the
benchmark)."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "fabric"  # the conftest's ``bench`` fixture imports it


def test_quick_run_compares_every_fabric(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = bench.main(["--quick", "--json"])["rows"]
    capsys.readouterr()
    fabrics = {r["fabric"] for r in rows}
    assert fabrics == {"fat-tree 1:1", "fat-tree 3:1", "static OCS", "rfabric", "rfabric+"}
    for r in rows:
        assert r["step_vs_fat_tree"] >= 1.0 - 1e-9
        if r["fabric"] == "fat-tree 3:1":
            assert r["sync_s"] > 0 and r["step_vs_fat_tree"] > 1.0
        if r["fabric"] == "rfabric+":
            assert r["stall_s"] == 0.0
            slow = [
                x
                for x in rows
                if x["fabric"] == "rfabric"
                and x["gpus"] == r["gpus"]
                and x["ocs_delay_s"] == r["ocs_delay_s"]
            ]
            assert r["step_s"] <= slow[0]["step_s"] * (1 + 1e-4)

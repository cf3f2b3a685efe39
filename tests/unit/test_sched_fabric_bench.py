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
    ports = {
        r["fabric"]: (r["ports"]["electrical_per_pod"], r["ports"]["optical_per_pod"]) for r in rows
    }
    assert ports == {
        "fat-tree 1:1": (256, 0),
        "fat-tree 3:1": (85, 0),
        "static OCS": (32, 224),
        "rfabric": (32, 224),
        "rfabric+": (32, 224),
    }
    assert fabrics == {"fat-tree 1:1", "fat-tree 3:1", "static OCS", "rfabric", "rfabric+"}
    for r in rows:
        assert r["step_vs_fat_tree"] >= 1.0 - 1e-9
        assert set(r["phases_s"]) == {"weight_sync", "allreduce", "kv_migration", "data_hub"}
        assert all(v > 0 for v in r["phases_s"].values())
        if r["fabric"] == "fat-tree 3:1":  # a third of the ports: every phase slower
            assert r["sync_s"] > 0 and r["step_vs_fat_tree"] > 1.0
            assert all(v > 1.0 for v in r["phases_vs_fat_tree"].values())
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

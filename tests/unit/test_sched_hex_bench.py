"""benchmarks/hex_alloc.py --quick: ours (knapsack and MILP) agree and never lose to the
paper's bisection; the split uses every GPU (the figures belong to the benchmark)."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "hex_alloc"  # the conftest's ``bench`` fixture imports it

pytest.importorskip("highspy")


def test_quick_run_ours_matches_milp_and_beats_bisection(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = bench.main(["--quick", "--json"])
    capsys.readouterr()
    for r in out["rows"]:
        ours, milp, paper = r["ours"], r["ours_milp"], r["paper"]
        assert ours["step_s"] == pytest.approx(milp["step_s"])
        assert ours["step_s"] <= paper["step_s"] * (1 + 1e-9)
        gpus = bench.CLUSTERS[r["cluster"]]
        assert [t + g for t, g in zip(ours["train_gpus"], ours["rollout_gpus"], strict=True)] == [
            n for n in gpus if n
        ]

"""benchmarks/hex_alloc.py --quick: the allocator's step lies within the exact reference's
bracket, the paper's bisection never beats that optimum, and the 8-class model predicts its
plans' generation time closer to the fine-grained truth than the mean-length model (the
figures belong to the benchmark)."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "hex_alloc"  # the conftest's ``bench`` fixture imports it

pytest.importorskip("highspy")


def test_quick_run_is_exact_and_the_class_model_is_closer_to_the_truth(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = bench.main(["--quick", "--json"])
    capsys.readouterr()
    for r in out["exact"]:
        lo, hi = r["reference_lo"], r["reference_hi"]
        assert lo * (1 - 1e-6) <= r["ours"]["step_s"] <= hi * (1 + 1e-5)
        assert r["paper"]["step_s"] >= lo * (1 - 1e-6)
        gpus = r["gpus"]
        total = [
            t + g for t, g in zip(r["ours"]["train_gpus"], r["ours"]["rollout_gpus"], strict=True)
        ]
        assert total == list(gpus.values())
    fid = out["fidelity"]
    for coarse, fine in zip(fid["classes_1"], fid["classes_8"], strict=True):
        assert abs(fine - 1) <= abs(coarse - 1)

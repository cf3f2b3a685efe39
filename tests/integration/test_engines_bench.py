"""benchmarks/engines.py at a tiny size: it runs and reports every figure for every engine
that installs (timings are the benchmark's business, not this test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engines.py"


def test_engines_benchmark_reports_every_engine_and_the_sync_latency() -> None:
    tiny = "--hidden 32 --layers 1 --prompts 3 --prompt-len 4 --new-tokens 4 --rounds 1"
    sync = "--sync-hidden 32 --sync-layers 1 --sync-rounds 2 --sync-store-mib 128"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", *tiny.split(), *sync.split()],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for kind in ("rollout", "train"):
        assert report[kind], kind
        for name, figures in report[kind].items():
            assert figures["tokens_per_s"] > 0, (kind, name)
            assert figures["tokens"] == 12, (kind, name)  # 3 prompts x 4 tokens
    assert {"torch-tinylm", "torch-hf-llama"} <= set(report["rollout"]) | {
        k.split("/")[1] for k in report["skipped"]
    }
    sync = report["weight_sync"]
    assert {"shm", "ray", "vllm-shm"} <= set(sync) | {k.split("/")[1] for k in report["skipped"]}
    assert "shm" in sync
    for transport, figures in sync.items():
        assert figures["rounds"] == 2 and figures["memcpy_ms_median"] > 0, transport
        parts = ("publish", "wait", "poll", "load", "first_use")
        total = sum(figures[f"{p}_ms_median"] for p in parts)
        assert 0 < figures["load_ms_median"] < figures["latency_ms_max"], transport
        assert total > 0 and figures["sync_ms_median"] < figures["latency_ms_max"], transport

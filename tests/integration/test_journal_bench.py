"""benchmarks/journal.py at a tiny size: it runs and reports every figure (timings are the
benchmark's business, not this test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "journal.py"


def test_journal_benchmark_reports_overhead_and_recovery() -> None:
    args = ["--json", "--samples", "128", "--repeat", "1", "--recovery-samples", "512"]
    args += ["--compaction-lengths", "1200,9600", "--compaction-capacity", "2048"]
    args += ["--compact-mib", "0.01"]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for transport in ("inproc", "zmq"):
        got = report["overhead"][transport]
        assert set(got["samples_per_s"]) == {"off", "journal", "journal+data"}
        assert all(v > 0 for v in got["samples_per_s"].values())
        assert set(got["loss"]) == {"journal", "journal+data"}
    rec = report["recovery"]
    assert rec["samples"] == 512
    assert rec["journal_events"] > 512 // 32
    assert rec["data_mib"] > 0
    comp = report["compaction"]
    for mode in ("off", "on"):
        assert set(comp[mode]["journal_mib"]) == {"1200", "9600"}
        assert all(v > 0 for v in comp[mode]["recovery_s"].values())
    # sizes are not timings: without compaction the log grows with the run, with it not
    assert comp["off"]["journal_mib"]["9600"] > comp["on"]["journal_mib"]["9600"]

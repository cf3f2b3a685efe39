"""tools/gpu_check.sh on a machine without a GPU: one JSON object saying so, exit 0, and
nothing installed (CI runs this; the GPU sections run on a lent GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the check")
def test_without_a_gpu_the_check_says_so_and_succeeds(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [str(ROOT / "tools" / "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_SITE": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gpu"] is False and "no CUDA GPU" in report["skipped"]
    assert not site.exists()  # it installs nothing where it checks nothing

"""The project's own static checks (ruff lint + format, mypy on src/) run with the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ["src", "tests", "benchmarks", "examples"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the dev extra")
def test_ruff_lint_and_format() -> None:
    lint = _run("ruff", "check", *TREES)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", *TREES)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_on_src() -> None:
    pytest.importorskip("mypy")
    result = _run(sys.executable, "-m", "mypy", "src/flowrl")
    assert result.returncode == 0, result.stdout + result.stderr

"""The README's first command installs flowrl and runs the main job in a fresh virtualenv.

The install half runs exactly as the README writes it (core dependencies only, no extras),
so an import of an optional package on the main job's path fails here, not on a new user's
machine. The job half runs the same ``flowrl run grpo`` with a few steps and a short warm-up,
so the check costs seconds, not the whole run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN = ["--steps", "3", "--clean-steps", "50", "--noisy-steps", "10", "--eval-size", "32"]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def readme_first_command() -> tuple[list[str], list[str]]:
    """The README's first set-up command, split into its install and run halves."""
    setup = re.search(r"## Set-up.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert setup is not None, "README.md has no Set-up section with a bash block"
    commands = [ln for ln in setup.group(1).splitlines() if ln and not ln.startswith("#")]
    install, run = commands[0].split(" && ")
    return install.split(), run.split()


def test_readme_names_the_pinned_core_install_and_the_main_job() -> None:
    install, run = readme_first_command()
    assert install == ["pip", "install", "torch==2.13.0", "-e", "."]
    assert run == ["flowrl", "run", "grpo"]


def test_readme_first_command_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    install, run = readme_first_command()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    subprocess.run(
        [str(bin_dir / install[0]), *install[1:], "-q"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=900,
    )
    out = tmp_path / "run"
    done = subprocess.run(
        [str(bin_dir / run[0]), *run[1:], *SHORT_RUN, "--out", str(out), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3

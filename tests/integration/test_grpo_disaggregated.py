"""``flowrl run grpo --placement disaggregated`` end to end: the rollout process and the
trainer share a multi-process hub and the shared-memory weight channel. Every sample is
generated, scored and trained exactly once, and the versions the trainer publishes reach
the rollout process (the trained samples' versions advance)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flowrl.errors import StageError, Timeout
from flowrl.recipes.grpo_config import GRPOConfig
from flowrl.recipes.grpo_placement import Disaggregated, plan_cores

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="the placement needs 2 cores (refused on 1)"
    ),
]

STEPS, PROMPTS, GROUP = 4, 2, 4
FLAGS = [
    f"--steps={STEPS}",
    f"--prompts-per-step={PROMPTS}",
    f"--group-size={GROUP}",
    "--rollout-batch=4",
    "--clean-steps=5",
    "--noisy-steps=2",
    "--eval-size=4",
    "--no-progress",
    "--log-every=0",
    "--stall-timeout=120",
    "--append-every=0",  # no per-token appends: each costs a hub round trip (tested elsewhere)
]


@pytest.mark.parametrize(
    ("task", "staleness", "engine"), [("arith", 1, "builtin"), ("chain", 0, "torch")]
)
def test_disaggregated_run_trains_each_sample_once_with_new_weights(
    tmp_path: Path, task: str, staleness: int, engine: str
) -> None:
    argv = [
        *FLAGS,
        "--placement=disaggregated",
        f"--task={task}",
        f"--max-staleness={staleness}",
        f"--engine={engine}",
        f"--out={tmp_path}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "grpo", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    total = STEPS * PROMPTS * GROUP
    assert summary["placement"] == "disaggregated"
    # the rollout process's stages and the trainer's: each saw every sample once
    assert summary["stage_samples"] == dict.fromkeys(
        ["prompts", "Rollout", "reward", "Logprob", "advantage"], total
    )
    assert summary["trained_samples"] == summary["trained_distinct"] == total
    # a sample is tagged with the version its rollout engine loaded: the last step's were
    # generated with weights published after the first update, at most `staleness` old
    low, high = summary["sample_versions"]
    assert low == 0 and high >= STEPS - 1 - staleness > 0
    assert summary["lag_max"] <= staleness
    # the RL loop's clock started once the rollout process was ready: its start-up is
    # in the run's wall time, not in the loop's (samples_per_s)
    assert summary["rollout_ready_wait_s"] >= 0
    assert summary["rl_wall_s"] + summary["rollout_ready_wait_s"] <= summary["wall_s"]
    cores = summary["cores"]
    if staleness:
        assert set(cores["rollout"]).isdisjoint(cores["trainer"])
    else:
        assert cores["rollout"] == cores["trainer"]


@pytest.fixture
def split() -> Iterator[Disaggregated]:
    """A rollout process started for a small run (it waits for version 0), closed after."""
    cfg = GRPOConfig(placement="disaggregated", steps=2, prompts_per_step=2, group_size=4)
    cores = plan_cores(cfg)
    assert cores is not None
    started = Disaggregated(cfg, cores, start_step=0)
    yield started
    started.close()


def test_a_rollout_process_that_dies_fails_the_trainer(split: Disaggregated) -> None:
    split.check()  # alive, nothing to report
    assert split.pid is not None
    os.kill(split.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(StageError, match=r"the rollout process died \(exit code -9\)"):
        while time.monotonic() < deadline:
            split.check()
            time.sleep(0.05)


def test_the_trainer_waits_until_the_rollout_process_is_ready(split: Disaggregated) -> None:
    assert split.pid is not None
    os.kill(split.pid, signal.SIGSTOP)  # still importing: it cannot have said ready
    with pytest.raises(Timeout, match=r"the rollout process was not ready within 0\.5s"):
        split.wait_ready(0.5)
    os.kill(split.pid, signal.SIGCONT)
    assert split.wait_ready(120) >= 0  # ready: connected, model built
    split.check()  # and alive, waiting for the first version
    split.wait_ready(0)  # ready stays ready


def test_a_rollout_process_that_dies_before_it_is_ready_fails_the_wait(
    split: Disaggregated,
) -> None:
    assert split.pid is not None
    os.kill(split.pid, signal.SIGKILL)
    with pytest.raises(StageError, match=r"the rollout process died \(exit code -9\)"):
        split.wait_ready(120)  # its death, not a Timeout


def test_a_rollout_process_that_fails_after_it_is_ready_reports_why(split: Disaggregated) -> None:
    split.publish([("bogus", torch.zeros(1))], 0)  # no such weight: its workers fail
    # its "ready", then its report, then its exit: the report is read, not lost
    with pytest.raises(StageError, match=r"the rollout process failed: .*'bogus'"):
        split.finish(120)

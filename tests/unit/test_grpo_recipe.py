"""The main job at toy size: it runs end to end, synchronous mode is reproducible, each run
has a folder of its own, a checkpointed run resumes exactly, and a stalled run explains
itself instead of hanging."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from grpo_runs import TINY, step_metrics

from flowrl.errors import Timeout
from flowrl.recipes.grpo_arith import GRPOConfig, main, run

KEYS = ("reward", "loss", "kl_ref", "clip_fraction", "n_tokens", "version", "lag_max")


def _argv(**overrides: object) -> list[str]:
    opts = {**TINY, **overrides}
    opts.pop("progress")
    return [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]


def test_synchronous_run_is_reproducible_for_a_seed_with_or_without_appends(
    tmp_path: Path,
) -> None:
    # Appending partial rollouts to the hub (every decoding step in ``b``) changes nothing
    # that is sampled or trained: the two runs are the same run. Both write under the same
    # --out, each into a folder of its own.
    a = run(GRPOConfig(**TINY, max_staleness=0, append_every=0, out=str(tmp_path)))
    b = run(GRPOConfig(**TINY, max_staleness=0, append_every=1, out=str(tmp_path)))
    assert a["run_dir"] != b["run_dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        Path(s["run_dir"]).name for s in (a, b)
    )
    ma, mb = step_metrics(a["run_dir"]), step_metrics(b["run_dir"])
    assert [[m[k] for k in KEYS] for m in ma] == [[m[k] for k in KEYS] for m in mb]
    assert a["eval_greedy_after"] == b["eval_greedy_after"]
    assert a["lag_max"] == 0  # on-policy: every trained sample came from the current weights
    assert all(m["token_lag_mean"] == 0.0 for m in ma + mb)  # and so did every token
    folder = Path(a["run_dir"])
    assert json.loads((folder / "config.json").read_text())["append_every"] == 0
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        "step-000003.pt",
        "step-000003.pt.sha256",  # its checksum
    ]


def test_streaming_run_logs_and_bounds_staleness(tmp_path: Path, capsys) -> None:
    assert main([*_argv(), "--max-staleness=1", "--log-every=1", f"--out={tmp_path}"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    for key in ("steps", "reward_first", "reward_last", "wall_s", "samples_per_s", "run_dir"):
        assert key in summary
    assert summary["steps"] == 3 and summary["lag_max"] <= 1
    assert 0.0 <= summary["update_idle_fraction"] <= 1.0
    assert Path(summary["timeline_png"]).stat().st_size > 1000
    n = TINY["steps"] * TINY["prompts_per_step"] * TINY["group_size"]
    assert all(v >= n for v in summary["stage_samples"].values())
    sched = summary["sched"]  # the scheduling layer ran on the hub's events
    assert sched["claimed"] == [summary["stage_samples"]["Rollout"]]
    assert sched["steps_scored"] >= 1  # one worker: nothing to plan, the forecaster runs
    # stderr: the warm-up's progress, then one log line per step; stdout: only the summary.
    # stderr is not a terminal here, so a line per quarter stands in for the bar's frames.
    err = captured.err
    assert "warm-up: 5 supervised steps" in err and "warm-up: 7/7" in err and "\r" not in err
    for step in (1, 2, 3):
        assert f"step {step}/3  reward " in err
    assert " kl " in err and " lag " in err and "samples/s" in err
    assert captured.out.count("\n") == 1


def test_rollout_workers_are_the_schedulers_instances(tmp_path: Path) -> None:
    summary = run(GRPOConfig(**TINY, rollout_workers=2, out=str(tmp_path)))
    sched = summary["sched"]
    n = TINY["steps"] * TINY["prompts_per_step"] * TINY["group_size"]
    assert len(sched["claimed"]) == 2
    assert sum(sched["claimed"]) == summary["stage_samples"]["Rollout"] >= n
    assert sched["claims"] >= 2 and sched["steps_scored"] >= 1
    assert sched["plans"] >= 1 and sched["balancer_ticks"] >= 1
    assert 0.0 <= sched["forecast_bucket_error"] <= 2.0
    off = run(GRPOConfig(**TINY, schedule=False, out=str(tmp_path)))
    assert off["sched"] is None


@pytest.mark.parametrize(
    "shape",
    [
        # The issue's --prompts-per-step 2 (with the default 32-sample rollout batch, here
        # at toy size): a put of half a step was admitted as a whole put's worth of
        # samples, and the advantage stage waited for two steps' groups.
        {"prompts_per_step": 2, "group_size": 4, "rollout_batch": 16, "max_staleness": 1},
        # Steps of 3 groups, puts of 2: synchronously, step 0's last group never came.
        {"prompts_per_step": 3, "group_size": 2, "rollout_batch": 4, "max_staleness": 0},
    ],
)
def test_step_sizes_that_used_to_hang_make_progress(tmp_path: Path, shape: dict) -> None:
    cfg = GRPOConfig(**{**TINY, **shape}, stall_timeout=60.0, out=str(tmp_path))
    summary = run(cfg)
    assert summary["steps"] == 3
    assert len(step_metrics(summary["run_dir"])) == 3


def test_a_run_that_stops_making_progress_raises_a_diagnosis(tmp_path: Path) -> None:
    # No first batch can be ready within a millisecond: the stall timeout fires at once.
    with pytest.raises(Timeout) as raised:
        run(GRPOConfig(**TINY, stall_timeout=0.001, out=str(tmp_path)))
    text = str(raised.value)
    assert "the trainer waited 0.001s (--stall-timeout) for the 8 samples of step 1" in text
    assert "Hub at policy version 0" in text and "samples live" in text
    for task in ("Rollout", "reward", "Logprob", "advantage", "trainer"):
        assert f"{task}: " in text
    assert not [t for t in threading.enumerate() if t.name == "flowrl-pipeline"]


def test_a_checkpointed_run_resumes_where_it_stopped(tmp_path: Path, capsys) -> None:
    # Synchronous and one rollout worker: the run is reproducible, so 2 steps + a resume to
    # 4 must be the uninterrupted 4-step run, step for step and weight for weight.
    sync = {**TINY, "max_staleness": 0, "checkpoint_every": 2}
    whole = run(GRPOConfig(**{**sync, "steps": 4}, out=str(tmp_path / "whole")))
    first = run(GRPOConfig(**{**sync, "steps": 2}, out=str(tmp_path / "cut")))
    # a crash while writing step 3's checkpoint tore it: the resume falls back to step 2
    good = Path(first["run_dir"]) / "checkpoints" / "step-000002.pt"
    torn = good.with_name("step-000003.pt")
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torn.with_name(torn.name + ".sha256").write_text(
        good.with_name(good.name + ".sha256").read_text()
    )
    assert main(["--resume", first["run_dir"], "--steps=4", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    resumed = json.loads(out.strip().splitlines()[-1])
    assert f"skipping torn checkpoint {torn}" in err and "Traceback" not in err
    torn.unlink()

    assert resumed["run_dir"] == first["run_dir"] and resumed["resumed_from"] == 2
    assert resumed["steps"] == 4 and resumed["stage_samples"]["Rollout"] >= 2 * 8
    whole_m, resumed_m = step_metrics(whole["run_dir"]), step_metrics(resumed["run_dir"])
    assert [m["step"] for m in resumed_m] == [0, 1, 2, 3]
    assert [[m[k] for k in KEYS] for m in resumed_m] == [[m[k] for k in KEYS] for m in whole_m]

    def states(summary: dict) -> dict[int, dict]:
        folder = Path(summary["run_dir"]) / "checkpoints"
        return {int(p.stem[5:]): torch.load(p, weights_only=True) for p in folder.glob("step-*.pt")}

    w, r = states(whole), states(resumed)
    assert sorted(w) == sorted(r) == [2, 4]
    for step in (2, 4):  # the resume started from the checkpoint's weights and optimizer
        assert w[step]["version"] == r[step]["version"] == step
        for name, tensor in w[step]["model"].items():
            assert torch.equal(tensor, r[step]["model"][name]), (step, name)
        assert w[step]["optimizer"]["state"][0]["step"] == r[step]["optimizer"]["state"][0]["step"]


def test_resume_refuses_a_changed_setup_or_nothing_to_do(tmp_path: Path, capsys) -> None:
    done = run(GRPOConfig(**TINY, out=str(tmp_path)))
    for argv, says in (
        (["--group-size=2"], "--group-size 2: the resumed run was started with 4"),
        ([], "--steps 3: the run in"),
        (["--steps=5", f"--resume={tmp_path}"], f"--resume {tmp_path}: no config.json"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--resume", done["run_dir"], *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"flowrl run grpo: error: {says}" in err and "Traceback" not in err

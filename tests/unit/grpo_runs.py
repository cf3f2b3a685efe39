"""A tiny configuration of the main job and a reader of a run's metrics, for the tests
that run it (test_grpo_recipe, test_grpo_engines)."""

from __future__ import annotations

import json
from pathlib import Path

TINY = {
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 4,
    "rollout_batch": 4,
    "clean_steps": 5,
    "noisy_steps": 2,
    "eval_size": 8,
    "progress": False,
    "log_every": 0,
}


def step_metrics(run_dir: str | Path) -> list[dict]:
    """The per-step lines of a run's metrics.jsonl (its summary line left out)."""
    lines = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "summary" not in m]

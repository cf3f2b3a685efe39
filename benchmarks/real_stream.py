"""The real GRPO job, streaming vs synchronous, with rollout and training on their own cores.

What it measures: trained samples per second of ``flowrl run grpo --placement
disaggregated`` (the rollout process on one half of the CPU cores, the trainer on the
other; ``docs/grpo.md``) run two ways, per task and rollout engine, in one run that
alternates the modes round by round:

* **stream** — ``--max-staleness 1``: generation of step k + 1 overlaps training of step
  k; the trainer's stages take micro-batches as they come.
* **sync** — ``--max-staleness 0``: the placement gives each process every core (nothing
  can overlap, so splitting them would leave half idle), and the trainer's stages take
  whole steps, so the phases run one after the other, each with all the cores: the fair
  synchronous baseline. Its torch threads per process are ``--sync-threads`` (1 by
  default: on this 2-core machine, shared and loaded, two intra-op threads per process
  made the tiny model's phases several times slower, see docs/benchmarks.md).

Tasks: ``arith`` (a + b: answers of 2 to 4 tokens) and ``chain`` (chain sums with their
running sums worked out: 2 to 50 tokens, heavy-tailed; ``flowrl.tasks.ChainTask``).
Engines: ``torch`` (``flowrl.engines.TorchRolloutEngine``) and ``vllm`` where it is
installed (skipped, and said so, where it is not; it needs ``--model llama``).

Every run starts from the same warmed-up policy: one short run per task and engine does
the supervised warm-up and one RL step (its checkpoint), and each measured run resumes a
copy of it for ``--steps`` more steps (``--resume``; the placement and the staleness bound
may change on a resume). Rounds use seeds 0, 1, ...: the warm run of each seed is shared by
both modes.

How to read it. ``stream_over_sync[task][engine]``: the mean over rounds of stream
samples/s over sync samples/s, both the recipe's ``samples_per_s`` (trained samples over
the RL loop's wall time, the first step's pipeline fill included); ``..._steady`` leaves
the first step out (the figure a long job converges to). The loop's clock starts once the
rollout process is ready (connected, model built): a resumed run has no warm-up to hide
its start-up behind, as a fresh run does, and it is the same in both modes.
``..._with_startup`` counts that wait too (``ready_wait_s``: how long it was), as the
clock did before. Target: >= 1.3 on both tasks
with the torch engine. ``reward``: per mode, the mean batch reward over the measured steps
of each round and its spread; the curves agree when the difference of the modes' means is
within ``noise`` (two standard errors of the per-step rewards). ``load_average``: the 1-minute
load before and after (the machine is shared: quote ratios, not absolute figures).

Usage: ``python benchmarks/real_stream.py [--json] [--tasks arith,chain]
[--engines torch,vllm] [--rounds 2] [--steps 10] [--clean-steps 120] [--noisy-steps 30]``.
The defaults take about an hour on the shared 2-core machine at load 10-20.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

MODES = {"stream": ["--max-staleness", "1"], "sync": ["--max-staleness", "0"]}
ENGINE_ARGS = {"torch": [], "vllm": ["--model", "llama", "--d-model", "64"]}


def grpo(args: list[str], timeout: float) -> dict[str, Any]:
    """``flowrl run grpo ARGS`` in a fresh process; its JSON summary."""
    cmd = [sys.executable, "-m", "flowrl", "run", "grpo", "--no-progress", "--log-every", "0"]
    out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd + args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm_run(task: str, engine: str, seed: int, opts: argparse.Namespace, out: Path) -> Path:
    """The shared starting point: warm-up and one RL step, checkpointed."""
    summary = grpo(
        [
            "--task", task, "--engine", engine, *ENGINE_ARGS[engine], "--seed", str(seed),
            "--steps", "1", "--clean-steps", str(opts.clean_steps),
            "--noisy-steps", str(opts.noisy_steps), "--eval-size", str(opts.eval_size),
            "--checkpoint-every", "1", "--no-schedule", "--out", str(out),
        ],
        opts.timeout,
    )  # fmt: skip
    return Path(summary["run_dir"])


def measured_run(warm: Path, mode: str, opts: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Resume a copy of ``warm`` for ``opts.steps`` steps in ``mode``; throughput, rewards."""
    run_dir = scratch / f"{warm.name}-{mode}-{len(list(scratch.iterdir()))}"
    shutil.copytree(warm, run_dir)
    threads = ["--torch-threads", str(opts.sync_threads)] if mode == "sync" else []
    summary = grpo(
        [
            "--resume", str(run_dir), "--steps", str(1 + opts.steps),
            "--placement", "disaggregated", *MODES[mode], *threads,
        ],
        opts.timeout,
    )  # fmt: skip
    steps = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if not line.startswith('{"summary"')
    ][1:]  # the warm run's step is not measured
    steady_s = sum(m["step_s"] for m in steps[1:])
    batch = summary["trained_samples"] // len(steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "samples_per_s": summary["samples_per_s"],
        "samples_per_s_with_startup": summary["samples_per_s"]
        * summary["rl_wall_s"]
        / (summary["rl_wall_s"] + summary["rollout_ready_wait_s"]),
        "ready_wait_s": summary["rollout_ready_wait_s"],
        "samples_per_s_steady": (len(steps) - 1) * batch / steady_s,
        "update_idle_fraction": summary["update_idle_fraction"],
        "lag_max": summary["lag_max"],
        "trained_exactly_once": summary["trained_samples"] == summary["trained_distinct"],
        "rewards": [m["reward"] for m in steps],
    }


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Ratios per round and the reward curves' summary."""
    ratios, steady, startup = (
        [s[key] / y[key] for s, y in zip(runs["stream"], runs["sync"], strict=True)]
        for key in ("samples_per_s", "samples_per_s_steady", "samples_per_s_with_startup")
    )
    reward = {}
    for mode, rs in runs.items():
        flat = np.concatenate([r["rewards"] for r in rs])
        reward[mode] = {
            "mean": float(flat.mean()),
            "stderr": float(flat.std(ddof=1) / np.sqrt(flat.size)) if flat.size > 1 else 0.0,
            "first_step": float(np.mean([r["rewards"][0] for r in rs])),
            "last_step": float(np.mean([r["rewards"][-1] for r in rs])),
            "per_round_mean": [float(np.mean(r["rewards"])) for r in rs],
        }
    diff = reward["stream"]["mean"] - reward["sync"]["mean"]
    noise = 2 * float(np.hypot(reward["stream"]["stderr"], reward["sync"]["stderr"]))
    return {
        "stream_over_sync": float(np.mean(ratios)),
        "stream_over_sync_per_round": [round(r, 3) for r in ratios],
        "stream_over_sync_steady": float(np.mean(steady)),
        "stream_over_sync_with_startup": float(np.mean(startup)),
        "samples_per_s": {m: [round(r["samples_per_s"], 1) for r in rs] for m, rs in runs.items()},
        "ready_wait_s": {m: [round(r["ready_wait_s"], 2) for r in rs] for m, rs in runs.items()},
        "update_idle_fraction": {
            m: [round(r["update_idle_fraction"], 3) for r in rs] for m, rs in runs.items()
        },
        "lag_max": {m: max(r["lag_max"] for r in rs) for m, rs in runs.items()},
        "trained_exactly_once": all(r["trained_exactly_once"] for rs in runs.values() for r in rs),
        "reward": reward,
        "reward_difference": diff,
        "reward_noise": noise,
        "reward_within_noise": abs(diff) <= noise,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tasks", default="arith,chain")
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured RL steps per run")
    parser.add_argument("--clean-steps", type=int, default=120)
    parser.add_argument("--noisy-steps", type=int, default=30)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--sync-threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    opts = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {"stream_over_sync": {}, "details": {}, "skipped": {}}
    engines = opts.engines.split(",")
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        engines.remove("vllm")
        result["skipped"]["vllm"] = "vllm is not installed here (docs/engines_vllm.md)"
    with tempfile.TemporaryDirectory(prefix="flowrl-real-stream-") as tmp:
        scratch = Path(tmp)
        for task in opts.tasks.split(","):
            for engine in engines:
                runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                for seed in range(opts.rounds):
                    warm = warm_run(task, engine, seed, opts, scratch / "warm")
                    order = list(MODES) if seed % 2 == 0 else list(MODES)[::-1]
                    for mode in order:
                        runs[mode].append(measured_run(warm, mode, opts, scratch))
                        if not opts.json:
                            print(f"{task}/{engine} seed {seed} {mode}: {runs[mode][-1]}")
                figures = compare(runs)
                result["stream_over_sync"].setdefault(task, {})[engine] = round(
                    figures["stream_over_sync"], 3
                )
                result["details"].setdefault(task, {})[engine] = figures
    result["load_average"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    result["cpus"] = len(os.sched_getaffinity(0))
    result["config"] = vars(opts)
    result["targets"] = {
        f"{task} torch stream_over_sync >= 1.3": ratio.get("torch", 0) >= 1.3
        for task, ratio in result["stream_over_sync"].items()
    }
    print(json.dumps(result, indent=None if opts.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""End to end: synchronous vs streaming execution of the same RL pipeline.

What it measures: the wall time of a whole RL job run two ways, and the fraction of it the
update stage (the trainer) spends waiting for data.

* **synchronous** — what verl's synchronous trainer does: per step, rollout of the whole
  batch of ``B`` (every rollout worker takes a fixed share of ``B / workers`` samples up
  front, so the step's rollout ends with its slowest share), then reward on the whole
  batch, then logprob on the whole batch, then the update. Nothing overlaps, neither
  stages nor steps (on-policy, staleness η = 0).
* **streaming** — the flowrl pipeline: each stage claims micro-batches from the hub as soon
  as their inputs are ready; the trainer iterates a ``flowrl.Loader`` with
  ``batch_size=B`` and publishes a version per step (``hub.publish_version``); admission
  control keeps rollout at most one step ahead
  (``Staleness(max_staleness=1, samples_per_version=B)``, η = 1).

Both modes run the same ``flowrl.Pipeline`` stage functions with the same worker counts,
per-token costs and samples through an in-process ``flowrl.Hub``. The synchronous mode is
that pipeline with batch-level barriers — every stage claims its whole share at once
(``batch_size = min_batch = B / workers`` for rollout, ``B`` for reward and logprob) —
and η = 0, so the next step's prompts are admitted only after the update. The only
difference is barrier-per-stage vs per-sample streaming. A tiny run of both modes first
takes the one-off costs of a first run (lazy imports, first threads) out of the timings.

(b) ``synthetic`` (the main workload): ``--steps`` (10) steps of ``--batch`` (64) samples.
    Response lengths are lognormal, median 256 tokens, sigma 1.2 (theoretical p99/median
    16.3), capped at 4,096 tokens = 16x the median, like a ``max_response_length``; the
    realised ratio of the drawn lengths is reported as ``p99_over_median``. Pipeline:
    prompts (source) → rollout (4 workers, like 4 generation instances) → reward (1) →
    logprob (1) → trainer (this thread, via the Loader). Each stage costs a fixed time per
    token of its micro-batch, simulated with ``time.sleep(cost * tokens)``: a sleep models
    work on a separate accelerator, so the 2 shared CPU cores of the benchmark machine are
    not the bottleneck (the hub's own bookkeeping, claims and copies are real). Costs per
    token: rollout 32 µs on one worker, reward 1 µs, logprob 5 µs (a forward pass, about a
    third of the update), update 16 µs (forward, backward and optimizer step). A sample's
    version is the policy version when its prompt was admitted (the hub's, at the
    source's put) — the earliest the rollout could have started, so lags are upper bounds.

    Why these parameters. Streaming hides everything but the slowest stage, so the
    trainer stops waiting only if the other stages together keep up with it. A real
    asynchronous deployment sizes generation for that (how many generation instances per
    trainer); here the 4 rollout workers produce tokens 2x as fast as the trainer consumes
    them (``rollout_to_trainer_capacity``; ``--rollout-capacity`` changes it). Measured on
    the 2-core machine, seed 0: capacity 1.0 → stream idle 22 % (still 2.2x faster than
    synchronous), 1.33 → 13 %, 1.6 → 9 %, 2.0 → 5-8 % (seeds 0-5). Rollout claims
    micro-batches of 2 samples, so a worker that drew a long response holds back no one
    else; reward and logprob take whatever is ready, up to 8. The trainer takes whole
    steps, oldest first (prompts carry their step as group id, the Loader has
    ``groups=B``): the premise of the admission bound. With ``--trainer-order ready`` it
    takes any ``B`` ready samples instead, and a straggler among step ``v``'s prompts
    (admitted at version ``v - 1``) can be left for step ``v + 1``, which trains it with
    lag 2 > η (seen on this machine with sigma 1.1, an 8,192-token cap, capacity 1.8,
    rollout micro-batches of 1, seed 2). Most of the streaming idle time is the one-off pipeline
    fill (the first batch must be generated before any update can run, in either mode);
    10 steps keep it near 6 % of the job, and ``update_idle_fraction_steady`` leaves it
    out (the figure a long job converges to).

(a) ``grpo``: the real GRPO example (``flowrl.recipes.grpo_arith.run``: a tiny transformer
    learning addition, ~50 warm-up steps, ``--grpo-steps`` (20) RL steps of 64 samples) with
    ``max_staleness=0`` (on-policy: the next step's rollout waits for the update, but the
    stages still stream micro-batches within a step, so this is not the barrier-per-stage
    baseline of (b)) and ``max_staleness=1`` (one-step-off). Times are the recipe's
    ``rl_wall_s`` (the RL loop, without warm-up and evaluation). Every stage is real torch
    compute on CPU (``run`` limits torch to one thread): on 2 shared cores the stages
    compete for the same cores, so overlapping them gains little — the speedup there is
    bounded by the machine, not by the schedule.

How to read it. ``speedup`` = ``sync_s / stream_s`` (target >= 1.3 on (b)).
``update_idle_fraction``: seconds the trainer was blocked in ``next(loader)`` over the
mode's wall time, pipeline start to the end of the last update (target <= 0.10 when
streaming). ``update_wait_s_per_step`` shows where that time went. ``max_lag``: the largest
trainer version minus sample version trained (<= 1 at η = 1, 0 when synchronous).
``trained_exactly_once``: every sample id was trained exactly once. ``stage_busy_fraction``:
time inside each stage function over the wall time, per worker (the trainer: 1 - idle).
``targets`` lists each target with its measured figure and whether it was met. Quote
ratios from one run; absolute seconds drift on a shared machine.

Usage: ``python benchmarks/pipeline_e2e.py [--json] [--workload synthetic|grpo|all]
[--steps N] [--batch B] [--grpo-steps N] [--seed S] [--rollout-capacity R]
[--trainer-order step|ready]``. The defaults take under a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any, Literal

import msgspec
import numpy as np

import flowrl
from flowrl import Column, Loader, Pipeline, Rows, Staleness

MODES = ("sync", "stream")
TRAIN_COLUMNS = ["sid", "response", "reward", "logprob"]


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """The synthetic job: sizes, the length distribution, per-token stage costs (µs)."""

    steps: int = 10
    batch: int = 64
    seed: int = 0
    rollout_workers: int = 4
    rollout_micro: int = 2
    micro: int = 8
    median_tokens: int = 256
    sigma: float = 1.2
    max_tokens: int = 4096
    rollout_us: float = 32.0
    reward_us: float = 1.0
    logprob_us: float = 5.0
    update_us: float = 16.0
    trainer_order: Literal["step", "ready"] = "step"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.batch % self.rollout_workers:
            raise ValueError(
                f"batch={self.batch} must be a multiple of rollout_workers="
                f"{self.rollout_workers}: the synchronous mode gives each worker an equal share"
            )
        if self.trainer_order not in ("step", "ready"):
            raise ValueError(f"trainer_order must be 'step' or 'ready', got {self.trainer_order!r}")

    @property
    def rollout_capacity(self) -> float:
        """Tokens/s of all rollout workers over tokens/s the trainer consumes."""
        return self.update_us * self.rollout_workers / self.rollout_us


def response_lengths(w: Workload) -> np.ndarray:
    """Response length of every sample id, drawn once: both modes train the same samples."""
    rng = np.random.default_rng(w.seed)
    raw = rng.lognormal(np.log(w.median_tokens), w.sigma, size=w.steps * w.batch)
    return np.clip(np.round(raw), 1, w.max_tokens).astype(np.int64)


def build_pipeline(w: Workload, lengths: np.ndarray, mode: str) -> Pipeline:
    """prompts → rollout → reward → logprob; ``mode`` sets claim sizes and staleness only."""
    b, n = w.batch, len(lengths)
    sync = mode == "sync"
    share = b // w.rollout_workers
    by_step = w.trainer_order == "step"

    @flowrl.stage(outputs=[Column.scalar("sid", "int64")], batch_size=w.micro)
    def prompts() -> Any:
        for start in range(0, n, w.micro):
            sid = np.arange(start, min(start + w.micro, n), dtype=np.int64)
            # group id = the step the prompt belongs to (trainer_order="step")
            yield Rows({"sid": sid}, groups=sid // b if by_step else None)

    @flowrl.stage(
        inputs=["sid"],
        outputs=[Column.ragged("response", "int64")],
        batch_size=share if sync else w.rollout_micro,
        min_batch=share if sync else 1,
        workers=w.rollout_workers,
    )
    def rollout(batch: flowrl.Batch) -> dict[str, Any]:
        lens = lengths[batch.numpy("sid")]
        time.sleep(w.rollout_us * 1e-6 * int(lens.sum()))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return {"response": flowrl.RaggedArray(np.zeros(int(cu[-1]), np.int64), cu)}

    @flowrl.stage(
        inputs=["response"],
        outputs=[Column.scalar("reward", "float32")],
        batch_size=b if sync else w.micro,
        min_batch=b if sync else 1,
    )
    def reward(batch: flowrl.Batch) -> dict[str, Any]:
        lens = batch.ragged("response").lengths
        time.sleep(w.reward_us * 1e-6 * int(lens.sum()))
        return {"reward": (lens % 2).astype(np.float32)}

    @flowrl.stage(
        inputs=["response", "reward"],
        outputs=[Column.ragged("logprob", "float32")],
        batch_size=b if sync else w.micro,
        min_batch=b if sync else 1,
    )
    def logprob(batch: flowrl.Batch) -> dict[str, Any]:
        resp = batch.ragged("response")
        time.sleep(w.logprob_us * 1e-6 * int(resp.lengths.sum()))
        cu = np.asarray(resp.cu_seqlens, dtype=np.int64)
        return {"logprob": flowrl.RaggedArray(np.zeros(int(cu[-1]), np.float32), cu.copy())}

    return Pipeline(
        [prompts, rollout, reward, logprob],
        staleness=Staleness(max_staleness=0 if sync else 1, samples_per_version=b),
    )


def run_mode(w: Workload, mode: str, lengths: np.ndarray | None = None) -> dict[str, Any]:
    """Run the synthetic job once in ``mode`` ("sync" or "stream"); the trainer is this thread.

    Returns wall time (start of the pipeline to the end of the last update), the trainer's
    blocked time, per-step lags and the trained sample ids (in training order).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lengths = response_lengths(w) if lengths is None else lengths
    pipe = build_pipeline(w, lengths, mode)
    hub = flowrl.Hub(pipe.columns, config=flowrl.HubConfig(capacity=max(4 * w.batch, 1024)))
    loader = Loader(
        hub,
        task="trainer",
        columns=TRAIN_COLUMNS,
        batch_size=w.batch,
        groups=w.batch if w.trainer_order == "step" else None,  # whole steps, oldest first
    )
    waits: list[float] = []
    lags: list[int] = []
    sids: list[int] = []
    t0 = time.perf_counter()
    t_end = t0
    run = pipe.start(hub, loaders=[loader], max_samples=len(lengths), timeout=w.timeout_s)
    try:
        while True:
            t_wait = time.perf_counter()
            try:
                batch = next(loader)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t_wait)
            lags.append(int((hub.version - batch.meta.versions).max()))
            sids.extend(batch.numpy("sid").tolist())
            tokens = int(batch.ragged("response").lengths.sum())
            time.sleep(w.update_us * 1e-6 * tokens)  # forward + backward + optimizer step
            hub.publish_version(hub.version + 1)
            t_end = time.perf_counter()
        loader.close()
        result = run.result(timeout=w.timeout_s)
    finally:
        run.stop()
        hub.close()
    wall = t_end - t0
    busy = {name: round(s.busy_s / (wall * s.workers), 3) for name, s in result.stages.items()}
    busy["trainer"] = round(1.0 - sum(waits) / wall, 3)
    return {
        "wall_s": wall,
        "waits_s": waits,
        "update_idle_fraction": sum(waits) / wall,
        "update_idle_fraction_steady": sum(waits[1:]) / (t_end - t0 - waits[0]) if waits else 0.0,
        "lags": lags,
        "max_lag": max(lags, default=0),
        "trained_sids": sids,
        "stage_busy_fraction": busy,
    }


def synthetic(w: Workload) -> dict[str, Any]:
    """Both modes on the same drawn lengths; the JSON section for workload (b)."""
    warm = Workload(steps=2, batch=8, rollout_workers=2, rollout_us=1.0, update_us=1.0)
    for mode in MODES:  # first-run costs (lazy imports, first threads) hit neither mode
        run_mode(warm, mode)
    lengths = response_lengths(w)
    median = float(np.median(lengths))
    out: dict[str, Any] = {
        "params": msgspec.structs.asdict(w),
        "samples": int(lengths.size),
        "p99_over_median": round(float(np.percentile(lengths, 99)) / median, 2),
        "max_over_median": round(float(lengths.max()) / median, 2),
        "mean_tokens": round(float(lengths.mean()), 1),
        "rollout_to_trainer_capacity": round(w.rollout_capacity, 2),
    }
    runs = {mode: run_mode(w, mode, lengths) for mode in MODES}
    everyone = list(range(int(lengths.size)))
    out["sync_s"] = round(runs["sync"]["wall_s"], 3)
    out["stream_s"] = round(runs["stream"]["wall_s"], 3)
    out["speedup"] = round(runs["sync"]["wall_s"] / runs["stream"]["wall_s"], 3)
    for key in ("update_idle_fraction", "update_idle_fraction_steady"):
        out[key] = {m: round(runs[m][key], 4) for m in MODES}
    out["max_lag"] = {m: runs[m]["max_lag"] for m in MODES}
    out["trained_exactly_once"] = {m: sorted(runs[m]["trained_sids"]) == everyone for m in MODES}
    out["update_wait_s_per_step"] = {m: [round(x, 3) for x in runs[m]["waits_s"]] for m in MODES}
    out["stage_busy_fraction"] = {m: runs[m]["stage_busy_fraction"] for m in MODES}
    out["targets"] = {
        "speedup >= 1.3": _target(out["speedup"], out["speedup"] >= 1.3),
        "stream update_idle_fraction <= 0.10": _target(
            out["update_idle_fraction"]["stream"], out["update_idle_fraction"]["stream"] <= 0.10
        ),
        "stream max_lag <= 1": _target(out["max_lag"]["stream"], out["max_lag"]["stream"] <= 1),
        "p99_over_median >= 10": _target(out["p99_over_median"], out["p99_over_median"] >= 10),
    }
    return out


def grpo(steps: int, seed: int) -> dict[str, Any]:
    """The GRPO recipe at max_staleness 0 and 1; the JSON section for workload (a)."""
    from flowrl.recipes.grpo_arith import GRPOConfig, run

    known = set(GRPOConfig.__struct_fields__)
    small = {  # 64 samples per step, a short supervised warm-up (whichever knobs exist)
        "steps": steps,
        "seed": seed,
        "prompts_per_step": 8,
        "group_size": 8,
        "rollout_batch": 16,
        "pretrain_steps": 50,
        "clean_steps": 40,
        "noisy_steps": 10,
        "eval_size": 64,  # evaluation is outside rl_wall_s
        "progress": False,
    }
    small = {k: v for k, v in small.items() if k in known}
    summaries = {}
    for mode, staleness in (("sync", 0), ("stream", 1)):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = GRPOConfig(**small, max_staleness=staleness, out=tmp)
            summaries[mode] = run(cfg)
    params = {k: v for k, v in msgspec.structs.asdict(cfg).items() if k not in ("out", "progress")}
    params.pop("max_staleness")
    sync_s, stream_s = summaries["sync"]["rl_wall_s"], summaries["stream"]["rl_wall_s"]
    return {
        "params": params,
        "sync_s": round(sync_s, 3),
        "stream_s": round(stream_s, 3),
        "speedup": round(sync_s / stream_s, 3),
        "update_idle_fraction": {
            m: round(s["update_idle_fraction"], 4) for m, s in summaries.items()
        },
        "max_lag": {m: s["lag_max"] for m, s in summaries.items()},
        "samples_per_s": {m: round(s["samples_per_s"], 1) for m, s in summaries.items()},
        "stage_busy_fraction": {
            m: {k: round(v, 3) for k, v in s["stage_busy_fraction"].items()}
            for m, s in summaries.items()
        },
        "reward_last": {m: round(s["reward_last"], 3) for m, s in summaries.items()},
    }


def _target(value: Any, met: bool) -> dict[str, Any]:
    return {"value": value, "met": bool(met)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--workload", choices=["synthetic", "grpo", "all"], default="all")
    parser.add_argument("--steps", type=int, default=Workload().steps, help="synthetic steps")
    parser.add_argument("--batch", type=int, default=Workload().batch, help="synthetic B")
    parser.add_argument("--grpo-steps", type=int, default=20, help="GRPO RL steps")
    parser.add_argument("--seed", type=int, default=0, help="lengths (synthetic), GRPO seed")
    parser.add_argument(
        "--rollout-capacity",
        type=float,
        default=Workload().rollout_capacity,
        help="synthetic: tokens/s of all rollout workers over the trainer's (sets rollout_us)",
    )
    parser.add_argument(
        "--trainer-order",
        choices=["step", "ready"],
        default="step",
        help="synthetic: trainer takes whole steps oldest first, or any B ready samples",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    report: dict[str, Any] = {}
    if args.workload in ("synthetic", "all"):
        base = Workload()
        w = Workload(
            steps=args.steps,
            batch=args.batch,
            seed=args.seed,
            rollout_us=base.update_us * base.rollout_workers / args.rollout_capacity,
            trainer_order=args.trainer_order,
        )
        report["synthetic"] = synthetic(w)
    if args.workload in ("grpo", "all"):
        report["grpo"] = grpo(args.grpo_steps, args.seed)
    report["benchmark_wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def _print_table(report: dict[str, Any]) -> None:
    for name in ("synthetic", "grpo"):
        r = report.get(name)
        if r is None:
            continue
        print(f"== {name}")
        print(
            f"  sync {r['sync_s']:.2f}s  stream {r['stream_s']:.2f}s  speedup {r['speedup']:.2f}x"
        )
        idle = r["update_idle_fraction"]
        print(f"  update idle: sync {idle['sync']:.1%}  stream {idle['stream']:.1%}")
        print(f"  max lag: sync {r['max_lag']['sync']}  stream {r['max_lag']['stream']}")
        if "p99_over_median" in r:
            print(f"  p99/median {r['p99_over_median']}")
            for target, t in r["targets"].items():
                print(f"  target {target}: {t['value']} {'met' if t['met'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())

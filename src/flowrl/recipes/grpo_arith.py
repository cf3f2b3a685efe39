"""The main job: GRPO on CPU, streaming through the embedded hub.

A small transformer (``flowrl.models.TinyLM``) learns multi-digit addition with GRPO.
After a short supervised warm-up on noisy answers (so sampling is right only part of the
time), five stages stream micro-batches through an in-process hub while the trainer
iterates a ``flowrl.Loader``::

    prompts ─► rollout ─► reward ─► advantage ─┐
                  └─────► logprob ─────────────┴─► trainer (Loader) ─► WeightStore

* ``prompts`` (source): G copies of each problem, one GRPO group id per problem, one
  ``partition`` per training step; admission control keeps every trained sample within
  ``max_staleness`` policy versions.
* ``rollout`` (``rollout_workers`` workers): samples responses with the KV-cache sampler,
  using the newest published weights (pulled between micro-batches), and records the
  sampler's log-probs and the policy version of every token. It is durable at token
  granularity (``flowrl.rl.generate_resumable``): every ``append_every`` decoding steps it
  appends the new tokens to the hub, so a worker that takes over a preempted micro-batch
  resumes each response from its stored prefix instead of sampling it again. The workers
  are the instances of the scheduling layer
  (``flowrl.sched_hooks.RolloutScheduler``, on unless ``--no-schedule``): its
  forecaster, balancer and planner subscribe to the hub's events, and its sampler decides
  how many of the ready prompts each worker claims.
* ``reward``: the rule-based verifier.
* ``logprob``: recomputes response log-probs with the trainer's weights (the loss never
  trusts the sampler's) and with the frozen reference model.
* ``advantage``: group-normalised advantages over whole groups (``GroupSampler``).
* the trainer: clipped GRPO objective with a k3 KL penalty, one AdamW step per
  ``prompts_per_step * group_size`` samples, then publishes the weights (a new version).

Each run writes into a fresh folder ``OUT/<timestamp>/``: ``config.json``, one
``metrics.jsonl`` line per step, a checkpoint every ``--checkpoint-every`` steps and at the
end (``--resume RUN`` continues from the latest), and ``timeline.png`` (stage activity from
the hub's event stream). It logs a line every ``--log-every`` steps on stderr and prints a
JSON summary (with the scheduler's statistics under ``sched``) as the last line of stdout.
A configuration that cannot make progress is refused before the warm-up (``GRPOConfig``),
and a trainer that gets no batch for ``--stall-timeout`` seconds fails with a diagnosis.
``--task chain`` swaps the addition problems for chain sums whose worked solutions have
heavy-tailed lengths (``flowrl.recipes.grpo_task``), and ``--placement disaggregated``
runs the prompt source and the rollout workers in a process of their own, on their own CPU
cores, with the weights crossing in shared memory (``flowrl.recipes.grpo_placement``).
The engines underneath are chosen with ``--engine`` (the rollout's sampler: builtin,
torch or vllm; ``flowrl.recipes.grpo_rollout``), ``--trainer`` (the optimizer step:
builtin, torch or deepspeed; ``flowrl.recipes.grpo_update``) and ``--model`` (tinylm or a
Hugging Face llama); the defaults are the path described above.
A synchronous run (``max_staleness`` 0) with one rollout worker (the
default) is reproducible for a seed; with several, which worker samples which prompt
depends on timing, and so does each micro-batch's random stream.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

import flowrl
from flowrl import ChromeTrace, Loader, Timeline, WeightStore, serve_dashboard, serve_metrics
from flowrl.errors import ConfigError
from flowrl.recipes.checkpoint import (
    checkpoints,
    load_latest_checkpoint,
    new_run_dir,
    read_config,
    save_checkpoint,
    write_config,
)
from flowrl.recipes.grpo_cli import main
from flowrl.recipes.grpo_config import GRPOConfig, check_resumable
from flowrl.recipes.grpo_placement import Disaggregated, plan_cores
from flowrl.recipes.grpo_rollout import RolloutBackend
from flowrl.recipes.grpo_stages import (
    STAGE_NAMES,
    TRAIN_COLUMNS,
    build_pipeline,
    build_scheduler,
    rollout_stage,
    trainer_pipeline,
)
from flowrl.recipes.grpo_task import make_task, max_new_tokens
from flowrl.recipes.grpo_trainer import Trainer, evaluate, update_policy
from flowrl.recipes.grpo_update import checkpoint_globals
from flowrl.recipes.interrupt import CtrlC
from flowrl.recipes.progress import bar, format_step, log
from flowrl.recipes.stall import HEALTH_CHECK_S, next_batch
from flowrl.tracking import (
    ConsoleTracker,
    JsonlTracker,
    Tracker,
    Tracking,
    parse_backends,
)

__all__ = [
    "GRPOConfig",
    "Interrupted",
    "build_pipeline",
    "build_scheduler",
    "main",
    "rollout_stage",
    "run",
    "update_policy",
]


def run(cfg: GRPOConfig, *, resume: str | Path | None = None) -> dict[str, Any]:
    """Run the job; returns the summary (also written as the last line of metrics.jsonl).

    ``resume``: the folder of an earlier run; it continues from its latest checkpoint up
    to ``cfg.steps`` (``cfg`` must agree with the run's ``config.json`` but for the
    fields in ``RESUMABLE_FIELDS``).
    """
    torch.manual_seed(cfg.seed)
    # One intra-op thread: several stage threads compute at once, and these tiny ops run
    # 10x slower when threads oversubscribe a 2-core machine.
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    cores = plan_cores(cfg)  # a machine that cannot hold the placement is refused now
    run_dir, checkpoint = _open_run(cfg, resume)
    log.info("run folder: %s", run_dir)
    split = None
    try:
        with CtrlC() as ctrl_c:
            if cores is not None:  # the rollout process starts now; it imports in the warm-up
                start = 0 if checkpoint is None else checkpoint["step"]
                split = Disaggregated(cfg, cores, start_step=start)
            return _train(cfg, run_dir, checkpoint, resume, t_start, split, ctrl_c)
    except KeyboardInterrupt:
        raise Interrupted(run_dir) from None
    finally:
        if split is not None:
            split.close()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run (a ``KeyboardInterrupt`` still); its folder can be resumed."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        try:  # one line per step, then the summary
            with open(run_dir / "metrics.jsonl") as f:
                self.steps_done = sum(1 for line in f if not line.startswith('{"summary"'))
        except FileNotFoundError:  # stopped in the warm-up
            self.steps_done = 0
        written = checkpoints(run_dir)  # each written whole (renamed into place)
        self.checkpoint: Path | None = written[0] if written else None
        super().__init__(self.advice())

    def advice(self) -> str:
        """One line: where the run stopped and how to go on."""
        if self.checkpoint is None:
            return (
                f"interrupted after {self.steps_done} steps, before the first checkpoint "
                f"(--checkpoint-every); start a new run (this one is in {self.run_dir})"
            )
        return (
            f"interrupted after {self.steps_done} steps; continue from the latest checkpoint "
            f"({self.checkpoint.name}) with: flowrl run grpo --resume {self.run_dir}"
        )


def _train(
    cfg: GRPOConfig,
    run_dir: Path,
    checkpoint: dict[str, Any] | None,
    resume: str | Path | None,
    t_start: float,
    split: Disaggregated | None,
    ctrl_c: CtrlC,
) -> dict[str, Any]:
    task = make_task(cfg, cfg.seed)
    held_out = list(make_task(cfg, 10_000 + cfg.seed).sample(cfg.eval_size))
    max_new = max_new_tokens(cfg)
    batch_size = cfg.prompts_per_step * cfg.group_size
    trainer = Trainer.start(cfg, task, held_out, max_new, checkpoint)
    # The prompts start from the seed, not where the warm-up left ``task``'s stream: a
    # resumed run (no warm-up) then trains on the same problems as an uninterrupted one.
    task = make_task(cfg, cfg.seed)
    start = trainer.step

    store = WeightStore(trainer.policy(), version=trainer.version)
    backend = RolloutBackend(
        cfg, store, trainer.reference, max_new, first_sample=start * batch_size
    )
    scheduler = None
    hub: flowrl.HubClient
    if split is None:
        scheduler = build_scheduler(cfg, max_new) if cfg.schedule else None
        pipe = build_pipeline(
            cfg, task, store, trainer.reference, backend, scheduler, start_step=start
        )
        hub = flowrl.Hub(pipe.columns, config=flowrl.HubConfig(capacity=cfg.hub_capacity))
    else:  # the rollout process generates; this one scores, recomputes and trains
        pipe = trainer_pipeline(
            cfg, task, store, trainer.reference, whole_steps=cfg.max_staleness == 0
        )
        hub = split.hub
    pipe.register(hub)  # now, not when the pipeline thread starts: a stall report lists all
    if trainer.version:
        hub.publish_version(trainer.version)  # admission control counts from here
    timeline, trace = Timeline(), ChromeTrace()
    hub.subscribe(timeline)
    hub.subscribe(trace)
    if scheduler is not None:
        hub.subscribe(scheduler.observe, strict=True)  # a policy: failures fail the run
    loader = Loader(
        hub,
        task="trainer",
        columns=TRAIN_COLUMNS,
        batch_size=batch_size,
        groups=cfg.group_size,
        timeout=min(cfg.stall_timeout, HEALTH_CHECK_S),
    )
    metrics = page = None
    if cfg.metrics_port:
        metrics = serve_metrics(hub, port=cfg.metrics_port, loaders=[loader])
        log.info("Prometheus metrics: %s", metrics.url)
    if cfg.dashboard:
        page = serve_dashboard(hub, port=cfg.dashboard, loaders=[loader])
        log.info("live page of the hub: %s", page.url)
    tracking = _tracking(cfg, run_dir, trainer.metrics, page)
    # The RL loop's clock starts once the rollout process can generate: its start-up
    # (interpreter, imports, model) is not the loop's, and a fresh run's warm-up hides it.
    ready_wait_s = None if split is None else split.wait_ready(cfg.stall_timeout)
    t_rl = time.time()
    if split is None:
        run_ = pipe.start(hub, loaders=[loader], max_samples=(cfg.steps - start) * batch_size)
    else:
        split.start()  # the trainer moves to its cores; the warm-up had them all
        split.publish(trainer.update.weights(), trainer.version)  # the rollout waits for it
        run_ = pipe.start(hub, loaders=[loader])
    trained = Trained()
    steps_bar = bar(cfg.steps, "grpo", enabled=cfg.progress)
    steps_bar.update(start)
    saved = None
    step_start, step_cpu = t_rl, time.process_time()
    try:
        while trainer.step < cfg.steps:
            ctrl_c.check()  # (a Ctrl-C a finalizer swallowed stops the run here)
            t_wait = time.time()
            batch = next_batch(
                loader,
                hub,
                timeline,
                step=trainer.step,
                stall_timeout=cfg.stall_timeout,
                health=None if split is None else split.check,
            )
            trained.add(batch.meta)
            t_got = time.time()
            waited = t_got - t_wait
            trace.span("wait for a batch", t_wait, t_got, group="trainer", step=trainer.step)
            m = trainer.update.step(batch)
            m.update(_batch_lag(store.version, batch))
            trainer.version = store.publish_weights(trainer.update.weights())
            if split is not None:  # the weights first: the version admits new prompts
                split.publish(trainer.update.weights(), trainer.version)
            hub.publish_version(trainer.version)
            m.update(
                step=trainer.step,
                version=trainer.version,
                wait_s=waited,
                step_s=time.time() - step_start,  # this step's wall time, waits included
                cpu_s=time.process_time() - step_cpu,  # the process's CPU, every thread
                samples_per_s=(trainer.step + 1 - start) * batch_size / (time.time() - t_rl),
                busy={  # stage busy fractions over this step, from the event stream
                    name: round(timeline.busy_fraction(name, step_start, time.time()), 3)
                    for name in STAGE_NAMES
                },
            )
            trace.span(f"step {trainer.step + 1}", t_got, time.time(), group="trainer")
            step_start, step_cpu = time.time(), time.process_time()
            trainer.finish_step(m)
            tracking.log(m, step=trainer.step)
            steps_bar.set_postfix(reward=f"{m['reward']:.3f}", lag=f"{m['lag_mean']:.2f}")
            steps_bar.update(1)
            done = trainer.step
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                saved = save_checkpoint(run_dir, done, trainer.state_dict(cfg))
        steps_bar.close()
        loader.close()
        rollout_side = None if split is None else split.finish()
        run_.stop()
        result = run_.result(timeout=60)
        policy = trainer.policy()  # the trained weights, before the engines close
    except BaseException:
        steps_bar.close()
        tracking.finish()
        _abandon(run_, loader, hub)
        raise
    finally:
        backend.close()
        trainer.update.close()
        for server in (metrics, page):
            if server is not None:
                server.close()
    t_end = time.time()
    timeline.save_png(str(run_dir / "timeline.png"), title="flowrl GRPO: stage activity")
    trace.save(run_dir / "trace.json")
    summary = {
        "steps": cfg.steps,
        "run_dir": str(run_dir),
        "resumed_from": None if resume is None else start,
        "checkpoint": None if saved is None else str(saved),
        **_rewards_and_accuracy(trainer, evaluate(policy, task, held_out, max_new), cfg.steps),
        "wall_s": time.perf_counter() - t_start,
        **_session_figures(trainer.metrics[start:], batch_size, t_end - t_rl),
        "stage_busy_fraction": {
            name: timeline.busy_fraction(name, t_rl, t_end) for name in timeline.spans()
        },
        "max_staleness": cfg.max_staleness,
        "placement": cfg.placement,
        "cores": None if split is None else msgspec.to_builtins(split.cores),
        "rollout_ready_wait_s": ready_wait_s,
        "stage_samples": {
            **(rollout_side or {}),
            **{n: s.samples for n, s in result.stages.items()},
        },
        **trained.summary(),
        "timeline_png": str(run_dir / "timeline.png"),
        "trace_json": str(run_dir / "trace.json"),
        "sched": None if scheduler is None else msgspec.to_builtins(scheduler.statistics()),
    }
    jsonl = tracking.trackers.get("jsonl")
    if isinstance(jsonl, JsonlTracker):
        jsonl.write_line({"summary": summary})
    tracking.finish()
    hub.close()
    log.info(
        "done: reward %.3f -> %.3f, held-out greedy accuracy %.3f -> %.3f; outputs in %s",
        summary["reward_first"],
        summary["reward_last"],
        summary["eval_greedy_before"],
        summary["eval_greedy_after"],
        run_dir,
    )
    return summary


class Trained:
    """Which samples the trainer took, and of which versions: the summary shows that each
    was trained once and that new versions reached the rollout."""

    def __init__(self) -> None:
        self._indices: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []

    def add(self, meta: flowrl.BatchMeta) -> None:
        self._indices.append(meta.indices)
        self._versions.append(meta.versions)

    def summary(self) -> dict[str, Any]:
        indices = np.concatenate(self._indices) if self._indices else np.zeros(0, np.int64)
        versions = np.concatenate(self._versions) if self._versions else np.zeros(1, np.int64)
        return {
            "trained_samples": int(indices.size),
            "trained_distinct": int(np.unique(indices).size),
            "sample_versions": [int(versions.min()), int(versions.max())],
        }


def _batch_lag(version: int, batch: flowrl.Batch) -> dict[str, Any]:
    """How many versions behind ``version`` the batch's samples (and tokens) are."""
    lag = version - batch.meta.versions
    token_lag = version - batch.packed("response_versions")[0]
    return {
        "lag_mean": float(lag.mean()),
        "lag_max": int(lag.max()),
        "token_lag_mean": float(token_lag.mean()) if token_lag.size else 0.0,
    }


def _rewards_and_accuracy(
    trainer: Trainer, eval_after: dict[str, float], steps: int
) -> dict[str, float]:
    """Mean batch reward of the run's first and last steps; held-out accuracy."""
    window = max(1, min(20, steps // 5))
    rewards = [m["reward"] for m in trainer.metrics]
    return {
        "reward_first": float(np.mean(rewards[:window])),
        "reward_last": float(np.mean(rewards[-window:])),
        "eval_sampled_before": trainer.eval_before["sampled"],
        "eval_sampled_after": eval_after["sampled"],
        "eval_greedy_before": trainer.eval_before["greedy"],
        "eval_greedy_after": eval_after["greedy"],
    }


def _session_figures(
    session: list[dict[str, Any]], batch_size: int, rl_wall_s: float
) -> dict[str, Any]:
    """Throughput, the trainer's idle share and version lag over this process's steps."""
    return {
        "rl_wall_s": rl_wall_s,
        "samples_per_s": len(session) * batch_size / rl_wall_s,
        "update_idle_fraction": float(sum(m["wait_s"] for m in session) / rl_wall_s),
        "lag_mean": float(np.mean([m["lag_mean"] for m in session])),
        "lag_max": max(m["lag_max"] for m in session),
    }


def _open_run(cfg: GRPOConfig, resume: str | Path | None) -> tuple[Path, dict[str, Any] | None]:
    """A fresh run folder, or the resumed run's folder and its latest checkpoint."""
    if resume is None:
        try:
            run_dir = new_run_dir(cfg.out)
            write_config(run_dir, cfg)
        except OSError as exc:  # a file in the way, a read-only mount, a full disk
            raise ConfigError(
                f"--out {cfg.out!r}: cannot create a run folder there ({exc})"
            ) from None
        return run_dir, None
    run_dir = Path(resume)
    check_resumable(read_config(run_dir), cfg)
    state = load_latest_checkpoint(run_dir, allowed=checkpoint_globals(cfg))
    if cfg.steps <= state["step"]:
        raise ConfigError(
            f"--steps {cfg.steps}: the run in {run_dir} has done {state['step']} steps "
            f"already; pass --steps N with N > {state['step']} to continue it"
        )
    write_config(run_dir, cfg)
    return run_dir, state


def _tracking(
    cfg: GRPOConfig, run_dir: Path, metrics: list[dict[str, Any]], page: Tracker | None
) -> Tracking:
    """The run's metrics sinks (``--logger``, and the live page's curves); a resumed run's
    steps so far are kept in ``metrics.jsonl``, and the console line is the recipe's own,
    every ``--log-every``."""
    sinks: list[str | Tracker] = [] if page is None else [page]
    for name in parse_backends(cfg.logger):
        if name == "console":
            sinks.append(
                ConsoleTracker(
                    every=cfg.log_every,
                    last=cfg.steps,
                    format=lambda m, step: format_step(m, cfg.steps),
                    logger=log,
                )
            )
        elif name == "jsonl":
            sinks.append(JsonlTracker(run_dir / "metrics.jsonl", history=metrics))
        else:
            sinks.append(name)
    return Tracking(sinks, run_dir=run_dir, config=msgspec.to_builtins(cfg))


def _abandon(run_: Any, loader: Loader, hub: flowrl.Hub) -> None:
    """Stop everything after a failure; the failure that got us here is the one raised."""
    loader.close()
    run_.stop()
    try:
        run_.result(timeout=60)
    except BaseException as exc:  # the first failure is the one raised
        log.debug("the pipeline also failed while stopping: %s", exc)
    hub.close()

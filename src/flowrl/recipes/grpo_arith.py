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
  (``flowrl._pipeline.sched_hooks.RolloutScheduler``, on unless ``--no-schedule``): its
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
A synchronous run (``max_staleness`` 0) with one rollout worker (the
default) is reproducible for a seed; with several, which worker samples which prompt
depends on timing, and so does each micro-batch's random stream.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import IO, Any, cast

import msgspec
import numpy as np
import torch

import flowrl
from flowrl import (
    Column,
    GroupSampler,
    Loader,
    Pipeline,
    Rows,
    StageContext,
    StageSpec,
    Staleness,
    Timeline,
    WeightStore,
)
from flowrl._pipeline.sched_hooks import RolloutScheduler
from flowrl.errors import ConfigError, Timeout
from flowrl.models import TinyLM, TinyLMConfig, generate
from flowrl.recipes.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    new_run_dir,
    read_config,
    save_checkpoint,
    write_config,
)
from flowrl.recipes.cli import config_errors, parse_config
from flowrl.recipes.grpo_config import (
    MAX_SEQ_LEN,
    N_HEADS,
    GRPOConfig,
    check_resumable,
    groups_per_put,
)
from flowrl.recipes.progress import bar, format_step, log, log_to_stderr
from flowrl.recipes.stall import next_batch
from flowrl.rl import (
    build_batch,
    generate_resumable,
    group_advantages,
    grpo_loss,
    token_logprobs,
)
from flowrl.sched import (
    BalancerConfig,
    ForecastConfig,
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    PlannerConfig,
    kv_capacity_tokens,
)
from flowrl.tasks import EOS_ID, VOCAB_SIZE, ArithTask, pretrain, verify

__all__ = [
    "GRPOConfig",
    "build_pipeline",
    "build_scheduler",
    "main",
    "rollout_stage",
    "run",
    "update_policy",
]


def build_scheduler(cfg: GRPOConfig, max_new: int) -> RolloutScheduler:
    """The scheduling layer with the rollout workers as its instances.

    A CPU worker runs one "mode"; the cost model is a TinyLM-shaped model on a CPU-core-like
    device, so the planner's predictions are in the right units (they only compare workers).
    Response lengths are a few tokens, hence one-token length buckets.
    """
    model = ModelSpec(
        name="tinylm",
        params=12.0 * 2 * cfg.d_model**2 + VOCAB_SIZE * cfg.d_model,
        layers=2,
        hidden=cfg.d_model,
        n_heads=N_HEADS,
        n_kv_heads=N_HEADS,
        head_dim=cfg.d_model // N_HEADS,
        dtype_bytes=4,
    )
    hw = HardwareSpec(
        hbm_bytes=1e9, hbm_bw=1e10, flops=2e10, link_bw=1e10, net_bw=1e10, gpus_per_node=1
    )
    mode = ParallelMode(name="cpu", gpus=1, tp=1)
    return RolloutScheduler(
        task="Rollout",
        workers=cfg.rollout_workers,
        mode=mode,
        planner=PlannerConfig(
            model=model, hw=hw, bs_max=cfg.rollout_batch, bucket=1, method="greedy"
        ),
        balancer=BalancerConfig(move_running=False),
        forecast=ForecastConfig(median=3.0, sigma=0.5, max_len=max_new, grid_step=1, bucket=1),
        kv_capacity=kv_capacity_tokens(mode, model, hw),
        bs_max=cfg.rollout_batch,
    )


def build_pipeline(
    cfg: GRPOConfig,
    store: WeightStore,
    reference: TinyLM,
    scheduler: RolloutScheduler | None = None,
    *,
    start_step: int = 0,
) -> Pipeline:
    """The five stages, closed over the run's config, weights, reference and scheduler.

    ``start_step``: the stream of problems starts at this step's (a resumed run).
    """
    task = ArithTask(digits=(1, cfg.max_digits), seed=cfg.seed)
    max_new = task.max_response_len + 1
    g = cfg.group_size
    per_put = groups_per_put(cfg)
    prompts = prompts_stage(cfg, task, start_step)
    rollout = rollout_stage(
        cfg,
        store,
        reference,
        scheduler,
        max_new,
        first_sample=start_step * cfg.prompts_per_step * g,
    )

    @flowrl.stage(
        inputs=["prompt", "response"],
        outputs=[Column.scalar("reward", "float32")],
        batch_size=cfg.rollout_batch,
        min_batch=1,
    )
    def reward(batch: flowrl.Batch) -> dict[str, Any]:
        pairs = zip(batch.ragged("prompt"), batch.ragged("response"), strict=True)
        scores = [verify(p.tolist(), r.tolist()) for p, r in pairs]
        return {"reward": np.array(scores, dtype=np.float32)}

    @flowrl.stage(
        inputs=["prompt", "response"],
        outputs=[
            Column.ragged("old_logprobs", "float32"),
            Column.ragged("ref_logprobs", "float32"),
        ],
        batch_size=cfg.rollout_batch,
        min_batch=1,
    )
    class Logprob:
        def setup(self) -> None:
            self.model = copy.deepcopy(reference).eval()
            self.version = -1

        def __call__(self, batch: flowrl.Batch) -> dict[str, Any]:
            self.version = store.pull(self.model, self.version)
            ids, mask, starts, cu = _model_inputs(batch)
            with torch.no_grad():
                old = token_logprobs(self.model, ids, mask, starts, cu, temperature=cfg.temperature)
                ref = token_logprobs(reference, ids, mask, starts, cu, temperature=cfg.temperature)
            cu_np = cu.numpy()
            return {
                "old_logprobs": flowrl.RaggedArray(old.numpy(), cu_np),
                "ref_logprobs": flowrl.RaggedArray(ref.numpy(), cu_np.copy()),
            }

    @flowrl.stage(
        inputs=["reward"],
        outputs=[Column.scalar("advantage", "float32")],
        batch_size=per_put * g,
        sampler=GroupSampler(g),
    )
    def advantage(batch: flowrl.Batch) -> dict[str, Any]:
        adv = group_advantages(batch.torch("reward"), torch.from_numpy(batch.meta.groups))
        return {"advantage": adv.numpy()}

    stages = cast("tuple[StageSpec, ...]", (prompts, rollout, reward, Logprob, advantage))
    return Pipeline(
        stages,
        staleness=Staleness(
            max_staleness=cfg.max_staleness, samples_per_version=cfg.prompts_per_step * g
        ),
    )


def prompts_stage(cfg: GRPOConfig, task: ArithTask, start_step: int) -> StageSpec:
    """The source: G copies of each problem, one group id per problem, one partition per step.

    It puts :func:`groups_per_put` groups at a time (a divisor of the step's groups: a put
    never spans two steps). ``start_step``: skip the problems of the steps before it.
    """
    g, per_step, per_put = cfg.group_size, cfg.prompts_per_step, groups_per_put(cfg)
    first_group = start_step * per_step
    task.sample(first_group)  # the stream of problems continues where the run stopped

    @flowrl.stage(outputs=[Column.ragged("prompt", "int64")], batch_size=per_put * g)
    def prompts() -> Any:
        group = first_group
        while True:
            problems = task.sample(per_put)
            ids = [np.asarray(p.prompt_ids, dtype=np.int64) for p in problems for _ in range(g)]
            groups = np.repeat(np.arange(group, group + per_put), g)
            step = group // per_step
            group += per_put
            yield Rows({"prompt": ids}, groups=groups, partition=f"step-{step}")

    return prompts


def rollout_stage(
    cfg: GRPOConfig,
    store: WeightStore,
    reference: TinyLM,
    scheduler: RolloutScheduler | None,
    max_new: int,
    *,
    first_sample: int = 0,
) -> StageSpec:
    """The rollout workers: sample responses with the newest published weights.

    Each micro-batch's random stream is seeded by its first sample's position in the run's
    stream (``first_sample`` + its hub index), so a resumed synchronous run samples what
    the uninterrupted run would have.
    """

    @flowrl.stage(
        inputs=["prompt"],
        outputs=[
            Column.ragged("response", "int64"),
            Column.ragged("sample_logprobs", "float32"),
            Column.ragged("response_versions", "int64"),
        ],
        batch_size=cfg.rollout_batch,
        min_batch=1,
        workers=cfg.rollout_workers,
        sampler=None if scheduler is None else scheduler.sampler,
    )
    class Rollout:
        def setup(self, ctx: StageContext) -> None:
            if scheduler is not None:
                scheduler.bind(ctx.worker)
            self.model = copy.deepcopy(reference).eval()
            self.version = store.pull(self.model, -1)
            self.hub = ctx.hub

        def __call__(self, batch: flowrl.Batch) -> Rows:
            self.version = store.pull(self.model, self.version)  # between micro-batches
            position = first_sample + int(batch.indices[0])
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + position)
            with torch.no_grad():
                out = generate_resumable(
                    self.model,
                    self.hub,
                    batch.meta,
                    batch.ragged("prompt").tolist(),
                    max_new,
                    version=self.version,
                    eos_id=EOS_ID,
                    temperature=cfg.temperature,
                    generator=gen,
                    append_every=cfg.append_every,
                )
            return Rows(
                {
                    "response": out.responses,
                    "sample_logprobs": out.logprobs,
                    "response_versions": out.versions,
                },
                # A resumed response mixes versions: each sample counts as old as its
                # oldest token, so the staleness bound holds for every token.
                version=out.sample_versions(self.version),
                tokens=out.responses.lengths,  # response lengths, for the forecaster
            )

    return cast(StageSpec, Rollout)


STAGE_NAMES = ("Rollout", "reward", "Logprob", "advantage", "trainer")
TRAIN_COLUMNS = [
    "prompt",
    "response",
    "response_versions",
    "old_logprobs",
    "ref_logprobs",
    "advantage",
    "reward",
]


def _model_inputs(batch: flowrl.Batch) -> tuple[torch.Tensor, ...]:
    prompts = [torch.from_numpy(p.copy()) for p in batch.ragged("prompt")]
    responses = [torch.from_numpy(r.copy()) for r in batch.ragged("response")]
    return build_batch(prompts, responses)


def evaluate(model: TinyLM, problems: list[Any], max_new: int) -> dict[str, float]:
    """Accuracy on held-out problems, sampled at temperature 1 and greedy."""
    prompts = [p.prompt_ids for p in problems]
    scores = {}
    for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        gen = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            out = generate(
                model, prompts, max_new, temperature=temperature, eos_id=EOS_ID, generator=gen
            )
        pairs = zip(problems, out.responses(), strict=True)
        scores[name] = float(np.mean([verify(p.prompt_ids, r) for p, r in pairs]))
    return scores


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
    run_dir, checkpoint = _open_run(cfg, resume)
    log.info("run folder: %s", run_dir)
    task = ArithTask(digits=(1, cfg.max_digits), seed=cfg.seed)
    held_out = ArithTask(digits=(1, cfg.max_digits), seed=10_000 + cfg.seed).sample(cfg.eval_size)
    max_new = task.max_response_len + 1
    trainer = _Trainer.start(cfg, task, held_out, max_new, checkpoint)
    start = trainer.step

    store = WeightStore(trainer.model, version=trainer.version)
    scheduler = build_scheduler(cfg, max_new) if cfg.schedule else None
    pipe = build_pipeline(cfg, store, trainer.reference, scheduler, start_step=start)
    hub = flowrl.Hub(pipe.columns, config=flowrl.HubConfig(capacity=cfg.hub_capacity))
    pipe.register(hub)  # now, not when the pipeline thread starts: a stall report lists all
    if trainer.version:
        hub.publish_version(trainer.version)  # admission control counts from here
    timeline = Timeline()
    hub.subscribe(timeline)
    if scheduler is not None:
        hub.subscribe(scheduler.observe, strict=True)  # a policy: failures fail the run
    batch_size = cfg.prompts_per_step * cfg.group_size
    loader = Loader(
        hub,
        task="trainer",
        columns=TRAIN_COLUMNS,
        batch_size=batch_size,
        groups=cfg.group_size,
        timeout=cfg.stall_timeout,
    )
    metrics_file = _metrics_file(run_dir, trainer.metrics)
    t_rl = time.time()
    run_ = pipe.start(hub, loaders=[loader], max_samples=(cfg.steps - start) * batch_size)
    steps_bar = bar(cfg.steps, "grpo", enabled=cfg.progress)
    steps_bar.update(start)
    saved = None
    step_start = t_rl
    try:
        while trainer.step < cfg.steps:
            t_wait = time.perf_counter()
            batch = next_batch(loader, hub, timeline, step=trainer.step)
            waited = time.perf_counter() - t_wait
            m = update_policy(cfg, trainer.model, trainer.opt, batch)
            m.update(_batch_lag(store.version, batch))
            trainer.version = store.publish(trainer.model)
            hub.publish_version(trainer.version)
            m.update(
                step=trainer.step,
                version=trainer.version,
                wait_s=waited,
                samples_per_s=(trainer.step + 1 - start) * batch_size / (time.time() - t_rl),
                busy={  # stage busy fractions over this step, from the event stream
                    name: round(timeline.busy_fraction(name, step_start, time.time()), 3)
                    for name in STAGE_NAMES
                },
            )
            step_start = time.time()
            trainer.finish_step(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            steps_bar.set_postfix(reward=f"{m['reward']:.3f}", lag=f"{m['lag_mean']:.2f}")
            steps_bar.update(1)
            done = trainer.step
            if cfg.log_every and (done % cfg.log_every == 0 or done == cfg.steps):
                log.info("%s", format_step(m, cfg.steps))
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                saved = save_checkpoint(run_dir, done, trainer.state_dict(cfg))
        steps_bar.close()
        loader.close()
        run_.stop()
        result = run_.result(timeout=60)
    except BaseException:
        steps_bar.close()
        metrics_file.close()
        _abandon(run_, loader, hub)
        raise
    t_end = time.time()
    timeline.save_png(str(run_dir / "timeline.png"), title="flowrl GRPO: stage activity")
    summary = {
        "steps": cfg.steps,
        "run_dir": str(run_dir),
        "resumed_from": None if resume is None else start,
        "checkpoint": None if saved is None else str(saved),
        **_rewards_and_accuracy(trainer, evaluate(trainer.model, held_out, max_new), cfg.steps),
        "wall_s": time.perf_counter() - t_start,
        **_session_figures(trainer.metrics[start:], batch_size, t_end - t_rl),
        "stage_busy_fraction": {
            name: timeline.busy_fraction(name, t_rl, t_end) for name in timeline.spans()
        },
        "max_staleness": cfg.max_staleness,
        "stage_samples": {n: s.samples for n, s in result.stages.items()},
        "timeline_png": str(run_dir / "timeline.png"),
        "sched": None if scheduler is None else msgspec.to_builtins(scheduler.statistics()),
    }
    metrics_file.write(json.dumps({"summary": summary}) + "\n")
    metrics_file.close()
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


@dataclasses.dataclass
class _Trainer:
    """The trainer's side of a run: the policy, its optimizer, the frozen reference, and
    how far it got — what a checkpoint holds."""

    model: TinyLM
    opt: torch.optim.Optimizer
    reference: TinyLM
    eval_before: dict[str, float]
    step: int = 0
    version: int = 0
    metrics: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def start(
        cls,
        cfg: GRPOConfig,
        task: ArithTask,
        held_out: list[Any],
        max_new: int,
        checkpoint: dict[str, Any] | None,
    ) -> _Trainer:
        """A warmed-up policy, or the checkpoint's."""
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        if checkpoint is None:
            warm_up(cfg, model, task)
            model.eval()
            eval_before = evaluate(model, held_out, max_new)
            log.info(
                "held-out accuracy before RL: %.3f sampled, %.3f greedy",
                eval_before["sampled"],
                eval_before["greedy"],
            )
            return cls(model, opt, copy.deepcopy(model).requires_grad_(False), eval_before)
        model.load_state_dict(checkpoint["model"])
        model.eval()
        reference = copy.deepcopy(model).requires_grad_(False)
        reference.load_state_dict(checkpoint["reference"])
        opt.load_state_dict(checkpoint["optimizer"])
        torch.set_rng_state(checkpoint["torch_rng"])
        log.info(
            "resumed at step %d (policy version %d)", checkpoint["step"], checkpoint["version"]
        )
        return cls(
            model,
            opt,
            reference,
            checkpoint["eval_before"],
            checkpoint["step"],
            checkpoint["version"],
            list(checkpoint["metrics"]),
        )

    def finish_step(self, metrics: dict[str, Any]) -> None:
        self.metrics.append(metrics)
        self.step += 1

    def state_dict(self, cfg: GRPOConfig) -> dict[str, Any]:
        """The checkpoint after ``self.step`` steps (plain data: loads ``weights_only``)."""
        return {
            "step": self.step,
            "version": self.version,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "reference": self.reference.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "eval_before": self.eval_before,
            "metrics": self.metrics,
            "config": msgspec.to_builtins(cfg),
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
    trainer: _Trainer, eval_after: dict[str, float], steps: int
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


def build_model(cfg: GRPOConfig) -> TinyLM:
    """The policy, freshly initialised (from the global torch seed)."""
    return TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB_SIZE,
            d_model=cfg.d_model,
            n_layers=2,
            n_heads=N_HEADS,
            d_ff=4 * cfg.d_model,
            max_seq_len=MAX_SEQ_LEN,
        )
    )


def warm_up(cfg: GRPOConfig, model: TinyLM, task: ArithTask) -> None:
    """Learn the task, then unlearn part of it on noisy answers, so the policy's samples
    are right only some of the time and GRPO has a signal to climb."""
    total = cfg.clean_steps + cfg.noisy_steps
    log.info(
        "warm-up: %d supervised steps on correct answers, then %d on answers %.0f%% of which "
        "have a wrong digit",
        cfg.clean_steps,
        cfg.noisy_steps,
        100 * cfg.noise,
    )
    with bar(total, "warm-up", enabled=cfg.progress) as warm_bar:
        pretrain(
            model, task, cfg.clean_steps, lr=3e-3, noise=0.0, seed=cfg.seed, on_step=warm_bar.update
        )
        pretrain(
            model,
            task,
            cfg.noisy_steps,
            lr=3e-4,
            noise=cfg.noise,
            seed=cfg.seed + 1,
            on_step=warm_bar.update,
        )


def _open_run(cfg: GRPOConfig, resume: str | Path | None) -> tuple[Path, dict[str, Any] | None]:
    """A fresh run folder, or the resumed run's folder and its latest checkpoint."""
    if resume is None:
        run_dir = new_run_dir(cfg.out)
        write_config(run_dir, cfg)
        return run_dir, None
    run_dir = Path(resume)
    check_resumable(read_config(run_dir), cfg)
    state = load_checkpoint(latest_checkpoint(run_dir))
    if cfg.steps <= state["step"]:
        raise ConfigError(
            f"--steps {cfg.steps}: the run in {run_dir} has done {state['step']} steps "
            f"already; pass --steps N with N > {state['step']} to continue it"
        )
    write_config(run_dir, cfg)
    return run_dir, state


def _metrics_file(run_dir: Path, metrics: list[dict[str, Any]]) -> IO[str]:
    """``metrics.jsonl`` holding the lines of ``metrics`` (a resumed run's so far)."""
    f = open(run_dir / "metrics.jsonl", "w")  # noqa: SIM115 - closed by run()
    for m in metrics:
        f.write(json.dumps(m) + "\n")
    return f


def _abandon(run_: Any, loader: Loader, hub: flowrl.Hub) -> None:
    """Stop everything after a failure; the failure that got us here is the one raised."""
    loader.close()
    run_.stop()
    try:
        run_.result(timeout=60)
    except BaseException as exc:  # the first failure is the one raised
        log.debug("the pipeline also failed while stopping: %s", exc)
    hub.close()


def update_policy(
    cfg: GRPOConfig, model: TinyLM, opt: torch.optim.Optimizer, batch: flowrl.Batch
) -> dict[str, Any]:
    """One optimizer step on a training batch (clipped GRPO with a k3 KL penalty)."""
    model.train()
    ids, mask, starts, cu = _model_inputs(batch)
    old, _ = batch.packed("old_logprobs", torch=True)
    ref, _ = batch.packed("ref_logprobs", torch=True)
    logprobs = token_logprobs(model, ids, mask, starts, cu, temperature=cfg.temperature)
    loss, m = grpo_loss(
        logprobs,
        old,
        batch.torch("advantage"),
        cu,
        ref_logprobs=ref,
        clip_eps=cfg.clip_eps,
        kl_coef=cfg.kl_coef,
    )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()
    m["loss"] = loss.item()
    m["reward"] = float(batch.numpy("reward").mean())
    return m


PROG = "flowrl run grpo"
DESCRIPTION = """\
GRPO on CPU, streaming through the embedded hub: a small transformer learns multi-digit
addition (a supervised warm-up, then RL steps; see docs/grpo.md).

Each run writes OUT/<timestamp>/: config.json, metrics.jsonl (one line per step),
checkpoints/ and timeline.png. Progress bars and log lines go to stderr; the last line of
stdout is the JSON summary.

examples:
  flowrl run grpo                                   one-step-off streaming (max staleness 1)
  flowrl run grpo --max-staleness 0                 synchronous, reproducible for a --seed
  flowrl run grpo --resume runs/grpo/20260101-120000 --steps 400   continue a run"""


def main(argv: list[str] | None = None) -> int:
    """``flowrl run grpo [options]``: run the job, print the JSON summary on stdout."""
    cfg, resume = parse_config(
        GRPOConfig, argv, prog=PROG, description=DESCRIPTION, read_saved=read_config
    )
    try:
        with log_to_stderr(), config_errors(PROG):
            summary = run(cfg, resume=resume)
    except Timeout as exc:  # the run stalled: the message is the diagnosis
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0

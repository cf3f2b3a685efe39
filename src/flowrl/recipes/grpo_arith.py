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

At the end it writes ``timeline.png`` (stage activity from the hub's event stream) and
``metrics.jsonl`` to ``--out``, and prints a JSON summary (with the scheduler's statistics
under ``sched``). A synchronous run (``max_staleness`` 0) with one rollout worker (the
default) is reproducible for a seed; with several, which worker samples which prompt
depends on timing, and so does each micro-batch's random stream.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any, cast

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
from flowrl.models import TinyLM, TinyLMConfig, generate
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

__all__ = ["GRPOConfig", "build_pipeline", "build_scheduler", "main", "run"]


class GRPOConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every knob of the run; ``max_staleness`` 0 is synchronous (and reproducible)."""

    seed: int = 0
    steps: int = 200
    prompts_per_step: int = 16
    group_size: int = 8
    rollout_batch: int = 32
    rollout_workers: int = 1
    schedule: bool = True
    max_staleness: int = 1
    max_digits: int = 2
    d_model: int = 64
    clean_steps: int = 1000
    noisy_steps: int = 200
    noise: float = 0.6
    lr: float = 2e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.01
    temperature: float = 1.0
    append_every: int = 2
    eval_size: int = 512
    out: str = "runs/grpo"
    progress: bool = True


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
        n_heads=4,
        n_kv_heads=4,
        head_dim=cfg.d_model // 4,
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
) -> Pipeline:
    """The five stages, closed over the run's config, weights, reference and scheduler."""
    task = ArithTask(digits=(1, cfg.max_digits), seed=cfg.seed)
    max_new = task.max_response_len + 1
    g = cfg.group_size
    per_call = max(cfg.rollout_batch // g, 1)

    @flowrl.stage(outputs=[Column.ragged("prompt", "int64")], batch_size=per_call * g)
    def prompts() -> Any:
        group = 0
        while True:  # a put never spans two training steps: one partition per step
            n = min(per_call, cfg.prompts_per_step - group % cfg.prompts_per_step)
            problems = task.sample(n)
            ids = [np.asarray(p.prompt_ids, dtype=np.int64) for p in problems for _ in range(g)]
            groups = np.repeat(np.arange(group, group + n), g)
            step = group // cfg.prompts_per_step
            group += n
            yield Rows({"prompt": ids}, groups=groups, partition=f"step-{step}")

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
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + int(batch.indices[0]))
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
        batch_size=per_call * g,
        sampler=GroupSampler(g),
    )
    def advantage(batch: flowrl.Batch) -> dict[str, Any]:
        adv = group_advantages(batch.torch("reward"), torch.from_numpy(batch.meta.groups))
        return {"advantage": adv.numpy()}

    stages = cast("tuple[StageSpec, ...]", (prompts, Rollout, reward, Logprob, advantage))
    return Pipeline(
        stages,
        staleness=Staleness(
            max_staleness=cfg.max_staleness, samples_per_version=cfg.prompts_per_step * g
        ),
    )


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


def run(cfg: GRPOConfig) -> dict[str, Any]:
    """Run the job; returns the summary (also written as the last line of metrics.jsonl)."""
    torch.manual_seed(cfg.seed)
    # One intra-op thread: several stage threads compute at once, and these tiny ops run
    # 10x slower when threads oversubscribe a 2-core machine.
    torch.set_num_threads(1)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    task = ArithTask(digits=(1, cfg.max_digits), seed=cfg.seed)
    held_out = ArithTask(digits=(1, cfg.max_digits), seed=10_000 + cfg.seed).sample(cfg.eval_size)
    max_new = task.max_response_len + 1
    model = TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB_SIZE,
            d_model=cfg.d_model,
            n_layers=2,
            n_heads=4,
            d_ff=4 * cfg.d_model,
            max_seq_len=24,
        )
    )
    # Warm-up: learn the task, then unlearn part of it on noisy answers, so the policy's
    # samples are right only some of the time and GRPO has a signal to climb.
    pretrain(model, task, cfg.clean_steps, lr=3e-3, noise=0.0, seed=cfg.seed)
    pretrain(model, task, cfg.noisy_steps, lr=3e-4, noise=cfg.noise, seed=cfg.seed + 1)
    model.eval()
    eval_before = evaluate(model, held_out, max_new)
    reference = copy.deepcopy(model).requires_grad_(False)

    store = WeightStore(model)
    scheduler = build_scheduler(cfg, max_new) if cfg.schedule else None
    pipe = build_pipeline(cfg, store, reference, scheduler)
    hub = flowrl.Hub(pipe.columns, config=flowrl.HubConfig(capacity=8192))
    timeline = Timeline()
    hub.subscribe(timeline)
    if scheduler is not None:
        hub.subscribe(scheduler.observe, strict=True)  # a policy: failures fail the run
    batch_size = cfg.prompts_per_step * cfg.group_size
    loader = Loader(
        hub, task="trainer", columns=TRAIN_COLUMNS, batch_size=batch_size, groups=cfg.group_size
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    metrics: list[dict[str, Any]] = []
    t_rl = time.time()
    run_ = pipe.start(hub, loaders=[loader], max_samples=cfg.steps * batch_size)
    bar = _progress(cfg)
    step_start = t_rl
    try:
        for step in range(cfg.steps):
            t_wait = time.perf_counter()
            batch = next(loader)
            waited = time.perf_counter() - t_wait
            m = _train_step(cfg, model, opt, batch)
            lag = store.version - batch.meta.versions
            token_lag = store.version - batch.packed("response_versions")[0]
            version = store.publish(model)
            hub.publish_version(version)
            m.update(
                step=step,
                version=version,
                lag_mean=float(lag.mean()),
                lag_max=int(lag.max()),
                token_lag_mean=float(token_lag.mean()) if token_lag.size else 0.0,
                wait_s=waited,
                samples_per_s=(step + 1) * batch_size / (time.time() - t_rl),
                busy={  # stage busy fractions over this step, from the event stream
                    name: round(timeline.busy_fraction(name, step_start, time.time()), 3)
                    for name in STAGE_NAMES
                },
            )
            step_start = time.time()
            metrics.append(m)
            bar.set_postfix(reward=f"{m['reward']:.3f}", lag=f"{m['lag_mean']:.2f}")
            bar.update(1)
    finally:
        bar.close()
        loader.close()
        run_.stop()
        result = run_.result(timeout=60)
    t_end = time.time()
    model.eval()
    eval_after = evaluate(model, held_out, max_new)
    busy = {name: timeline.busy_fraction(name, t_rl, t_end) for name in timeline.spans()}
    timeline.save_png(str(out / "timeline.png"), title="flowrl GRPO: stage activity")
    window = max(1, min(20, cfg.steps // 5))
    summary = {
        "steps": cfg.steps,
        "reward_first": float(np.mean([m["reward"] for m in metrics[:window]])),
        "reward_last": float(np.mean([m["reward"] for m in metrics[-window:]])),
        "eval_sampled_before": eval_before["sampled"],
        "eval_sampled_after": eval_after["sampled"],
        "eval_greedy_before": eval_before["greedy"],
        "eval_greedy_after": eval_after["greedy"],
        "wall_s": time.perf_counter() - t_start,
        "rl_wall_s": t_end - t_rl,
        "samples_per_s": cfg.steps * batch_size / (t_end - t_rl),
        "update_idle_fraction": float(sum(m["wait_s"] for m in metrics) / (t_end - t_rl)),
        "stage_busy_fraction": busy,
        "lag_mean": float(np.mean([m["lag_mean"] for m in metrics])),
        "lag_max": max(m["lag_max"] for m in metrics),
        "max_staleness": cfg.max_staleness,
        "stage_samples": {n: s.samples for n, s in result.stages.items()},
        "timeline_png": str(out / "timeline.png"),
        "sched": None if scheduler is None else msgspec.to_builtins(scheduler.statistics()),
    }
    with open(out / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
        f.write(json.dumps({"summary": summary}) + "\n")
    hub.close()
    return summary


def _train_step(
    cfg: GRPOConfig, model: TinyLM, opt: torch.optim.Optimizer, batch: flowrl.Batch
) -> dict[str, Any]:
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


def _progress(cfg: GRPOConfig) -> Any:
    from tqdm import tqdm

    return tqdm(total=cfg.steps, desc="grpo", unit="step", disable=not cfg.progress)


def main(argv: list[str] | None = None) -> int:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(prog="flowrl run grpo", description=__doc__.splitlines()[0])
    for field in GRPOConfig.__struct_fields__:
        value = getattr(defaults, field)
        flag = "--" + field.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    summary = run(GRPOConfig(**vars(args)))
    print(json.dumps(summary))
    return 0

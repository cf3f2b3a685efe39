"""The main job's stages: the prompt source, rollout, reward, log-probs and advantages.

``build_pipeline`` closes the five stages over the run's config, the task, the trainer's
:class:`~flowrl.WeightStore`, the frozen reference, the rollout backend (what the rollout
workers sample with, ``flowrl.recipes.grpo_rollout``) and the scheduling layer (see
``flowrl.recipes.grpo_arith`` for the dataflow). Its two halves, ``rollout_pipeline``
(generation) and ``trainer_pipeline`` (scoring), run in separate processes under
``--placement disaggregated``.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import numpy as np
import torch

import flowrl
from flowrl import (
    Column,
    GroupSampler,
    Pipeline,
    Rows,
    StageContext,
    StageSpec,
    Staleness,
    WeightStore,
)
from flowrl.models import as_causal_lm
from flowrl.recipes.grpo_config import N_HEADS, GRPOConfig, groups_per_put
from flowrl.recipes.grpo_rollout import RolloutBackend
from flowrl.rl import build_batch, group_advantages, token_logprobs
from flowrl.sched import (
    BalancerConfig,
    ForecastConfig,
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    PlannerConfig,
    kv_capacity_tokens,
)
from flowrl.sched_hooks import RolloutScheduler
from flowrl.tasks import VOCAB_SIZE, Task

__all__ = [
    "ROLLOUT_COLUMNS",
    "STAGE_NAMES",
    "TRAIN_COLUMNS",
    "build_pipeline",
    "build_scheduler",
    "model_inputs",
    "prompts_stage",
    "rollout_pipeline",
    "rollout_stage",
    "trainer_pipeline",
]

# What the generation side puts: the prompt (the source) and the rollout's three columns.
ROLLOUT_COLUMNS = [
    Column.ragged("prompt", "int64"),
    Column.ragged("response", "int64"),
    Column.ragged("sample_logprobs", "float32"),
    Column.ragged("response_versions", "int64"),
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
    task: Task[Any],
    store: WeightStore,
    reference: torch.nn.Module,
    backend: RolloutBackend,
    scheduler: RolloutScheduler | None = None,
    *,
    start_step: int = 0,
) -> Pipeline:
    """The five stages in one pipeline (``--placement colocated``), closed over the run's
    config, task, weights, reference, rollout backend and scheduler.

    ``start_step``: the stream of problems starts at this step's (a resumed run; the
    backend's ``first_sample`` is its first sample).
    """
    rollout = rollout_pipeline(cfg, task, backend, scheduler, start_step=start_step)
    trainer = trainer_pipeline(cfg, task, store, reference)
    return Pipeline((*rollout.stages, *trainer.stages), staleness=rollout.staleness)


def rollout_pipeline(
    cfg: GRPOConfig,
    task: Task[Any],
    backend: RolloutBackend,
    scheduler: RolloutScheduler | None = None,
    *,
    start_step: int = 0,
) -> Pipeline:
    """The generation side: the prompt source and the rollout workers, admitted within the
    staleness bound (what the rollout process runs under ``--placement disaggregated``)."""
    stages = (prompts_stage(cfg, task, start_step), rollout_stage(cfg, backend, scheduler))
    return Pipeline(
        stages,
        staleness=Staleness(
            max_staleness=cfg.max_staleness,
            samples_per_version=cfg.prompts_per_step * cfg.group_size,
        ),
    )


def trainer_pipeline(
    cfg: GRPOConfig,
    task: Task[Any],
    store: WeightStore,
    reference: torch.nn.Module,
    *,
    whole_steps: bool = False,
) -> Pipeline:
    """The trainer's side: reward, log-probs under the trainer's weights and the frozen
    reference, and group advantages; the rollout's columns come from outside.

    ``whole_steps``: reward and log-probs take a whole step's samples at once, so a
    synchronous run's phases do not overlap (each then has every core; see
    ``flowrl.recipes.grpo_placement``); else micro-batches of ``rollout_batch``.
    """
    g = cfg.group_size
    step = cfg.prompts_per_step * g
    batch, least = (step, step) if whole_steps else (cfg.rollout_batch, 1)

    @flowrl.stage(
        inputs=["prompt", "response"],
        outputs=[Column.scalar("reward", "float32")],
        batch_size=batch,
        min_batch=least,
    )
    def reward(batch: flowrl.Batch) -> dict[str, Any]:
        pairs = zip(batch.ragged("prompt"), batch.ragged("response"), strict=True)
        scores = [task.verify(p.tolist(), r.tolist()) for p, r in pairs]
        return {"reward": np.array(scores, dtype=np.float32)}

    @flowrl.stage(
        inputs=["prompt", "response"],
        outputs=[
            Column.ragged("old_logprobs", "float32"),
            Column.ragged("ref_logprobs", "float32"),
        ],
        batch_size=batch,
        min_batch=least,
    )
    class Logprob:
        def setup(self) -> None:
            self.model = copy.deepcopy(reference).eval()
            self.lm = as_causal_lm(self.model)
            self.ref = as_causal_lm(reference)
            self.version = -1

        def __call__(self, batch: flowrl.Batch) -> dict[str, Any]:
            self.version = store.pull(self.model, self.version)
            ids, mask, starts, cu = model_inputs(batch)
            with torch.no_grad():
                old = token_logprobs(self.lm, ids, mask, starts, cu, temperature=cfg.temperature)
                ref = token_logprobs(self.ref, ids, mask, starts, cu, temperature=cfg.temperature)
            cu_np = cu.numpy()
            return {
                "old_logprobs": flowrl.RaggedArray(old.numpy(), cu_np),
                "ref_logprobs": flowrl.RaggedArray(ref.numpy(), cu_np.copy()),
            }

    @flowrl.stage(
        inputs=["reward"],
        outputs=[Column.scalar("advantage", "float32")],
        batch_size=groups_per_put(cfg) * g,
        sampler=GroupSampler(g),
    )
    def advantage(batch: flowrl.Batch) -> dict[str, Any]:
        adv = group_advantages(batch.torch("reward"), torch.from_numpy(batch.meta.groups))
        return {"advantage": adv.numpy()}

    stages = cast("tuple[StageSpec, ...]", (reward, Logprob, advantage))
    return Pipeline(stages, columns=ROLLOUT_COLUMNS)


def prompts_stage(cfg: GRPOConfig, task: Task[Any], start_step: int) -> StageSpec:
    """The source: G copies of each problem, one group id per problem, one partition per step.

    It puts :func:`groups_per_put` groups at a time (a divisor of the step's groups: a put
    never spans two steps). ``start_step``: skip the problems of the steps before it.
    """
    g, per_step, per_put = cfg.group_size, cfg.prompts_per_step, groups_per_put(cfg)
    first_group = start_step * per_step
    task.sample(first_group)  # the stream of problems continues where the run stopped

    @flowrl.stage(outputs=ROLLOUT_COLUMNS[:1], batch_size=per_put * g)
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
    cfg: GRPOConfig, backend: RolloutBackend, scheduler: RolloutScheduler | None
) -> StageSpec:
    """The rollout workers: sample responses with the newest published weights, each
    worker with a sampler of ``backend`` (the builtin sampler or a rollout engine)."""

    @flowrl.stage(
        inputs=["prompt"],
        outputs=ROLLOUT_COLUMNS[1:],
        batch_size=cfg.rollout_batch,
        min_batch=1,
        workers=cfg.rollout_workers,
        sampler=None if scheduler is None else scheduler.sampler,
    )
    class Rollout:
        def setup(self, ctx: StageContext) -> None:
            if scheduler is not None:
                scheduler.bind(ctx.worker)
            self.sampler = backend.sampler(ctx.hub)

        def __call__(self, batch: flowrl.Batch) -> Rows:
            out = self.sampler.generate(batch)
            return Rows(
                {
                    "response": out.responses,
                    "sample_logprobs": out.logprobs,
                    "response_versions": out.versions,
                },
                # A resumed response mixes versions: each sample counts as old as its
                # oldest token, so the staleness bound holds for every token.
                version=out.sample_versions(self.sampler.version),
                tokens=out.responses.lengths,  # response lengths, for the forecaster
            )

    return cast(StageSpec, Rollout)


STAGE_NAMES = ("Rollout", "reward", "Logprob", "advantage", "trainer")
TRAIN_COLUMNS = [
    "prompt",
    "response",
    "response_versions",
    "sample_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "advantage",
    "reward",
]


def model_inputs(batch: flowrl.Batch) -> tuple[torch.Tensor, ...]:
    prompts = [torch.from_numpy(p.copy()) for p in batch.ragged("prompt")]
    responses = [torch.from_numpy(r.copy()) for r in batch.ragged("response")]
    return build_batch(prompts, responses)

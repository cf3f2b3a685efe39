"""The main job's trainer side: the policy, its warm-up, the GRPO update and evaluation.

``Trainer`` holds what a checkpoint holds (policy, optimizer, frozen reference, step,
version, metrics so far) and starts either from a supervised warm-up or from a checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import msgspec
import numpy as np
import torch

import flowrl
from flowrl.models import TinyLM, TinyLMConfig, generate
from flowrl.recipes.grpo_config import MAX_SEQ_LEN, N_HEADS, GRPOConfig
from flowrl.recipes.grpo_stages import model_inputs
from flowrl.recipes.progress import bar, log
from flowrl.rl import grpo_loss, token_logprobs
from flowrl.tasks import EOS_ID, VOCAB_SIZE, ArithTask, pretrain, verify

__all__ = ["Trainer", "build_model", "evaluate", "update_policy", "warm_up"]


@dataclasses.dataclass
class Trainer:
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
    ) -> Trainer:
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


def update_policy(
    cfg: GRPOConfig, model: TinyLM, opt: torch.optim.Optimizer, batch: flowrl.Batch
) -> dict[str, Any]:
    """One optimizer step on a training batch (clipped GRPO with a k3 KL penalty)."""
    model.train()
    ids, mask, starts, cu = model_inputs(batch)
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

"""The main job's trainer side: the policy, its warm-up, the GRPO update and evaluation.

``Trainer`` holds what a checkpoint holds (the policy's update — its weights and optimizer,
see ``flowrl.recipes.grpo_update`` — the frozen reference, step, version, metrics so far)
and starts either from a supervised warm-up or from a checkpoint. The policy is a
:class:`~flowrl.models.TinyLM` or (``--model llama``) a Hugging Face Llama of the same
width built in code; everything calls it through :func:`~flowrl.models.as_causal_lm`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import msgspec
import numpy as np
import torch

from flowrl._weights.sync import load_named
from flowrl.models import TinyLM, TinyLMConfig, as_causal_lm, generate
from flowrl.recipes.grpo_config import LLAMA_HEAD_DIM, N_HEADS, GRPOConfig
from flowrl.recipes.grpo_task import context_len
from flowrl.recipes.grpo_update import PolicyUpdate, make_update, update_policy
from flowrl.recipes.progress import bar, log, quarter_logger
from flowrl.tasks import EOS_ID, VOCAB_SIZE, Problem, Task, pretrain

__all__ = ["Trainer", "build_model", "evaluate", "update_policy", "warm_up"]


@dataclasses.dataclass
class Trainer:
    """The trainer's side of a run: the policy's update (weights and optimizer), the
    frozen reference, and how far it got — what a checkpoint holds."""

    update: PolicyUpdate
    reference: torch.nn.Module
    eval_before: dict[str, float]
    step: int = 0
    version: int = 0
    metrics: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def start(
        cls,
        cfg: GRPOConfig,
        task: Task[Any],
        held_out: list[Problem],
        max_new: int,
        checkpoint: dict[str, Any] | None,
    ) -> Trainer:
        """A warmed-up policy, or the checkpoint's."""
        model = build_model(cfg)
        if checkpoint is None:
            warm_up(cfg, model, task)
            model.eval()
            eval_before = evaluate(model, task, held_out, max_new)
            log.info(
                "held-out accuracy before RL: %.3f sampled, %.3f greedy",
                eval_before["sampled"],
                eval_before["greedy"],
            )
            reference = copy.deepcopy(model).requires_grad_(False)
            return cls(make_update(cfg, model, version=0), reference, eval_before)
        load_named(model, checkpoint["model"].items())
        model.eval()
        reference = copy.deepcopy(model).requires_grad_(False)
        reference.load_state_dict(checkpoint["reference"])
        version = checkpoint["version"]
        update = make_update(cfg, model, version=version)
        update.load_state_dict(checkpoint, version)
        torch.set_rng_state(checkpoint["torch_rng"])
        log.info("resumed at step %d (policy version %d)", checkpoint["step"], version)
        return cls(
            update,
            reference,
            checkpoint["eval_before"],
            checkpoint["step"],
            version,
            list(checkpoint["metrics"]),
        )

    def policy(self) -> torch.nn.Module:
        """A copy of the policy with the current weights (in eval mode)."""
        model = copy.deepcopy(self.reference)
        load_named(model, self.update.weights())
        return model.eval()

    def finish_step(self, metrics: dict[str, Any]) -> None:
        self.metrics.append(metrics)
        self.step += 1

    def state_dict(self, cfg: GRPOConfig) -> dict[str, Any]:
        """The checkpoint after ``self.step`` steps (plain data: loads ``weights_only``)."""
        return {
            "step": self.step,
            "version": self.version,
            **self.update.state_dict(),  # model, optimizer
            "reference": self.reference.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "eval_before": self.eval_before,
            "metrics": self.metrics,
            "config": msgspec.to_builtins(cfg),
        }


def build_model(cfg: GRPOConfig) -> torch.nn.Module:
    """The policy, freshly initialised (from the global torch seed): ``cfg.model``'s
    architecture, ``cfg.d_model`` wide, two layers, over the task's vocabulary and
    context."""
    if cfg.model == "llama":
        from flowrl.models.hf import tiny_llama

        return tiny_llama(
            vocab_size=VOCAB_SIZE,
            hidden_size=cfg.d_model,
            n_layers=2,
            n_heads=cfg.d_model // LLAMA_HEAD_DIM,
            intermediate_size=4 * cfg.d_model,
            max_positions=context_len(cfg),
            seed=cfg.seed,
        )
    return TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB_SIZE,
            d_model=cfg.d_model,
            n_layers=2,
            n_heads=N_HEADS,
            d_ff=4 * cfg.d_model,
            max_seq_len=context_len(cfg),
        )
    )


def warm_up(cfg: GRPOConfig, model: torch.nn.Module, task: Task[Any]) -> None:
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
        on_step = warm_bar.update
        if cfg.progress and warm_bar.disable:  # stderr redirected: a line per quarter instead
            on_step = quarter_logger(total, "warm-up")
        pretrain(model, task, cfg.clean_steps, lr=3e-3, noise=0.0, seed=cfg.seed, on_step=on_step)
        pretrain(
            model,
            task,
            cfg.noisy_steps,
            lr=3e-4,
            noise=cfg.noise,
            seed=cfg.seed + 1,
            on_step=on_step,
        )


def evaluate(
    model: torch.nn.Module, task: Task[Any], problems: list[Problem], max_new: int
) -> dict[str, float]:
    """Accuracy on held-out problems of ``task``, sampled at temperature 1 and greedy."""
    prompts = [p.prompt_ids for p in problems]
    lm = as_causal_lm(model)
    scores = {}
    for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        gen = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            out = generate(
                lm, prompts, max_new, temperature=temperature, eos_id=EOS_ID, generator=gen
            )
        pairs = zip(problems, out.responses(), strict=True)
        scores[name] = float(np.mean([task.verify(p.prompt_ids, r) for p, r in pairs]))
    return scores

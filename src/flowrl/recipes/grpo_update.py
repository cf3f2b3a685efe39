"""The trainer's optimizer step, in the recipe or through an update engine (``--trainer``).

Every trainer minimises the same loss, :func:`grpo_loss_fn` (the clipped GRPO objective
with a k3 KL penalty to the reference and, with ``--tis-cap C``, the truncated
importance-sampling correction ``min(pi_old / pi_sampler, C)`` from the stored sampler
log-probs), over the Loader's batch packed as a :class:`~flowrl.engines.TrainBatch`
(:func:`train_batch`):

* ``builtin`` (:class:`BuiltinUpdate`): AdamW on the policy, in the recipe;
* ``torch``, ``deepspeed`` and ``megatron`` (:class:`EngineUpdate`): one
  :meth:`~flowrl.engines.UpdateEngine.train_step` of a
  :class:`~flowrl.engines.TorchUpdateEngine`, a
  :class:`~flowrl.engines.DeepSpeedUpdateEngine` (ZeRO ``--zero-stage`` on a process group
  of one rank) or a :class:`~flowrl.engines.MegatronUpdateEngine` (a Megatron-core GPT
  built from the Llama, one rank). The weights published are the engine's
  ``named_weights()`` (gathered under ZeRO-3, under the Llama's names from Megatron).

All use AdamW at ``--lr`` without weight decay and clip gradients to norm 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

import flowrl
from flowrl._weights.sync import load_named, module_weights
from flowrl.engines import LossFn, OptimConfig, TorchUpdateEngine, TrainBatch
from flowrl.models import as_causal_lm
from flowrl.recipes.grpo_config import GRPOConfig
from flowrl.rl import grpo_loss, token_logprobs

if TYPE_CHECKING:
    from flowrl.engines._training import TokenWeightedTrainer

__all__ = [
    "BuiltinUpdate",
    "EngineUpdate",
    "PolicyUpdate",
    "checkpoint_globals",
    "grpo_loss_fn",
    "make_update",
    "train_batch",
    "update_policy",
]

_MAX_GRAD_NORM = 1.0


class PolicyUpdate(Protocol):
    """What the trainer steps with: a step on a batch, the weights, a checkpoint."""

    def step(self, batch: flowrl.Batch) -> dict[str, Any]:
        """One optimizer step on the Loader's batch; its metrics."""
        ...

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's full weights by name (what the WeightStore publishes)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` for a checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], version: int) -> None:
        """Restore :meth:`state_dict`'s output, at policy ``version``."""
        ...

    def close(self) -> None: ...


def make_update(cfg: GRPOConfig, model: torch.nn.Module, *, version: int) -> PolicyUpdate:
    """``cfg.trainer``'s update over ``model`` (a DeepSpeed engine takes it over: under
    ZeRO-3 its parameters are sharded from then on)."""
    if cfg.trainer == "builtin":
        return BuiltinUpdate(cfg, model)
    optim = OptimConfig(lr=cfg.lr, weight_decay=0.0, max_grad_norm=_MAX_GRAD_NORM)
    if cfg.trainer == "deepspeed":
        from flowrl.engines import DeepSpeedUpdateEngine

        engine: TokenWeightedTrainer = DeepSpeedUpdateEngine(
            model, optim, zero_stage=cfg.zero_stage, version=version
        )
    elif cfg.trainer == "megatron":
        from flowrl.engines import MegatronUpdateEngine

        engine = MegatronUpdateEngine(model, optim, version=version)
    else:
        engine = TorchUpdateEngine(model, optim, version=version)
    return EngineUpdate(cfg, engine)


def checkpoint_globals(cfg: GRPOConfig) -> list[type]:
    """Classes besides plain data that ``cfg.trainer``'s checkpoints hold."""
    if cfg.trainer == "deepspeed":
        from flowrl.engines.deepspeed import checkpoint_globals as deepspeed_globals

        return deepspeed_globals()
    return []


def train_batch(batch: flowrl.Batch) -> TrainBatch:
    """The Loader's batch as a packed :class:`~flowrl.engines.TrainBatch`."""
    return TrainBatch.pack(
        list(batch.ragged("prompt")),
        list(batch.ragged("response")),
        advantages=batch.numpy("advantage"),
        old_logprobs=list(batch.ragged("old_logprobs")),
        ref_logprobs=list(batch.ragged("ref_logprobs")),
        sample_logprobs=list(batch.ragged("sample_logprobs")),
    )


def grpo_loss_fn(cfg: GRPOConfig) -> LossFn:
    """The run's loss on a micro-batch's log-probs (module docstring)."""
    tis_cap = cfg.tis_cap or None

    def loss_fn(logprobs: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.old_logprobs is None or mb.advantages is None:
            raise ValueError("the GRPO loss needs a TrainBatch with old_logprobs and advantages")
        return grpo_loss(
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.response_cu,
            ref_logprobs=mb.ref_logprobs,
            clip_eps=cfg.clip_eps,
            kl_coef=cfg.kl_coef,
            sample_logprobs=mb.sample_logprobs if tis_cap else None,
            tis_cap=tis_cap,
        )

    return loss_fn


def update_policy(
    cfg: GRPOConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: flowrl.Batch
) -> dict[str, Any]:
    """One AdamW step of ``model`` on a training batch (the builtin trainer's step)."""
    model.train()
    tb = train_batch(batch)
    ids, mask, starts, cu = tb.model_inputs()
    lm = as_causal_lm(model)
    logprobs = token_logprobs(lm, ids, mask, starts, cu, temperature=cfg.temperature)
    loss, m = grpo_loss_fn(cfg)(logprobs, tb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), _MAX_GRAD_NORM)
    opt.step()
    model.eval()
    return {**m, "loss": loss.item(), "reward": float(batch.numpy("reward").mean())}


class BuiltinUpdate:
    """AdamW on ``model`` in the recipe (:func:`update_policy`)."""

    def __init__(self, cfg: GRPOConfig, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def step(self, batch: flowrl.Batch) -> dict[str, Any]:
        return update_policy(self.cfg, self.model, self.opt, batch)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return module_weights(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], version: int) -> None:
        load_named(self.model, state["model"].items())
        self.opt.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Nothing to release."""


class EngineUpdate:
    """One :meth:`~flowrl.engines.UpdateEngine.train_step` per step, on one micro-batch."""

    def __init__(self, cfg: GRPOConfig, engine: TokenWeightedTrainer) -> None:
        self.cfg = cfg
        self.engine = engine
        self._loss = grpo_loss_fn(cfg)

    def step(self, batch: flowrl.Batch) -> dict[str, Any]:
        m = self.engine.train_step(
            [train_batch(batch)], self._loss, temperature=self.cfg.temperature
        )
        return {**m, "reward": float(batch.numpy("reward").mean())}

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.engine.named_weights()

    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        return {"model": state["model"], "optimizer": state["optimizer"]}

    def load_state_dict(self, state: Mapping[str, Any], version: int) -> None:
        self.engine.load_state_dict({**state, "version": version})

    def close(self) -> None:
        self.engine.close()

"""What the torch and DeepSpeed update engines share: the optimizer config, log-prob
recompute, and a training step over token-weighted micro-batches.

A step's loss is the token mean over all of its micro-batches on every data-parallel
rank: micro-batch ``k`` of ``n_k`` response tokens contributes ``loss_k * n_k / N``, with
``N`` the step's tokens summed over ranks, times the world size where the data-parallel
backend averages gradients over ranks (DeepSpeed does). So one step on a batch gives the
same update however the batch is split into micro-batches and ranks.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, final

import msgspec
import torch
import torch.distributed as dist

from flowrl.engines.base import LossFn, TrainBatch, UpdateEngine
from flowrl.errors import ConfigError
from flowrl.models.causal import CausalLM
from flowrl.rl.grpo import token_logprobs

if TYPE_CHECKING:
    pass

__all__ = ["OptimConfig"]


@final
class OptimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """AdamW and gradient clipping, for every update engine. ``max_grad_norm`` None: no
    clipping (the norm is still reported)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"OptimConfig.lr expects > 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"OptimConfig.betas expects two values in [0, 1), got {self.betas}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"OptimConfig.max_grad_norm expects > 0 or None (no clipping), "
                f"got {self.max_grad_norm}"
            )

    def adamw(self, params: object) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            params,  # type: ignore[arg-type]
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


class TokenWeightedTrainer(UpdateEngine):
    """``logprobs`` and ``train_step`` over ``self._lm``; subclasses say how gradients are
    made, reduced and applied."""

    def __init__(
        self, lm: CausalLM, *, version: int, pad_id: int, device: torch.device | None = None
    ) -> None:
        super().__init__(version=version)
        self._lm = lm
        self._pad_id = pad_id
        self._device = device  # where the model computes; batches come and go on theirs

    @abc.abstractmethod
    def _train_mode(self, training: bool) -> None: ...

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _apply(self) -> float:
        """Clip, step the optimizer, zero the gradients; returns the norm before clipping."""

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (one rank: itself)."""
        return values

    @property
    def _grad_scale(self) -> int:
        """What the backend divides summed gradients by (the world size when it averages)."""
        return 1

    def logprobs(self, batch: TrainBatch, *, temperature: float = 1.0) -> torch.Tensor:
        self._train_mode(False)
        with torch.no_grad():
            return self._forward(batch, temperature)

    def _forward(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """The response tokens' log-probs, computed on the model's device and returned on
        the batch's (where the loss function's advantages and old log-probs are)."""
        ids, mask, starts, cu = (t.to(self._device) for t in batch.model_inputs(self._pad_id))
        out = token_logprobs(self._lm, ids, mask, starts, cu, temperature=temperature)
        return out.to(batch.responses.device)

    def _sum_over_ranks(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        """``values`` summed over ``group``'s ranks, reduced on the model's device (NCCL
        reduces GPU tensors only) and returned on ``values``' device."""
        out = values.to(self._device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out.to(values.device)

    def train_step(
        self,
        micro_batches: Sequence[TrainBatch],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """:meth:`UpdateEngine.train_step`; ``temperature`` scales the logits as the
        sampler's did (the log-probs the loss sees are those of ``logits / temperature``)."""
        if not micro_batches:
            raise ConfigError("train_step got no micro-batches; pass at least one TrainBatch")
        local = sum(mb.n_tokens for mb in micro_batches)
        total = float(self._all_sum(torch.tensor([float(local)], dtype=torch.float64))[0])
        if total == 0:
            raise ConfigError("train_step: the step has no response tokens to train on")
        self._train_mode(True)
        sums: dict[str, float] = {}
        for mb in micro_batches:
            if mb.n_tokens == 0:
                continue
            weight = mb.n_tokens / total
            loss, metrics = loss_fn(self._forward(mb, temperature), mb)
            self._backward(loss * (weight * self._grad_scale))
            for key, value in {**metrics, "loss": float(loss.detach())}.items():
                sums[key] = sums.get(key, 0.0) + weight * float(value)
        keys = sorted(sums)
        reduced = self._all_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        grad_norm = self._apply()
        self._train_mode(False)
        self._version += 1
        out = dict(zip(keys, reduced.tolist(), strict=True))
        out["grad_norm"] = grad_norm
        return out

    def _load_checked(self, state: Mapping[str, object], keys: Sequence[str]) -> None:
        refusal = missing_state(state, keys)
        if refusal is not None:
            raise ConfigError(refusal)


def missing_state(state: Mapping[str, object], keys: Sequence[str]) -> str | None:
    """What ``load_state_dict`` says of a state lacking some of ``keys`` (None: it has all)."""
    missing = [k for k in keys if k not in state]
    if not missing:
        return None
    return f"load_state_dict: the state lacks {missing}; pass what state_dict() returned"

"""The built-in update engine: AdamW on a torch causal LM in this process.

Gradients of a step's micro-batches accumulate (each weighted by its share of the step's
response tokens, see ``flowrl.engines._training``), are clipped to
``OptimConfig.max_grad_norm``, and one AdamW step applies them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, final

import torch

from flowrl._weights.sync import module_weights
from flowrl.engines._training import OptimConfig, TokenWeightedTrainer
from flowrl.models.causal import as_causal_lm

__all__ = ["TorchUpdateEngine"]


@final
class TorchUpdateEngine(TokenWeightedTrainer):
    """Trains ``model`` (a TinyLM or a ``transformers`` causal LM) with AdamW.

    ``pad_id``: the token right padding uses in forward passes (masked out).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig | None = None,
        *,
        version: int = 0,
        pad_id: int = 0,
    ) -> None:
        device = next(model.parameters()).device
        super().__init__(as_causal_lm(model), version=version, pad_id=pad_id, device=device)
        self.model = model
        self.optim = optim or OptimConfig()
        self._optimizer = self.optim.adamw(model.parameters())

    def _train_mode(self, training: bool) -> None:
        self.model.train(training)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _apply(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, float("inf") if limit is None else limit)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return module_weights(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_checked(state, ("model", "optimizer", "version"))
        self.model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])

"""The job's task (``--task``) and the model context it needs.

``arith`` is :class:`~flowrl.tasks.ArithTask` (``--max-digits``); ``chain`` is
:class:`~flowrl.tasks.ChainTask`, whose worked solutions have heavy-tailed lengths. Both
share one tokenizer; the context of the model is the longest prompt plus the sampler's
``max_new`` tokens (the addition task keeps the fixed ``MAX_SEQ_LEN`` its checkpoints
were made with).
"""

from __future__ import annotations

from typing import Any

from flowrl.recipes.grpo_config import MAX_SEQ_LEN, GRPOConfig
from flowrl.tasks import ArithTask, ChainTask, Task

__all__ = ["context_len", "make_task", "max_new_tokens"]


def make_task(cfg: GRPOConfig, seed: int) -> Task[Any]:
    """The stream of problems ``--task`` names, seeded with ``seed``."""
    if cfg.task == "chain":
        return ChainTask(seed=seed)
    return ArithTask(digits=(1, cfg.max_digits), seed=seed)


def max_new_tokens(cfg: GRPOConfig) -> int:
    """The sampler's budget: the longest correct response and one token more."""
    return make_task(cfg, 0).max_response_len + 1


def context_len(cfg: GRPOConfig) -> int:
    """Positions the policy model holds: a prompt and ``max_new_tokens``."""
    if cfg.task == "arith":
        return MAX_SEQ_LEN
    return make_task(cfg, 0).max_prompt_len + max_new_tokens(cfg)

"""RL math for GRPO (log-prob recompute, group advantages, the clipped objective) and
durable, resumable generation through the hub (partial rollouts)."""

from flowrl.rl.grpo import build_batch, group_advantages, grpo_loss, token_logprobs
from flowrl.rl.rollout import (
    APPEND_EVERY,
    ResumableGeneration,
    StoredPrefixes,
    generate_resumable,
    read_prefixes,
)

__all__ = [
    "APPEND_EVERY",
    "ResumableGeneration",
    "StoredPrefixes",
    "build_batch",
    "generate_resumable",
    "group_advantages",
    "grpo_loss",
    "read_prefixes",
    "token_logprobs",
]

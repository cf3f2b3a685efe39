"""RL math for GRPO: log-prob recompute, group advantages, the clipped objective."""

from flowrl.rl.grpo import build_batch, group_advantages, grpo_loss, token_logprobs

__all__ = ["build_batch", "group_advantages", "grpo_loss", "token_logprobs"]

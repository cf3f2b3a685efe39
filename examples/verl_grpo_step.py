"""GRPO advantages with verl 0.9.1 on batches streamed from a flowrl hub.

Rollouts arrive one sample at a time, groups interleaved (as a streaming rollout stage
delivers them). ``DataProtoLoader`` hands out verl ``DataProto`` batches of whole groups
sized for 2 data-parallel ranks; verl's ``compute_grpo_outcome_advantage`` runs on them
and the advantages go back into the hub for the update stage (``from_dataproto`` gives
the sample indices back).

    pip install ... verl==0.9.1   # the install line in docs/verl.md
    python examples/verl_grpo_step.py
"""

from __future__ import annotations

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

import flowrl
from flowrl import Column
from flowrl.integrations.verl import DataProtoLoader, from_dataproto

GROUP_SIZE, GROUPS, DP_SIZE = 4, 8, 2


def stream_rollouts(hub: flowrl.Hub, rng: np.random.Generator) -> None:
    """Stand-in for a rollout + reward stage: responses finish in random order."""
    for flat in rng.permutation(GROUPS * GROUP_SIZE):
        group = int(flat) // GROUP_SIZE
        hub.put(
            {
                "prompt_ids": [np.arange(3) + 10 * group],
                "response_ids": [rng.integers(0, 50, rng.integers(1, 9))],
                "score": np.array([rng.integers(0, 2)], dtype=np.float32),
            },
            groups=group,
        )
    hub.end_stream()


def main() -> int:
    hub = flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.scalar("score", "float32"),
            Column.ragged("advantage", "float32"),
        ]
    )
    hub.register_task("update", ["advantage"])  # the stage after this one
    loader = DataProtoLoader(
        hub,
        task="advantage",
        columns=["prompt_ids", "response_ids", "score"],
        groups_per_batch=2,
        group_size=GROUP_SIZE,
        dp_size=DP_SIZE,
        to_dataproto={"response_length": 8},
    )
    stream_rollouts(hub, np.random.default_rng(0))
    batches = 0
    for dp in loader:
        mask = dp.batch["response_mask"]
        rewards = torch.zeros(mask.shape)
        last = mask.sum(-1) - 1
        rewards[torch.arange(len(dp)), last] = dp.batch["score"]  # outcome reward
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, dp.non_tensor_batch["uid"])
        ranks = dp.chunk(DP_SIZE)  # what verl's dispatch does: never an unequal chunk
        meta = from_dataproto(dp).meta
        lengths = mask.sum(-1).tolist()
        hub.put({"advantage": [adv[i, :n].numpy() for i, n in enumerate(lengths)]}, indices=meta)
        print(f"batch {batches}: {len(dp)} samples, ranks of {[len(r) for r in ranks]}")
        batches += 1
    loader.close()
    assert hub.statistics().tasks["update"].ready == GROUPS * GROUP_SIZE
    hub.close()
    return batches


if __name__ == "__main__":
    main()

"""verl 0.9.1's V1 replay buffer sampling whole GRPO groups from a flowrl hub.

verl's V1 trainer (``verl.trainer.ppo.v1``) keeps prompts and trajectories in
TransferQueue. Here flowrl's TransferQueue-compatible client takes its place
(``use_flowrl_transfer_queue()``, before verl is imported) and the replay buffer is
flowrl's ``HubReplayBuffer``, built the way verl's trainer builds the class that
``trainer.v1.sampler.custom_sampler`` names. Rollout threads write trajectories as verl's
``AgentLoopWorkerTQ`` does (keys ``{uid}_{session}_{index}``, the prompt key's status tag
``running`` then ``finished``), finishing in random order; each step the buffer hands the
trainer its groups, whole, as soon as the last one finishes (it waits on the hub's key
directory, not a 2 s poll), and verl's GRPO advantage runs on what the trainer reads back.

    pip install ... verl==0.9.1   # the install line in docs/verl.md
    python examples/verl_v1_replay_buffer.py
"""

from __future__ import annotations

from flowrl.integrations.verl_v1 import use_flowrl_transfer_queue

use_flowrl_transfer_queue()  # before verl (or anything importing transfer_queue) is imported

import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402  (flowrl.compat.transfer_queue from here on)
from tensordict import NonTensorStack, TensorDict  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from flowrl.integrations import verl_v1  # noqa: E402

PROMPTS, GROUP, STEPS = 4, 4, 3  # data.train_batch_size, rollout.n, training steps


def rollout(uid: str, step: int, rng: random.Random) -> None:
    """One prompt's GROUP sessions, written as verl's AgentLoopWorkerTQ writes them."""
    tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
    for session in range(GROUP):
        time.sleep(rng.random() * 0.02)  # stragglers: sessions finish in random order
        length = rng.randint(1, 6)
        reward = float(rng.random() < 0.5)
        scores = torch.zeros(1, length)
        scores[0, -1] = reward  # verl's rm_scores: the reward on the last token
        fields = TensorDict(
            {
                "responses": torch.randint(0, 100, (1, length)),
                "response_mask": torch.ones(1, length, dtype=torch.int64),
                "rm_scores": scores,
                "uid": NonTensorStack(uid),
            },
            batch_size=1,
        )
        tag = {"status": "success", "global_steps": step, "seq_len": length}
        tq.kv_batch_put(
            keys=[f"{uid}_{session}_0"], partition_id="train", fields=fields, tags=[tag]
        )
    tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})


def main() -> dict[str, int]:
    tq.init()
    # what verl's PPOTrainer._build_replay_buffer passes to a custom sampler
    buffer = verl_v1.HubReplayBuffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        refill_fn=None,
    )
    rng = random.Random(0)
    served: Counter[str] = Counter()
    try:
        for step in range(1, STEPS + 1):
            uids = [str(uuid.uuid4()) for _ in range(PROMPTS)]
            tags = [{"is_prompt": True, "status": "pending", "global_steps": step}] * PROMPTS
            tq.kv_batch_put(keys=uids, partition_id="train", tags=tags)  # the trainer's submit
            workers = [threading.Thread(target=rollout, args=(u, step, rng)) for u in uids]
            for w in workers:
                w.start()
            batch, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=PROMPTS)
            data = tq.kv_batch_get(
                keys=batch.keys,
                partition_id="train",
                select_fields=["rm_scores", "response_mask", "uid"],
            )
            mask = data["response_mask"].to_padded_tensor(0)
            group_of = np.array(list(data["uid"]), dtype=object)
            advantages, _ = compute_grpo_outcome_advantage(
                data["rm_scores"].to_padded_tensor(0.0), mask, group_of
            )
            served.update(group_of.tolist())
            print(f"step {step}: {len(batch)} trajectories of {len(set(group_of))} groups, "
                  f"|advantage| {advantages.abs().sum().item():.2f}")  # fmt: skip
            tq.kv_clear(keys=batch.keys, partition_id="train")  # as the trainer's fit() does
            for w in workers:
                w.join()
        if set(served.values()) != {GROUP} or len(served) != STEPS * PROMPTS:
            raise RuntimeError(f"groups were not served whole and once: {served}")
        return {"groups": len(served), "trajectories": sum(served.values())}
    finally:
        tq.close()


if __name__ == "__main__":
    print(main())

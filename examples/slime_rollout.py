"""slime's rollout served from a flowrl hub (runs without slime: a mirror of its Sample).

In a slime job, put the ``generate_rollout`` this builds at module level and pass
``--rollout-function-path this_module.generate_rollout``; use slime's own
``slime.utils.types.Sample`` as ``sample_type``. Here a thread stands in for the hub's
rollout and reward stages (answer = the prompt reversed, reward = its length).

    python examples/slime_rollout.py
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import numpy as np

import flowrl
from flowrl.integrations.slime import (
    PROMPT_COLUMNS,
    HubDataSource,
    put_prompts,
    rollout_function,
    sample_columns,
)


@dataclass
class Sample:  # the fields of slime.utils.types.Sample that a rollout touches
    group_index: int | None = None
    index: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)


def generate_and_score(hub: flowrl.Hub, stop: threading.Event) -> None:
    """The hub's rollout + reward stages: one claim, one put per micro-batch."""
    while not stop.is_set():
        try:
            meta = hub.claim("generate", 32, min_n=1, timeout=0.05)
        except flowrl.errors.Timeout:
            continue
        batch = hub.get(meta, ["tokens", "prompt"])
        responses = [p[::-1] for p in batch["prompt"]]
        n = len(meta)
        hub.put(
            {
                "tokens": [
                    np.append(t, [ord(c) for c in r])
                    for t, r in zip(batch.ragged("tokens"), responses, strict=True)
                ],
                "response": responses,
                "response_length": np.array([len(r) for r in responses]),
                "reward": [float(len(r)) for r in responses],
                "loss_mask": [[1] * len(r) for r in responses],
                "rollout_log_probs": [[-1.0] * len(r) for r in responses],
                "weight_versions": [[str(hub.version)]] * n,
                "status": ["completed"] * n,
            },
            indices=meta,
        )
        hub.ack(meta)


def main() -> int:
    prompts = flowrl.Hub(list(PROMPT_COLUMNS))
    put_prompts(
        prompts,
        [SimpleNamespace(prompt=f"question {i}", label=str(i), metadata={}) for i in range(8)],
    )
    data_source = HubDataSource(prompts, sample_type=Sample, n_samples_per_prompt=4)

    hub = flowrl.Hub(sample_columns())
    hub.register_task("generate", ["tokens", "prompt"])
    generate_rollout = rollout_function(
        hub, sample_type=Sample, tokenize=lambda p: [ord(c) for c in p], timeout=60
    )
    stop = threading.Event()
    worker = threading.Thread(target=generate_and_score, args=(hub, stop), daemon=True)
    worker.start()
    args = SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=4)  # slime's args
    served = 0
    try:
        for rollout_id in range(3):
            groups = generate_rollout(args, rollout_id, data_source)
            served += len(groups)
            rewards = [[s.reward for s in g] for g in groups]
            print(f"rollout {rollout_id}: {len(groups)} groups, rewards {rewards}")
    finally:
        stop.set()
        worker.join()
        hub.close()
        prompts.close()
    return served


if __name__ == "__main__":
    main()

"""slime's rollout served from a flowrl hub (runs without slime: a copy of its Sample).

In a slime job, put the ``generate_rollout`` this builds at module level and pass
``--rollout-function-path this_module.generate_rollout``; use slime's own
``slime.utils.types.Sample`` as ``sample_type``. Here a thread stands in for the hub's
rollout and reward stages (answer = the prompt reversed, reward = its length; the MoE
routing and top-p replay fields are filled as sglang's meta_info would fill them), and
every field comes back: tensors as tensors.

    python examples/slime_rollout.py

Needs: the base install (slime itself is not needed). Takes: about 15 s.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

import flowrl
from flowrl.integrations.slime import (
    PROMPT_COLUMNS,
    RESULT_FIELDS,
    HubDataSource,
    put_prompts,
    rollout_function,
    sample_columns,
    sample_data,
)
from flowrl.testing.slime import Sample  # in a slime job: from slime.utils.types import Sample


def generate_and_score(hub: flowrl.Hub, stop: threading.Event) -> None:
    """The hub's rollout + reward stages: one claim, one put per micro-batch."""
    while not stop.is_set():
        try:
            meta = hub.claim("generate", 32, min_n=1, timeout=0.05)
        except flowrl.errors.Timeout:
            continue
        batch = hub.get(meta, ["tokens", "prompt"])
        samples = []
        for prompt, tokens in zip(batch["prompt"], batch.ragged("tokens"), strict=True):
            response = prompt[::-1]
            n = len(response)
            samples.append(
                Sample(
                    tokens=[*tokens.tolist(), *map(ord, response)],
                    response=response,
                    response_length=n,
                    reward=float(n),
                    loss_mask=[1] * n,
                    rollout_log_probs=[-1.0] * n,
                    rollout_top_p_token_ids=torch.arange(n, dtype=torch.int32),
                    rollout_top_p_token_offsets=torch.arange(n + 1, dtype=torch.int32),
                    # (tokens - 1, layers, top-k) expert ids, as slime decodes them
                    rollout_routed_experts=torch.zeros(
                        len(tokens) + n - 1, 2, 2, dtype=torch.int32
                    ),
                    weight_versions=[str(hub.version)],
                    status=Sample.Status.COMPLETED,
                )
            )
        hub.put(sample_data(samples, ("tokens", *RESULT_FIELDS)), indices=meta, ack=meta)


def main() -> int:
    prompts = flowrl.Hub(list(PROMPT_COLUMNS))
    put_prompts(prompts, [Sample(prompt=f"question {i}", label=str(i)) for i in range(8)])
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
            experts = groups[0][0].rollout_routed_experts
            print(
                f"rollout {rollout_id}: {len(groups)} groups, rewards {rewards}, routed "
                f"experts {experts.dtype} {tuple(experts.shape)}"
            )
    finally:
        stop.set()
        worker.join()
        hub.close()
        prompts.close()
    return served


if __name__ == "__main__":
    main()

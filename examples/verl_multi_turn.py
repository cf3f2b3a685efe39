"""A multi-turn verl batch through a flowrl hub and back, with verl's own concat and union.

Two rollout workers each build a verl ``DataProto`` the way verl's agent loop does for
multi-turn rollouts: left-padded prompts, right-padded responses in which a tool's reply
sits between two LLM turns, and a ``response_mask`` that is 0 on the tool's tokens. Each
worker puts its batch into the hub (``from_dataproto``: any verl DataProto goes in). The
trainer takes the samples in two claims, turns each into a DataProto, joins them with
verl's ``DataProto.concat``, checks with verl's ``union`` that every key came back as the
workers built it, computes GRPO advantages (the tool's tokens get none), and settles both
claims at once with ``ack_dataproto``.

    pip install ... verl==0.9.1   # the install line in docs/verl.md
    python examples/verl_multi_turn.py
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils.model import compute_position_id_with_mask
from verl.utils.torch_functional import pad_2d_list_to_length

import flowrl
from flowrl.integrations.verl import ack_dataproto, from_dataproto, to_dataproto

PAD, PROMPT_LEN, RESPONSE_LEN = 151643, 8, 16  # the tokenizer's pad id, verl's widths
PROMPTS, N = 3, 4  # prompts per worker, rollouts per prompt (verl's rollout.n)


def rollout(worker: int, rng: np.random.Generator) -> DataProto:
    """What verl's agent loop returns: turn 1, a tool's reply (masked), turn 2."""
    prompts, responses, masks, uids = [], [], [], []
    for p in range(PROMPTS):
        prompt = rng.integers(1, 1000, rng.integers(3, PROMPT_LEN + 1)).tolist()
        for _ in range(N):
            turn1, tool, turn2 = (rng.integers(1, 1000, rng.integers(1, 5)).tolist() for _ in "abc")
            prompts.append(prompt)
            responses.append(turn1 + tool + turn2)
            masks.append([1] * len(turn1) + [0] * len(tool) + [1] * len(turn2))
            uids.append(f"w{worker}-p{p}")
    p_ids = pad_2d_list_to_length([p[::-1] for p in prompts], PAD, PROMPT_LEN).flip(1)
    p_mask = pad_2d_list_to_length([[1] * len(p) for p in prompts], 0, PROMPT_LEN).flip(1)
    r_ids = pad_2d_list_to_length(responses, PAD, RESPONSE_LEN)
    r_mask = pad_2d_list_to_length([[1] * len(r) for r in responses], 0, RESPONSE_LEN)
    attention = torch.cat([p_mask, r_mask], dim=1)
    scores = torch.zeros(len(responses), RESPONSE_LEN)
    scores[torch.arange(len(responses)), r_mask.sum(-1) - 1] = torch.from_numpy(
        rng.integers(0, 2, len(responses)).astype(np.float32)
    )
    return DataProto.from_single_dict(
        {
            "prompts": p_ids,
            "responses": r_ids,
            "input_ids": torch.cat([p_ids, r_ids], dim=1),
            "attention_mask": attention,
            "position_ids": compute_position_id_with_mask(attention),
            "response_mask": pad_2d_list_to_length(masks, 0, RESPONSE_LEN),
            "rm_scores": scores,
            "uid": np.array(uids, dtype=object),
            "__num_turns__": np.full(len(uids), 3, dtype=np.int32),
        },
        meta_info={"global_steps": 1},
    )


def main() -> int:
    rng = np.random.default_rng(0)
    built = [rollout(w, rng) for w in range(2)]
    first = from_dataproto(built[0], pad_token_id=PAD)  # its columns declare the hub's
    hub = flowrl.Hub([first.column(name) for name in first.columns])
    hub.register_task("train", list(first.columns))
    for worker, dp in enumerate(built):
        batch = from_dataproto(dp, pad_token_id=PAD)
        _, group = np.unique(dp.non_tensor_batch["uid"], return_inverse=True)
        hub.put(batch.to_dict(), groups=worker * PROMPTS + group)

    # the trainer: two claims, each as verl's padded layout, joined by verl's concat
    claims = [hub.claim("train", PROMPTS * N) for _ in range(2)]
    parts = [
        to_dataproto(
            hub.get(meta),
            pad_token_id=PAD,
            prompt_length=PROMPT_LEN,
            response_length=RESPONSE_LEN,
            non_tensor=["__num_turns__"],  # verl keeps it as a numpy array
            meta_info={"global_steps": 1},
        )
        for meta in claims
    ]
    step = DataProto.concat(parts)
    order = np.argsort(np.concatenate([m.indices for m in claims]))  # put order
    step.reorder(torch.from_numpy(order))
    DataProto.concat(built).union(step)  # verl asserts every shared key is equal

    mask = step.batch["response_mask"]
    adv, _ = compute_grpo_outcome_advantage(
        step.batch["rm_scores"], mask, step.non_tensor_batch["uid"]
    )
    assert (adv[mask == 0] == 0).all()  # the tool's tokens and the padding get no advantage
    acked = ack_dataproto(hub, step)  # both claims, each sample once
    tool = (step.batch["attention_mask"][:, PROMPT_LEN:] == 1) & (mask == 0)
    print(f"{len(step)} samples of {len(claims)} claims; {int(tool.sum())} tool tokens masked")
    assert hub.statistics().tasks["train"].consumed == acked
    hub.close()
    return acked


if __name__ == "__main__":
    main()

"""DataProto conformance against the real verl 0.9.1: inputs built the way verl builds them.

Each test builds its DataProto with verl's own helpers (``DataProto.from_single_dict``,
``pad_2d_list_to_length``, ``compute_position_id_with_mask``, ``concat``, ``union``,
``pad_dataproto_to_divisor``, ``compute_grpo_outcome_advantage``) and compares with what
verl returns. CI runs these in the verl venv (.ci/run, ``pytest -m verl``).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError, LeaseError, SchemaError

pytestmark = pytest.mark.verl

verl = pytest.importorskip("verl", reason="verl==0.9.1 is not installed (see docs/verl.md)")
torch = pytest.importorskip("torch")

from verl import DataProto  # noqa: E402
from verl.protocol import pad_dataproto_to_divisor  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.utils.torch_functional import pad_2d_list_to_length  # noqa: E402

from flowrl.integrations.verl import (  # noqa: E402
    ack_dataproto,
    dataproto_claims,
    from_dataproto,
    to_dataproto,
)

PAD = 151643  # Qwen's pad id: not 0, so a wrong pad cannot pass unnoticed
P_LEN, R_LEN = 6, 12


# -- a multi-turn batch, built as verl's agent loop builds it (_postprocess) ---------------
def _turns(rng: np.random.Generator, rows: int) -> tuple[list, list, list]:
    """Responses of one or two LLM turns around a tool's reply; the mask is 0 on the
    tool's tokens (verl's response_mask)."""
    responses, masks, logps = [], [], []
    for i in range(rows):
        first = rng.integers(1, 1000, rng.integers(1, 4)).tolist()
        if i % 3 == 2:  # a single-turn row: no tool call
            tool, second = [], []
        else:
            tool = rng.integers(1, 1000, rng.integers(1, 4)).tolist()
            second = rng.integers(1, 1000, rng.integers(1, 4)).tolist()
        responses.append(first + tool + second)
        masks.append([1] * len(first) + [0] * len(tool) + [1] * len(second))
        logps.append([float(x) for x in -rng.random(len(first) + len(tool) + len(second))])
    return responses, masks, logps


def _left_pad(seqs: list[list[int]], pad: int, width: int) -> torch.Tensor:
    """verl pads prompts on the left (tokenizer.padding_side = "left")."""
    return pad_2d_list_to_length([s[::-1] for s in seqs], pad, width).flip(1)


def agent_loop_batch(
    seed: int = 0, prompts: int = 3, n: int = 4, *, response_mask: bool = True, tag: str = "q"
) -> DataProto:
    rng = np.random.default_rng(seed)
    rows = prompts * n
    prompt_lists = [
        rng.integers(1, 1000, rng.integers(2, P_LEN + 1)).tolist() for _ in range(prompts)
    ]
    prompt_rows = [p for p in prompt_lists for _ in range(n)]
    responses, masks, logps = _turns(rng, rows)
    p_ids = _left_pad(prompt_rows, PAD, P_LEN)
    p_attn = _left_pad([[1] * len(p) for p in prompt_rows], 0, P_LEN)
    r_ids = pad_2d_list_to_length(responses, PAD, R_LEN)
    r_attn = pad_2d_list_to_length([[1] * len(r) for r in responses], 0, R_LEN)
    attention = torch.cat([p_attn, r_attn], dim=1)
    scores = torch.from_numpy(rng.integers(0, 2, rows).astype(np.float32))
    rm_scores = torch.zeros(rows, R_LEN)
    rm_scores[torch.arange(rows), r_attn.sum(-1) - 1] = scores
    data = {
        "prompts": p_ids,
        "responses": r_ids,
        "input_ids": torch.cat([p_ids, r_ids], dim=1),
        "attention_mask": attention,
        "position_ids": compute_position_id_with_mask(attention),
        "rollout_log_probs": pad_2d_list_to_length(logps, 0.0, R_LEN),
        "rm_scores": rm_scores,
        "uid": np.array([f"{tag}-{i // n}" for i in range(rows)], dtype=object),
        "data_source": np.array(["gsm8k"] * rows, dtype=object),
        "reward_model": np.array(
            [{"ground_truth": str(i // n), "style": "rule"} for i in range(rows)], dtype=object
        ),
        "__num_turns__": np.array([1 if i % 3 == 2 else 3 for i in range(rows)], dtype=np.int32),
    }
    if response_mask:
        data["response_mask"] = pad_2d_list_to_length(masks, 0, R_LEN) * r_attn
    return DataProto.from_single_dict(data, meta_info={"global_steps": 1})


def back_to_verl(batch: flowrl.Batch, like: DataProto) -> DataProto:
    """to_dataproto with the widths, pad and placement the verl batch ``like`` has."""
    return to_dataproto(
        batch,
        pad_token_id=PAD,
        prompt_length=P_LEN,
        response_length=R_LEN,
        non_tensor=list(like.non_tensor_batch),
        meta_info=like.meta_info,
    )


def tensor_keys(dp: DataProto) -> list[str]:
    return list(dp.batch.keys())  # a TensorDict iterates over rows, and has no `in`


def assert_keys_equal(orig: DataProto, result: DataProto) -> None:
    """Every key of ``orig`` is in ``result``, equal (dtype and all), and verl's own union
    of the two goes through (it asserts equality of every shared key)."""
    for key in tensor_keys(orig):
        a, b = orig.batch[key], result.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    for key, a in orig.non_tensor_batch.items():
        b = result.non_tensor_batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape and list(a) == list(b), key
    copy.deepcopy(orig).union(result)


def _advantages(dp: DataProto) -> torch.Tensor:
    mask = dp.batch["response_mask"]
    rewards = dp.batch["rm_scores"]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, dp.non_tensor_batch["uid"])
    return adv


# -- item 4: a DataProto verl built goes in and comes back equal ---------------------------
@pytest.mark.parametrize("response_mask", [True, False])
def test_a_verl_batch_round_trips_equal(response_mask: bool) -> None:
    orig = agent_loop_batch(response_mask=response_mask)
    batch = from_dataproto(orig, pad_token_id=PAD)
    # lengths come from the masks: the unpadded prompts and responses
    attention = orig.batch["attention_mask"]
    for i in range(len(orig)):
        p_len = int(attention[i, :P_LEN].sum())
        r_len = int(attention[i, P_LEN:].sum())
        assert (
            batch.ragged("prompt_ids")[i].tolist()
            == orig.batch["prompts"][i, P_LEN - p_len :].tolist()
        )
        assert (
            batch.ragged("response_ids")[i].tolist() == orig.batch["responses"][i, :r_len].tolist()
        )
    assert "input_ids" not in batch.columns and "position_ids" not in batch.columns  # rebuilt
    assert batch["uid"] == list(orig.non_tensor_batch["uid"])
    assert batch.meta.lease == 0  # not a claim
    assert_keys_equal(orig, back_to_verl(batch, orig))


def test_a_verl_batch_through_the_hub_comes_back_equal() -> None:
    orig = agent_loop_batch(seed=1)
    batch = from_dataproto(orig, pad_token_id=PAD)
    hub = flowrl.Hub([batch.column(name) for name in batch.columns])
    hub.register_task("train", list(batch.columns))
    _, groups = np.unique(orig.non_tensor_batch["uid"], return_inverse=True)
    hub.put(batch.to_dict(), groups=groups)
    meta = hub.claim("train", len(orig))
    order = np.argsort(meta.indices)  # the hub's order need not be the put order
    result = back_to_verl(hub.get(meta), orig)
    result.reorder(torch.from_numpy(order))
    assert_keys_equal(orig, result)
    assert torch.equal(_advantages(result), _advantages(orig))  # GRPO sees the same batch
    assert ack_dataproto(hub, result) == len(orig)
    assert hub.statistics().tasks["train"].consumed == len(orig)
    hub.close()


def test_a_verl_generation_batch_and_mrope_positions_round_trip() -> None:
    """verl's gen batch (input_ids, attention_mask, position_ids: no prompts/responses)
    and Qwen2-VL's (n, 3, L) position_ids: kept as the tensors they are."""
    ids = _left_pad([[5, 6], [7, 8, 9]], PAD, 4)
    attention = _left_pad([[1, 1], [1, 1, 1]], 0, 4)
    gen = DataProto.from_single_dict(
        {"input_ids": ids, "attention_mask": attention,
         "position_ids": compute_position_id_with_mask(attention),
         "uid": np.array(["a", "b"], dtype=object)}
    )  # fmt: skip
    batch = from_dataproto(gen)
    assert batch.column("input_ids") == Column.tensor("input_ids", "int64", (4,))
    assert_keys_equal(gen, to_dataproto(batch, non_tensor=["uid"]))
    orig = agent_loop_batch(seed=2, prompts=1, n=2)
    mrope = orig.batch["position_ids"][:, None, :].expand(-1, 3, -1).contiguous()
    orig.batch["position_ids"] = mrope
    batch = from_dataproto(orig, pad_token_id=PAD)
    assert batch.column("position_ids").shape == (3, P_LEN + R_LEN)
    assert_keys_equal(orig, back_to_verl(batch, orig))


def test_a_verl_batch_in_another_layout_is_refused() -> None:
    orig = agent_loop_batch(seed=3)
    with pytest.raises(SchemaError, match=r"batch\['prompts'\] is not verl's padded layout.*"
                       r"holds 151643 .* pass the pad_token_id"):  # fmt: skip
        from_dataproto(orig)  # verl padded with 151643, not the default 0
    orig.batch["rollout_log_probs"] = orig.batch["rollout_log_probs"].bfloat16()
    with pytest.raises(SchemaError, match=r"rollout_log_probs'\] is torch.bfloat16"):
        from_dataproto(orig, pad_token_id=PAD)
    with pytest.raises(SchemaError, match="has a key 'uid'"):
        from_dataproto(agent_loop_batch(seed=3), prompt="uid", pad_token_id=PAD)


# -- item 3: a user's keys round-trip unchanged ----------------------------------------------
def _multi_turn_hub() -> flowrl.Hub:
    return flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.ragged("response_mask", "int64"),  # multi-turn: 0 on the tool's tokens
            Column.string("uid"),
            Column.scalar("flowrl_index", "int64"),  # any name a column can have is the user's
        ]
    )


def _unpadded(padded: torch.Tensor, lengths: list[int]) -> list[np.ndarray]:
    return [row[:k].numpy() for row, k in zip(padded, lengths, strict=True)]


def test_a_multi_turn_response_mask_and_uids_are_the_users() -> None:
    orig = agent_loop_batch(seed=4)
    attention = orig.batch["attention_mask"]
    lengths = attention[:, P_LEN:].sum(-1).tolist()
    hub = _multi_turn_hub()
    hub.register_task("t", [c.name for c in hub.columns])
    _, groups = np.unique(orig.non_tensor_batch["uid"], return_inverse=True)
    p_lengths = attention[:, :P_LEN].sum(-1).tolist()
    hub.put(
        {
            "prompt_ids": [
                p[P_LEN - k :].numpy()
                for p, k in zip(orig.batch["prompts"], p_lengths, strict=True)
            ],
            "response_ids": _unpadded(orig.batch["responses"], lengths),
            "response_mask": _unpadded(orig.batch["response_mask"], lengths),
            "uid": list(orig.non_tensor_batch["uid"]),
            "flowrl_index": np.arange(len(orig)) + 1000,
        },
        groups=groups + 100,  # hub group ids unlike the uids
    )
    meta = hub.claim("t", len(orig))
    result = to_dataproto(
        hub.get(meta), pad_token_id=PAD, prompt_length=P_LEN, response_length=R_LEN
    )
    result.reorder(torch.from_numpy(np.argsort(meta.indices)))
    assert torch.equal(result.batch["response_mask"], orig.batch["response_mask"])
    assert (result.batch["response_mask"] != result.batch["attention_mask"][:, P_LEN:]).any()
    assert list(result.non_tensor_batch["uid"]) == list(orig.non_tensor_batch["uid"])
    assert result.batch["flowrl_index"].tolist() == list(range(1000, 1000 + len(orig)))
    merged = copy.deepcopy(orig).union(result)  # verl's union with the original works
    assert torch.equal(_advantages(merged), _advantages(orig))
    back = from_dataproto(result)
    assert back["response_mask"] == hub.get(meta)["response_mask"]
    assert back["uid"] == hub.get(meta)["uid"]
    hub.ack(back.meta)
    hub.close()


def test_flowrl_bookkeeping_cannot_collide_with_a_column() -> None:
    orig = agent_loop_batch(seed=5, prompts=1, n=2)
    batch = from_dataproto(orig, pad_token_id=PAD)
    dp = back_to_verl(batch, orig)
    theirs = {*tensor_keys(orig), *orig.non_tensor_batch, *orig.meta_info}
    ours = {*tensor_keys(dp), *dp.non_tensor_batch, *dp.meta_info} - theirs
    assert sorted(ours) == ["flowrl:rows", "flowrl:schema", "flowrl:task"]
    for key in ours:
        with pytest.raises(ConfigError, match="Python identifier"):
            Column.scalar(key, "int64")


# -- item 2: concat of batches from separate claims -------------------------------------------
def _claims_hub(n: int = 12) -> flowrl.Hub:
    hub = flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.ragged("logp", "float32"),
            Column.scalar("score", "float32"),
            Column.string("data_source"),
        ]
    )
    hub.register_task("train", ["prompt_ids", "response_ids", "logp", "score", "data_source"])
    rng = np.random.default_rng(6)
    lengths = rng.integers(1, R_LEN, n)
    hub.put(
        {
            "prompt_ids": [rng.integers(1, 9, rng.integers(1, P_LEN)) for _ in range(n)],
            "response_ids": [rng.integers(1, 9, k) for k in lengths],
            "logp": [-rng.random(k).astype(np.float32) for k in lengths],
            "score": rng.integers(0, 2, n).astype(np.float32),
            "data_source": ["math"] * n,
        },
        groups=np.repeat(np.arange(n // 4), 4),
    )
    return hub


def _to_verl(batch: flowrl.Batch) -> DataProto:
    return to_dataproto(
        batch, prompt_length=P_LEN, response_length=R_LEN, meta_info={"temperature": 1.0}
    )


def test_concat_of_separate_claims_settles_every_lease_once() -> None:
    hub = _claims_hub()
    metas = [hub.claim("train", 4) for _ in range(3)]  # three claims, three leases
    parts = [_to_verl(hub.get(m)) for m in metas]
    joined = DataProto.concat(parts)  # verl's own concat (raised "Conflicting values" before)
    assert joined.meta_info["temperature"] == 1.0
    # the same as converting all the samples at once, key for key
    everything = hub.meta(np.concatenate([m.indices for m in metas]), metas[0].columns)
    whole = _to_verl(hub.get(everything))
    for key in tensor_keys(whole):
        if key != "flowrl:rows":
            assert torch.equal(joined.batch[key], whole.batch[key]), key
    back = from_dataproto(joined)
    assert back.meta.lease == 0  # rows of three claims: ack them with ack_dataproto
    with pytest.raises(LeaseError):
        hub.ack(back.meta)
    np.testing.assert_array_equal(back.indices, everything.indices)
    claims = dataproto_claims(joined)
    assert [c.lease for c in claims] == [m.lease for m in metas]
    assert ack_dataproto(hub, joined) == 12
    assert hub.statistics().tasks["train"].consumed == 12
    with pytest.raises(LeaseError):  # exactly once: the leases are settled
        ack_dataproto(hub, joined)
    hub.close()


def test_chunks_padding_and_reorders_of_claims_ack_exactly_their_rows() -> None:
    hub = _claims_hub()
    a, b = hub.claim("train", 4), hub.claim("train", 4)
    joined = DataProto.concat([_to_verl(hub.get(a)), _to_verl(hub.get(b))])
    joined.reorder(torch.tensor([7, 0, 6, 1, 5, 2, 4, 3]))
    first, second = joined.chunk(2)  # verl's dispatch to two data-parallel ranks
    padded, pad = pad_dataproto_to_divisor(first, 3)  # repeats rows
    assert pad == 2
    assert ack_dataproto(hub, padded) == 4  # each sample once
    assert hub.statistics().tasks["train"].consumed == 4
    assert ack_dataproto(hub, second) == 4
    assert hub.statistics().tasks["train"].consumed == 8
    hub.close()


def test_ack_dataproto_refuses_a_dataproto_without_claims() -> None:
    hub = _claims_hub()
    with pytest.raises(ConfigError, match="never claimed from a hub"):
        ack_dataproto(hub, agent_loop_batch(seed=7))
    hub.close()


# -- the example -------------------------------------------------------------------------------
def test_multi_turn_example_runs() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "verl_multi_turn.py"
    spec = importlib.util.spec_from_file_location("verl_multi_turn", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 24

"""The Hugging Face Llama <-> Megatron GPT weight mapping (flowrl.engines._megatron_llama),
without megatron: the fused layouts by hand, the round trip, and what is refused. That
Megatron computes the Llama's logits with these weights is
tests/integration/test_engine_megatron.py's (skipped without megatron-core)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.engines._megatron_llama import LlamaShape, hf_to_megatron, megatron_to_hf
from flowrl.errors import ConfigError


def _config(**overrides: object) -> SimpleNamespace:
    """A LlamaConfig's fields: 4 query heads in 2 key/value groups, heads 2 wide."""
    fields: dict[str, object] = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 6,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 32,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    return SimpleNamespace(**{**fields, **overrides})


def _hf_weights(shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Every weight of the Llama, each filled with distinct numbers (arange)."""
    h, d = shape.hidden_size, shape.head_dim
    per_layer = {
        "self_attn.q_proj.weight": (shape.n_heads * d, h),
        "self_attn.k_proj.weight": (shape.n_kv_heads * d, h),
        "self_attn.v_proj.weight": (shape.n_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, shape.n_heads * d),
        "mlp.gate_proj.weight": (shape.intermediate_size, h),
        "mlp.up_proj.weight": (shape.intermediate_size, h),
        "mlp.down_proj.weight": (h, shape.intermediate_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    shapes = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.n_layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
    shapes["model.norm.weight"] = (h,)
    if not shape.tied_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    start = 0
    out = {}
    for name, s in shapes.items():
        n = int(torch.tensor(s).prod())
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(s)
        start += n
    return out


def test_shape_reads_a_llama_config() -> None:
    shape = LlamaShape.of(_config())
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (4, 2, 2)
    assert shape.rope_theta == 500000.0 and shape.tied_embeddings


def test_fused_qkv_holds_each_groups_queries_then_its_key_and_value() -> None:
    shape = LlamaShape.of(_config())
    hf = _hf_weights(shape)
    mg = hf_to_megatron(hf, shape)
    qkv = mg["decoder.layers.1.self_attention.linear_qkv.weight"]
    q = hf["model.layers.1.self_attn.q_proj.weight"].split(2)  # one row block per head
    k = hf["model.layers.1.self_attn.k_proj.weight"].split(2)
    v = hf["model.layers.1.self_attn.v_proj.weight"].split(2)
    # group 0: query heads 0 and 1, k_0, v_0; group 1: query heads 2 and 3, k_1, v_1
    expected = torch.cat([q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]])
    assert torch.equal(qkv, expected)
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))  # the activation takes the first half
    norm = mg["decoder.layers.0.pre_mlp_layernorm.weight"]
    assert torch.equal(norm, hf["model.layers.0.post_attention_layernorm.weight"])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip_gives_back_every_weight_in_the_hf_order(tied: bool) -> None:
    shape = LlamaShape.of(_config(tie_word_embeddings=tied))
    hf = _hf_weights(shape)
    mg = hf_to_megatron(hf, shape)
    assert ("output_layer.weight" in mg) is not tied
    back = list(megatron_to_hf(mg, shape))
    assert [n for n, _ in back] == list(hf)
    for name, tensor in back:
        assert torch.equal(tensor, hf[name]), name


def test_what_does_not_map_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['attention_bias', 'hidden_act'\]"):
        LlamaShape.of(_config(attention_bias=True, hidden_act="gelu"))
    with pytest.raises(ConfigError, match="rope_type"):
        LlamaShape.of(_config(rope_parameters={"rope_type": "llama3", "factor": 8.0}))
    shape = LlamaShape.of(_config())
    hf = _hf_weights(shape)
    del hf["model.norm.weight"]
    with pytest.raises(ConfigError, match=r"missing \['model.norm.weight'\]"):
        hf_to_megatron(hf, shape)
    mg = hf_to_megatron(_hf_weights(shape), shape)
    with pytest.raises(ConfigError, match=r"unexpected \['output_layer.weight'\]"):
        list(megatron_to_hf({**mg, "output_layer.weight": torch.zeros(10, 8)}, shape))

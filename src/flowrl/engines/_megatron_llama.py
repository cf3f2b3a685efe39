"""Hugging Face Llama <-> Megatron-core GPT: the shape both describe and the weight names.

Pure torch (no megatron import), so the mapping is tested wherever flowrl is.
:class:`LlamaShape` reads a ``transformers`` ``LlamaConfig`` and refuses what a Megatron
GPT built by ``flowrl.engines.megatron`` does not compute the same way (biases, another
activation, scaled RoPE). The weights correspond one to one except two fused matrices:

* ``self_attention.linear_qkv`` holds, for each key/value group ``g`` in turn, the
  query heads of that group, then ``k_g``, then ``v_g`` (``head_dim`` rows each), the
  layout Megatron's attention splits its fused projection by;
* ``mlp.linear_fc1`` is ``gate_proj`` on top of ``up_proj`` (Megatron's gated linear unit
  applies the activation to the first half).

Both functions keep Hugging Face's order of names (``module_weights`` of the HF model), so
what :func:`megatron_to_hf` yields is what the rollout side loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, final

import torch

from flowrl.errors import ConfigError

__all__ = ["LlamaShape", "hf_to_megatron", "megatron_to_hf"]

_LAYER_NORMS = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
)


@final
@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What a Megatron GPT needs to compute as a Hugging Face Llama does."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool

    @classmethod
    def of(cls, config: Any) -> LlamaShape:
        """The shape of a ``LlamaConfig``; :class:`ConfigError` for what does not map."""
        rope = dict(getattr(config, "rope_parameters", None) or {})
        unsupported = {
            "attention_bias": bool(getattr(config, "attention_bias", False)),
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
            "hidden_act": getattr(config, "hidden_act", "silu") != "silu",
            "rope_type": rope.get("rope_type", "default") != "default",
        }
        bad = sorted(k for k, v in unsupported.items() if v)
        if bad:
            raise ConfigError(
                f"the Megatron engine builds a Llama without biases, with SiLU and plain RoPE; "
                f"this config sets {bad}; use TorchUpdateEngine or DeepSpeedUpdateEngine for it"
            )
        n_heads = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            n_layers=int(config.num_hidden_layers),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_positions=int(config.max_position_embeddings),
            tied_embeddings=bool(config.tie_word_embeddings),
        )

    @property
    def _heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads


def hf_to_megatron(
    weights: Mapping[str, torch.Tensor], shape: LlamaShape
) -> dict[str, torch.Tensor]:
    """Megatron GPT parameters from a Hugging Face Llama's named weights (all of them)."""
    _check_names(weights, _hf_names(shape), "Hugging Face Llama")
    out = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"]}
    d = shape.head_dim
    for i in range(shape.n_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = weights[hf + "self_attn.q_proj.weight"]
        k = weights[hf + "self_attn.k_proj.weight"]
        v = weights[hf + "self_attn.v_proj.weight"]
        h = q.shape[1]
        groups = [
            q.reshape(shape.n_kv_heads, shape._heads_per_group * d, h),
            k.reshape(shape.n_kv_heads, d, h),
            v.reshape(shape.n_kv_heads, d, h),
        ]
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat(groups, dim=1).reshape(-1, h)
        out[mg + "self_attention.linear_proj.weight"] = weights[hf + "self_attn.o_proj.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [weights[hf + "mlp.gate_proj.weight"], weights[hf + "mlp.up_proj.weight"]]
        )
        out[mg + "mlp.linear_fc2.weight"] = weights[hf + "mlp.down_proj.weight"]
        for hf_norm, mg_norm in _LAYER_NORMS:
            out[mg + mg_norm] = weights[hf + hf_norm]
    out["decoder.final_layernorm.weight"] = weights["model.norm.weight"]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = weights["lm_head.weight"]
    return out


def megatron_to_hf(
    weights: Mapping[str, torch.Tensor], shape: LlamaShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """A Megatron GPT's parameters under Hugging Face Llama names, in the HF model's
    order (views where the layout allows)."""
    _check_names(weights, _megatron_names(shape), "Megatron GPT")
    yield "model.embed_tokens.weight", weights["embedding.word_embeddings.weight"]
    d, per_group = shape.head_dim, shape._heads_per_group
    for i in range(shape.n_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = weights[mg + "self_attention.linear_qkv.weight"]
        h = qkv.shape[1]
        q, k, v = qkv.reshape(shape.n_kv_heads, (per_group + 2) * d, h).split(
            [per_group * d, d, d], dim=1
        )
        yield hf + "self_attn.q_proj.weight", q.reshape(-1, h)
        yield hf + "self_attn.k_proj.weight", k.reshape(-1, h)
        yield hf + "self_attn.v_proj.weight", v.reshape(-1, h)
        yield hf + "self_attn.o_proj.weight", weights[mg + "self_attention.linear_proj.weight"]
        gate, up = weights[mg + "mlp.linear_fc1.weight"].chunk(2)
        yield hf + "mlp.gate_proj.weight", gate
        yield hf + "mlp.up_proj.weight", up
        yield hf + "mlp.down_proj.weight", weights[mg + "mlp.linear_fc2.weight"]
        for hf_norm, mg_norm in _LAYER_NORMS:
            yield hf + hf_norm, weights[mg + mg_norm]
    yield "model.norm.weight", weights["decoder.final_layernorm.weight"]
    if not shape.tied_embeddings:
        yield "lm_head.weight", weights["output_layer.weight"]


def _hf_names(shape: LlamaShape) -> set[str]:
    per_layer = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(hf for hf, _ in _LAYER_NORMS),
    ]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    names |= {f"model.layers.{i}.{n}" for i in range(shape.n_layers) for n in per_layer}
    return names if shape.tied_embeddings else names | {"lm_head.weight"}


def _megatron_names(shape: LlamaShape) -> set[str]:
    per_layer = [
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        *(mg for _, mg in _LAYER_NORMS),
    ]
    names = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    names |= {f"decoder.layers.{i}.{n}" for i in range(shape.n_layers) for n in per_layer}
    return names if shape.tied_embeddings else names | {"output_layer.weight"}


def _check_names(weights: Mapping[str, torch.Tensor], expected: set[str], what: str) -> None:
    missing = sorted(expected - weights.keys())
    extra = sorted(weights.keys() - expected)
    if missing or extra:
        raise ConfigError(
            f"the weights are not those of this {what}: missing {missing[:4]}, unexpected "
            f"{extra[:4]}; pass every weight of a model of the same config"
        )

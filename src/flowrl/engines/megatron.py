"""Megatron-core update engine: a Megatron ``GPTModel`` equivalent to a Hugging Face Llama.

:class:`MegatronUpdateEngine` takes the project's policy (a ``transformers``
``LlamaForCausalLM``, e.g. :func:`flowrl.models.hf.tiny_llama`), builds the Megatron-core
GPT of the same shape (RMSNorm, SwiGLU, RoPE, no biases, grouped-query attention, tied or
untied embeddings; :mod:`flowrl.engines._megatron_llama` maps the weights both ways) and
trains it with the update protocol: ``train_step`` on packed micro-batches with the
caller's ``LossFn`` (``flowrl.engines._training``), ``named_weights`` under the Hugging
Face names the rollout side loads, ``state_dict`` / ``load_state_dict`` with the weights
under those names too (a checkpoint of the torch engine restores into this one and back).

What runs is Megatron's: its ``TransformerConfig``, the local (no Transformer Engine, no
apex) layer spec, its embedding, transformer block (RMSNorm, fused-QKV attention with
rotary embeddings, gated MLP) and output layer, on the Llama's device and in its dtype
(float32 on CPU; bfloat16 on a GPU, AdamW then stepping the bfloat16 weights). Two
choices make it run on CPU as well as on GPUs, through Megatron's own extension points
and without patching it:

* core attention is :class:`SDPACoreAttention`, torch's ``scaled_dot_product_attention``
  plugged into the layer spec (Megatron's local ``DotProductAttention`` takes its scratch
  buffer from ``torch.cuda.current_device()``);
* the forward pass runs the model's ``embedding`` -> ``decoder`` -> ``output_layer`` with
  the RoPE table made by the model's own ``rotary_pos_emb.get_freqs_non_repeated``
  (``GPTModel.forward`` moves the table's frequencies to ``torch.cuda.current_device()``).

Parallelism: tensor and pipeline parallel size 1; data parallel over every rank of the
default process group (joined when it exists, else created from torchrun's ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or a one-process group in-process;
gloo for a model on the CPU, NCCL for one on a GPU), gradients summed over Megatron's
data-parallel group. The optimizer is torch's AdamW (:class:`~flowrl.engines.OptimConfig`),
as in the other engines. Megatron is imported only when an engine is constructed.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, final

import torch
import torch.distributed as dist

from flowrl._weights.sync import load_named, module_weights
from flowrl.engines._distributed import init_default_group
from flowrl.engines._megatron_llama import LlamaShape, hf_to_megatron, megatron_to_hf
from flowrl.engines._training import OptimConfig, TokenWeightedTrainer
from flowrl.errors import ConfigError

__all__ = ["MegatronUpdateEngine", "SDPACoreAttention"]

_INSTALL = "pip install 'flowrl[megatron]' (in the same pip command as torch, e.g. torch==2.13.0)"


@final
class MegatronUpdateEngine(TokenWeightedTrainer):
    """Trains a Megatron-core GPT built from ``model``, a Hugging Face Llama (module
    docstring); ``model`` itself is only read, and sets the engine's device and dtype.
    ``backend``: the process-group backend when the engine creates the group (default:
    gloo for a model on the CPU, nccl for one on a GPU)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig | None = None,
        *,
        version: int = 0,
        pad_id: int = 0,
        backend: str | None = None,
    ) -> None:
        first = next(model.parameters())
        with _quiet_on_cpu(first.device):
            try:
                from megatron.core import parallel_state
            except ImportError as exc:
                raise ConfigError(f"MegatronUpdateEngine needs megatron-core: {_INSTALL}") from exc
            self.shape = LlamaShape.of(_llama_config(model))
            self._owns_parallel_state = _init_parallel(backend, first.device)
            self._dp_group = parallel_state.get_data_parallel_group()
            self.model = _build_gpt(self.shape, first.dtype)
        self.model.to(first.device, first.dtype)  # Megatron makes its norms float32
        weights = hf_to_megatron(dict(module_weights(model)), self.shape)
        load_named(self.model, weights.items())
        self.optim = optim or OptimConfig()
        self._optimizer = self.optim.adamw(self.model.parameters())
        super().__init__(
            _MegatronLM(self.model, self.shape), version=version, pad_id=pad_id, device=first.device
        )

    @property
    def data_parallel_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def _train_mode(self, training: bool) -> None:
        self.model.train(training)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self._sum_over_ranks(values, self._dp_group)

    def _apply(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.data_parallel_size > 1:  # each rank's gradient is its share of the token mean
            for p in params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self._dp_group)  # type: ignore[arg-type]
        limit = self.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, float("inf") if limit is None else limit)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under the Hugging Face Llama's names and layout, on the CPU."""
        live = {n: p.detach() for n, p in self.model.named_parameters()}
        return ((n, t.cpu()) for n, t in megatron_to_hf(live, self.shape))

    def state_dict(self) -> dict[str, Any]:
        """The weights under Hugging Face names (as :meth:`named_weights`), the AdamW
        state of the Megatron parameters, the version."""
        return {
            "model": dict(self.named_weights()),
            "optimizer": self._optimizer.state_dict(),
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_checked(state, ("model", "optimizer", "version"))
        load_named(self.model, hf_to_megatron(state["model"], self.shape).items())
        self._optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])

    def close(self) -> None:
        """Tear down Megatron's model-parallel groups if this engine set them up (the
        default process group stays)."""
        if self._owns_parallel_state:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            self._owns_parallel_state = False


class SDPACoreAttention(torch.nn.Module):
    """Megatron core attention (the ``CoreAttention`` protocol of
    ``megatron.core.transformer.attention``) over ``torch.nn.functional.
    scaled_dot_product_attention``: causal self-attention on ``[s, b, heads, head_dim]``
    queries and ``[s, b, groups, head_dim]`` keys and values, returning ``[s, b, heads *
    head_dim]``. Built by Megatron from the layer spec with its keyword arguments."""

    def __init__(
        self,
        *,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        if getattr(attn_mask_type, "name", attn_mask_type) != "causal":
            raise ConfigError(
                f"SDPACoreAttention computes causal self-attention, got mask type "
                f"{attn_mask_type} in layer {layer_number}; use a Transformer Engine spec"
            )
        self.softmax_scale = softmax_scale
        self.dropout = float(config.attention_dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params:
            raise ConfigError(
                "SDPACoreAttention takes causal attention over right-padded rows only: "
                "pass attention_mask=None and no attention bias or packed sequences"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).flatten(2)


@final
class _MegatronLM:
    """A Megatron GPT under flowrl's :class:`~flowrl.models.causal.CausalLM` convention,
    for right-padded batches (training and recompute; it does not decode)."""

    def __init__(self, gpt: torch.nn.Module, shape: LlamaShape) -> None:
        self.gpt = gpt
        self.shape = shape

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)``."""
        if cache is not None:
            raise ConfigError("the Megatron engine trains and recomputes; it does not decode")
        if attention_mask is not None and bool(
            (attention_mask[:, 1:] > attention_mask[:, :-1]).any()
        ):
            raise ConfigError(
                "the Megatron engine takes right-padded rows (RoPE positions count from the "
                "first column); TrainBatch.model_inputs pads on the right"
            )
        gpt: Any = self.gpt
        if input_ids.shape[1] > self.shape.max_positions:
            raise ConfigError(
                f"a row of {input_ids.shape[1]} tokens exceeds the model's "
                f"{self.shape.max_positions} positions"
            )
        freqs = gpt.rotary_pos_emb.get_freqs_non_repeated(input_ids.shape[1])
        rope = torch.cat((freqs, freqs), dim=-1)[:, None, None, :].to(input_ids.device)
        hidden = gpt.embedding(input_ids=input_ids, position_ids=None)  # [T, B, hidden]
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        tied = gpt.shared_embedding_or_output_weight() if self.shape.tied_embeddings else None
        logits, _ = gpt.output_layer(hidden, weight=tied)
        return logits.transpose(0, 1)

    def new_cache(self, batch_size: int, max_len: int | None = None, *, device: Any = None) -> Any:
        raise ConfigError("the Megatron engine trains and recomputes; it does not decode")


def _llama_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llama":
        raise ConfigError(
            f"MegatronUpdateEngine builds its GPT from a Hugging Face Llama "
            f"(flowrl.models.hf.tiny_llama, transformers.LlamaForCausalLM), got "
            f"{type(model).__name__}; use TorchUpdateEngine for other models"
        )
    return config


# What Megatron-core says on every CPU run: its fused GPU kernels (Transformer Engine,
# Apex) are absent, and the local layer spec's default CUDA-graph scope is deprecated.
_CPU_NOISE = r"((Transformer Engine and Apex are|Apex is) not installed|full scope is deprecated)"


@contextlib.contextmanager
def _quiet_on_cpu(device: torch.device) -> Iterator[None]:
    """Silence Megatron-core's warnings about GPU-only kernels for a model on the CPU
    (also on a machine with a GPU: the kernels would not serve it)."""
    with warnings.catch_warnings():
        if device.type == "cpu":
            warnings.filterwarnings("ignore", message=_CPU_NOISE, category=UserWarning)
        yield


def _init_parallel(backend: str | None, device: torch.device) -> bool:
    """Join or create the default group (NCCL when the model is on a GPU, gloo when it is
    on the CPU, also on a machine with GPUs: NCCL reduces only GPU tensors), then
    Megatron's groups (tensor and pipeline parallel 1) unless set up already; whether
    this call set them up."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device.index or int(os.environ.get("LOCAL_RANK", "0")))
        init_default_group(backend or ("nccl" if cuda else "gloo"))
    if parallel_state.model_parallel_is_initialized():
        sizes = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if sizes != (1, 1):
            raise ConfigError(
                f"MegatronUpdateEngine runs with tensor and pipeline parallel size 1, found "
                f"Megatron initialised with {sizes}; call "
                "parallel_state.destroy_model_parallel() first"
            )
        return False
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    return True


def _build_gpt(shape: LlamaShape, dtype: torch.dtype) -> torch.nn.Module:
    """Megatron's GPT of ``shape`` with ``dtype`` parameters: local layer spec with
    RMSNorm and SDPA core attention."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.n_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.n_heads,
        num_query_groups=shape.n_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # the Llama's weights are copied in
        transformer_impl="local",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(
        config,
        spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_positions,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=shape.tied_embeddings,
    )

"""A tiny from-scratch causal LM and its KV-cache sampler, for CPU-sized RL runs, and the
calling convention (:class:`CausalLM`) that also fits a Hugging Face model
(``flowrl.models.hf``, imported on demand: it needs ``transformers``)."""

from flowrl.models.causal import CausalLM, DecodeCache, as_causal_lm, max_positions
from flowrl.models.sampler import (
    ChunkCallback,
    GenerationResult,
    generate,
    left_pad,
    nucleus_logprobs,
)
from flowrl.models.transformer import KVCache, TinyLM, TinyLMConfig

__all__ = [
    "CausalLM",
    "ChunkCallback",
    "DecodeCache",
    "GenerationResult",
    "KVCache",
    "TinyLM",
    "TinyLMConfig",
    "as_causal_lm",
    "generate",
    "left_pad",
    "max_positions",
    "nucleus_logprobs",
]

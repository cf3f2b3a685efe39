"""A tiny from-scratch causal LM and its KV-cache sampler, for CPU-sized RL runs."""

from flowrl.models.sampler import ChunkCallback, GenerationResult, generate, left_pad
from flowrl.models.transformer import KVCache, TinyLM, TinyLMConfig

__all__ = [
    "ChunkCallback",
    "GenerationResult",
    "KVCache",
    "TinyLM",
    "TinyLMConfig",
    "generate",
    "left_pad",
]

"""Engines behind the stages: rollout (generation) and update (training) engines.

``flowrl.engines.base`` defines the protocol; implementations live beside it:
:class:`TorchRolloutEngine` and :class:`TorchUpdateEngine` (the built-in ones, over a
:class:`~flowrl.models.TinyLM` or a Hugging Face causal LM), :class:`DeepSpeedUpdateEngine`
(ZeRO 1-3; imports ``deepspeed`` only when constructed), :class:`MegatronUpdateEngine`
(a Megatron-core GPT; imports ``megatron.core`` only when constructed) and, in
``flowrl.engines.vllm``, vLLM. :func:`generate_durable` runs a claimed micro-batch on any
rollout engine durably (token-granular appends to the hub, resumption from a stored
prefix). Importing this package imports torch but no optional dependency. See
docs/engines.md.
"""

from __future__ import annotations

from flowrl.engines._training import OptimConfig
from flowrl.engines.base import (
    Completion,
    GenerationRequest,
    LossFn,
    RolloutEngine,
    SamplingParams,
    TrainBatch,
    UpdateEngine,
)
from flowrl.engines.deepspeed import DeepSpeedUpdateEngine
from flowrl.engines.durable import generate_durable
from flowrl.engines.megatron import MegatronUpdateEngine
from flowrl.engines.torch_rollout import TorchRolloutEngine
from flowrl.engines.torch_update import TorchUpdateEngine

__all__ = [
    "Completion",
    "DeepSpeedUpdateEngine",
    "GenerationRequest",
    "LossFn",
    "MegatronUpdateEngine",
    "OptimConfig",
    "RolloutEngine",
    "SamplingParams",
    "TorchRolloutEngine",
    "TorchUpdateEngine",
    "TrainBatch",
    "UpdateEngine",
    "generate_durable",
]

"""Engines behind the stages: rollout (generation) and update (training) engines.

``flowrl.engines.base`` defines the protocol; implementations live beside it, each
importing its heavy dependency (vLLM, DeepSpeed, Megatron-core, transformers) only when
constructed. See docs/engines.md.
"""

from __future__ import annotations

from flowrl.engines.base import (
    Completion,
    GenerationRequest,
    LossFn,
    RolloutEngine,
    SamplingParams,
    TrainBatch,
    UpdateEngine,
)

__all__ = [
    "Completion",
    "GenerationRequest",
    "LossFn",
    "RolloutEngine",
    "SamplingParams",
    "TrainBatch",
    "UpdateEngine",
]

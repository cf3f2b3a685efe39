"""Inputs of heterogeneous allocation: GPU pools, the RL workload and its length classes.

Response lengths are heavy-tailed, so one rate at the mean length mispredicts generation
(long responses run at a lower concurrency and a lower rate than short ones). The workload's
profiled sample is cut into ``length_classes`` classes with geometric edges between its
shortest and longest response; each class carries its share of the rollouts, its mean length
(the work) and its longest length (the straggler), and every replica configuration gets a
rate per class (AReaL-Hex eq. 2's ``h_{psi,w}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import msgspec
import numpy as np

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import HardwareSpec, ModelSpec

__all__ = ["GpuPool", "HexWorkload", "LengthClass", "length_classes"]


@final
class GpuPool(msgspec.Struct, frozen=True, kw_only=True):
    """``count`` GPUs of one type, ``price_per_hour`` each (any currency)."""

    name: str
    hw: HardwareSpec
    count: int
    price_per_hour: float

    def __post_init__(self) -> None:
        if self.count < 0 or self.price_per_hour < 0:
            raise ConfigError(
                f"GpuPool {self.name!r} needs count >= 0 and price_per_hour >= 0, "
                f"got {self.count}, {self.price_per_hour}"
            )


@final
class HexWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """One RL step: ``rollouts`` responses to prompts of ``prompt_tokens``, response lengths
    drawn from ``response_lengths`` (a profiled sample, cut into ``length_classes`` classes);
    training at ``train_eta`` of peak FLOPs on ``train_flops_per_token`` (default
    ``8 * params``: forward, backward, logprob recompute) in micro-batches of
    ``microbatch_tokens``; reward ``reward_s`` per step; weight sync over ``sync_bw`` bytes/s."""

    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    rollouts: int = 4096
    prompt_tokens: float = 512.0
    response_lengths: tuple[float, ...] = (1500.0,)
    length_classes: int = 8
    bs_max: int = 256
    train_eta: float = 0.4
    train_flops_per_token: float = 0.0
    microbatch_tokens: int = 16384
    reward_s: float = 0.0
    sync_bw: float = 10e9

    def __post_init__(self) -> None:
        if self.rollouts < 1 or self.bs_max < 1 or self.microbatch_tokens < 1:
            raise ConfigError("HexWorkload needs rollouts, bs_max, microbatch_tokens >= 1")
        if not self.response_lengths or min(self.response_lengths) <= 0:
            raise ConfigError(
                "HexWorkload.response_lengths must be a non-empty sample of positive lengths"
            )
        if self.length_classes < 1:
            raise ConfigError(f"HexWorkload.length_classes must be >= 1, got {self.length_classes}")
        if not 0 < self.train_eta <= 1 or self.sync_bw <= 0 or self.reward_s < 0:
            raise ConfigError("HexWorkload needs 0 < train_eta <= 1, sync_bw > 0, reward_s >= 0")

    @property
    def mean_length(self) -> float:
        return float(np.mean(self.response_lengths))

    @property
    def max_length(self) -> float:
        return float(np.max(self.response_lengths))

    @property
    def flops_per_token(self) -> float:
        return self.train_flops_per_token or 8.0 * self.model.params

    @property
    def fixed_s(self) -> float:
        """Per-step time on generation's side besides decoding: reward and weight sync."""
        return self.reward_s + self.model.weight_bytes / self.sync_bw


@final
@dataclass(frozen=True, slots=True)
class LengthClass:
    """``rollouts`` responses (a real number: a share of the step) of mean length
    ``mean_length`` and at most ``max_length`` tokens."""

    rollouts: float
    mean_length: float
    max_length: float


def length_classes(workload: HexWorkload) -> tuple[LengthClass, ...]:
    """The workload's length classes, shortest first (empty classes dropped)."""
    lens = np.sort(np.asarray(workload.response_lengths, dtype=np.float64))
    lo, hi = float(lens[0]), float(lens[-1])
    k = workload.length_classes
    if k == 1 or hi <= lo:
        bins = np.zeros(len(lens), dtype=np.int64)
    else:
        edges = np.geomspace(lo, hi, k + 1)[1:-1]
        bins = np.searchsorted(edges, lens, side="right")
    out = []
    for b in np.unique(bins):
        sel = lens[bins == b]
        share = len(sel) / len(lens)
        out.append(LengthClass(workload.rollouts * share, float(sel.mean()), float(sel.max())))
    return tuple(out)

"""The simulated disaggregated RL cluster: generation GPUs, trainer GPUs, links.

Generation runs on ``gpus`` GPUs in nodes of ``hw.gpus_per_node``; each node runs one
parallel mode from ``modes`` at a time (``gpus_per_node // mode.gpus`` replicas). The
trainer has ``train_gpus`` GPUs and costs ``train_flops_per_token`` per trained token at
efficiency ``train_eta`` (default ``8 * params``: forward + backward ``6P`` plus logprob
recompute ``2P``). The next stage after generation (reference/reward inference) runs on the
generation GPUs at ``infer_flops_per_token`` (default ``2P``) and ``infer_eta``. Weight sync
from trainer to generators takes ``sync_fixed_s + weight_bytes / sync_bw``.
"""

from __future__ import annotations

from typing import final

import msgspec

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import HardwareSpec, ModelSpec, ParallelMode

__all__ = ["DEFAULT_MODES", "ClusterSpec"]

DEFAULT_MODES: tuple[ParallelMode, ...] = tuple(ParallelMode.tensor(t) for t in (1, 2, 4, 8))


@final
class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True):
    gpus: int = 64
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    hw: HardwareSpec = msgspec.field(default_factory=HardwareSpec)
    modes: tuple[ParallelMode, ...] = DEFAULT_MODES
    bs_max: int = 256
    train_gpus: int = 64
    train_flops_per_token: float = 0.0
    train_eta: float = 0.4
    infer_flops_per_token: float = 0.0
    infer_eta: float = 0.5
    infer_setup_s: float = 3.0
    sync_bw: float = 50e9
    sync_fixed_s: float = 2.0

    def __post_init__(self) -> None:
        per = self.hw.gpus_per_node
        if self.gpus < per or self.gpus % per:
            raise ConfigError(
                f"ClusterSpec.gpus must be a positive multiple of gpus_per_node={per}, "
                f"got {self.gpus}"
            )
        if not self.modes:
            raise ConfigError("ClusterSpec.modes must not be empty")
        names = [m.name for m in self.modes]
        if len(set(names)) != len(names):
            raise ConfigError(f"ClusterSpec.modes has duplicate names: {names}")
        for m in self.modes:
            if per % m.gpus:
                raise ConfigError(f"mode {m.name!r} uses {m.gpus} GPUs, not a divisor of {per}")
        if self.bs_max < 1 or self.train_gpus < 1:
            raise ConfigError("ClusterSpec.bs_max and train_gpus must be >= 1")

    @property
    def nodes(self) -> int:
        return self.gpus // self.hw.gpus_per_node

    @property
    def train_cost(self) -> float:
        return self.train_flops_per_token or 8.0 * self.model.params

    @property
    def infer_cost(self) -> float:
        return self.infer_flops_per_token or 2.0 * self.model.active_params

    def mode_index(self, name: str) -> int:
        for i, m in enumerate(self.modes):
            if m.name == name:
                return i
        raise ConfigError(
            f"unknown parallel mode {name!r}; this cluster has {[m.name for m in self.modes]}"
        )

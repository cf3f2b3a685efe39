"""Performance model of LLM decode under a parallel mode: the numbers every planner uses.

Decode is memory-bandwidth bound: every iteration each GPU reads its share of the
weights and of the KV cache of every running sequence. One decode iteration of a
replica running ``b`` sequences holding ``K`` KV tokens in total takes::

    step(b, K) = c0 + c1*b                                  scheduler + sampling overhead
               + max(bytes_gpu / (BW*eta_mem),              HBM roofline ...
                     flops_gpu / (F*eta_flop))              ... or compute roofline
               + comm(b)                                    collectives on the critical path

    bytes_gpu = W_dense/tp + W_expert_touched(b)/ep + K*kv_bytes/min(tp, n_kv_heads)
    flops_gpu = (2*P_active*b + 4*L*d_attn*K) / gpus
    comm(b)   = 2*L*allreduce(tp, b*h*2)          (two all-reduces per layer, TP)
              + 2*L*alltoall(ep, b*top_k*h*2)     (dispatch + combine, EP)
              + 2*L*m2n(b*h*2)                    (attention<->FFN hops, AFD)
    allreduce(t, m) = a0 + a1*(t-1) + 2*(t-1)/t * m / B_link      (0 when t == 1)
    alltoall(e, m)  = a0 + a1*(e-1) + (e-1)/e * m / B_link        (0 when e == 1)

``W_expert_touched(b) = W_expert * (1 - (1 - top_k/n_experts)**b)`` is the expected share of
experts a batch activates. An attention-FFN split (AFD) replica keeps the KV cache and the
attention weights on ``afd_attn`` GPUs and the FFN on the other ``gpus - afd_attn``; the two
sides pipeline two micro-batches, so the step is the slower side plus the M2N hops.

Consequences, which the simulator and planner rely on: weights read per GPU shrink as
``1/tp`` but the per-layer collective grows with ``tp``, and a replica admits at most
``bs_max`` sequences (vLLM's ``max_num_seqs``) and as many KV tokens as its free HBM holds.
So under a large batch small TP wins tokens/s per GPU (more replicas, more concurrency, less
collective time), and in the tail, with a handful of long sequences, large TP wins per-token
latency.

Default constants (``HardwareSpec``, ``ModelSpec``): an H800/H100-SXM-class GPU (80 GB HBM at
3.35 TB/s, 989 TFLOP/s bf16, NVLink 300 GB/s effective, RDMA 50 GB/s between nodes,
PCIe/host 25 GB/s), eta_mem = 0.8, eta_flop = 0.5, c0 = 1 ms, c1 = 10 us per sequence,
a0 = 4 us, a1 = 1 us; a Qwen2.5-14B-shaped dense model (14.7 B parameters in bf16, 48 layers,
hidden 5120, 8 KV heads of 128). For it, at a 3 k-token mean context: TP1/2/4/8 sustain
about 2.5/3.1/2.9/2.2 k tokens/s per GPU when full, and a lone 10 k-context sequence decodes
at 12.7/7.3/4.6/3.5 ms per token.

A mode switch stalls a node for ``switch_fixed_s`` (engine restart, graph capture, NCCL
setup) plus the time to load its weight shard over the host link. Moving a sequence's KV
costs ``ctx*kv_bytes / B_net`` by transfer or a prefill of ``ctx`` tokens by recompute;
:func:`kv_move_cost` picks the cheaper one.

Invariants (asserted by tests): ``step_time`` is positive and non-decreasing in batch and in
KV tokens; at ``b = 1`` it is non-increasing in ``tp`` for the default constants; every
function is vectorised over numpy arrays and pure.
"""

from __future__ import annotations

from typing import Literal, final

import msgspec
import numpy as np
from numpy.typing import ArrayLike, NDArray

from flowrl.errors import ConfigError

__all__ = [
    "HardwareSpec",
    "ModelSpec",
    "ParallelMode",
    "kv_capacity_tokens",
    "kv_move_cost",
    "latency_per_token",
    "prefill_time",
    "saturated_concurrency",
    "saturated_token_rate",
    "step_time",
    "switch_time",
]

F64 = NDArray[np.float64]


@final
class HardwareSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU type and the links around it (SI units: bytes, seconds, FLOP/s)."""

    hbm_bytes: float = 80e9
    hbm_usable: float = 0.9
    hbm_bw: float = 3.35e12
    eta_mem: float = 0.8
    flops: float = 989e12
    eta_flop: float = 0.5
    link_bw: float = 300e9
    net_bw: float = 50e9
    host_bw: float = 25e9
    coll_a0: float = 4e-6
    coll_a1: float = 1e-6
    step_c0: float = 1e-3
    step_c1: float = 10e-6
    gpus_per_node: int = 8
    switch_fixed_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("hbm_bytes", "hbm_bw", "flops", "link_bw", "net_bw", "host_bw"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"HardwareSpec.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.hbm_usable <= 1 or not 0 < self.eta_mem <= 1 or not 0 < self.eta_flop <= 1:
            raise ConfigError("HardwareSpec fractions (hbm_usable, eta_*) must lie in (0, 1]")
        if self.gpus_per_node < 1:
            raise ConfigError(f"HardwareSpec.gpus_per_node must be >= 1, got {self.gpus_per_node}")


@final
class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the policy model; ``n_experts == 0`` means dense."""

    name: str = "dense-14b"
    params: float = 14.7e9
    layers: int = 48
    hidden: int = 5120
    n_heads: int = 40
    n_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    n_experts: int = 0
    top_k: int = 0
    expert_params: float = 0.0

    def __post_init__(self) -> None:
        if self.params <= 0 or self.layers < 1 or self.hidden < 1 or self.n_kv_heads < 1:
            raise ConfigError(f"ModelSpec {self.name!r}: sizes must be positive")
        if self.n_experts and not (0 < self.top_k <= self.n_experts):
            raise ConfigError(
                f"ModelSpec {self.name!r}: top_k must be in 1..n_experts={self.n_experts}, "
                f"got {self.top_k}"
            )
        if not 0 <= self.expert_params < self.params:
            raise ConfigError(f"ModelSpec {self.name!r}: expert_params must be in [0, params)")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def active_params(self) -> float:
        if not self.n_experts:
            return self.params
        return self.params - self.expert_params * (1.0 - self.top_k / self.n_experts)

    @property
    def attn_params(self) -> float:
        """Attention weights (the part that stays on attention GPUs under AFD)."""
        d_attn = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        return float(self.layers * self.hidden * (2 * d_attn + 2 * kv))


@final
class ParallelMode(msgspec.Struct, frozen=True, kw_only=True):
    """How one replica spreads the model over ``gpus`` GPUs of a node.

    ``tp`` shards dense/attention weights; ``ep`` shards experts (MoE only); ``afd_attn > 0``
    splits attention (on ``afd_attn`` GPUs, with the KV cache) from the FFN (the rest).
    """

    name: str
    gpus: int
    tp: int
    ep: int = 1
    afd_attn: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.ep < 1:
            raise ConfigError(f"ParallelMode {self.name!r}: gpus, tp, ep must be >= 1")
        if self.afd_attn:
            if not 0 < self.afd_attn < self.gpus:
                raise ConfigError(
                    f"ParallelMode {self.name!r}: afd_attn must be in 1..gpus-1={self.gpus - 1}"
                )
            if self.tp > self.afd_attn or self.ep > self.gpus - self.afd_attn:
                raise ConfigError(
                    f"ParallelMode {self.name!r}: tp must fit the attention GPUs, ep the FFN GPUs"
                )
        elif self.tp > self.gpus or self.ep > self.gpus:
            raise ConfigError(f"ParallelMode {self.name!r}: tp and ep must be <= gpus={self.gpus}")

    @staticmethod
    def tensor(tp: int) -> ParallelMode:
        return ParallelMode(name=f"tp{tp}", gpus=tp, tp=tp)


def _collective(kind: Literal["allreduce", "alltoall"], n: int, msg: F64, hw: HardwareSpec) -> F64:
    if n <= 1:
        return np.zeros_like(msg)
    share = 2.0 * (n - 1) / n if kind == "allreduce" else (n - 1) / n
    return hw.coll_a0 + hw.coll_a1 * (n - 1) + share * msg / hw.link_bw


def _weights_read(model: ModelSpec, batch: F64) -> tuple[float, F64]:
    """(dense bytes, expert bytes touched) read per iteration by the whole replica."""
    wb = model.dtype_bytes
    if not model.n_experts:
        return model.params * wb, np.zeros_like(batch)
    frac = 1.0 - (1.0 - model.top_k / model.n_experts) ** np.maximum(batch, 1.0)
    return (model.params - model.expert_params) * wb, model.expert_params * wb * frac


def step_time(
    mode: ParallelMode,
    batch: ArrayLike,
    kv_tokens: ArrayLike,
    model: ModelSpec,
    hw: HardwareSpec,
) -> F64:
    """Seconds per decode iteration of one replica (vectorised over ``batch``/``kv_tokens``)."""
    b = np.maximum(np.asarray(batch, dtype=np.float64), 1.0)
    k = np.maximum(np.asarray(kv_tokens, dtype=np.float64), 0.0)
    dense_b, expert_b = _weights_read(model, b)
    kv_b = k * model.kv_bytes_per_token
    msg = b * model.hidden * model.dtype_bytes
    bw = hw.hbm_bw * hw.eta_mem
    fl = hw.flops * hw.eta_flop
    attn_flops = 4.0 * model.layers * model.n_heads * model.head_dim * k
    dense_flops = 2.0 * model.active_params * b
    layers2 = 2.0 * model.layers
    if mode.afd_attn:
        a, f = mode.afd_attn, mode.gpus - mode.afd_attn
        attn_w = model.attn_params * model.dtype_bytes
        kv_shard = min(a, model.n_kv_heads)
        t_attn = np.maximum((attn_w / a + kv_b / kv_shard) / bw, attn_flops / (a * fl))
        ffn_dense = max(dense_b - attn_w, 0.0)
        t_ffn = np.maximum(
            (ffn_dense / min(f, mode.tp if mode.tp > 1 else f) + expert_b / f) / bw,
            dense_flops / (f * fl),
        )
        hop = hw.coll_a0 + msg / min(a, f) / hw.net_bw
        comm = layers2 * (_collective("allreduce", mode.tp, msg, hw) + hop)
        core = np.maximum(t_attn, t_ffn)
    else:
        kv_shard = min(mode.tp, model.n_kv_heads)
        mem = (dense_b / mode.tp + expert_b / mode.ep + kv_b / kv_shard) / bw
        comp = (dense_flops + attn_flops) / (mode.gpus * fl)
        core = np.maximum(mem, comp)
        comm = layers2 * (
            _collective("allreduce", mode.tp, msg, hw)
            + _collective("alltoall", mode.ep, msg * max(model.top_k, 1), hw)
        )
    return hw.step_c0 + hw.step_c1 * b + core + comm


def kv_capacity_tokens(mode: ParallelMode, model: ModelSpec, hw: HardwareSpec) -> int:
    """KV tokens one replica can hold: usable HBM of its KV-holding GPUs minus weights."""
    if mode.afd_attn:
        free = mode.afd_attn * hw.hbm_bytes * hw.hbm_usable - model.attn_params * model.dtype_bytes
    else:
        free = mode.gpus * hw.hbm_bytes * hw.hbm_usable - model.weight_bytes
    if free <= 0:
        raise ConfigError(
            f"mode {mode.name!r} cannot hold model {model.name!r}: weights "
            f"{model.weight_bytes / 1e9:.1f} GB exceed {mode.gpus} GPU(s) of usable HBM; "
            "use a larger tp"
        )
    return int(free // model.kv_bytes_per_token)


def saturated_concurrency(
    mode: ParallelMode, mean_ctx: float, bs_max: int, model: ModelSpec, hw: HardwareSpec
) -> int:
    """Sequences one replica runs when full: min(bs_max, KV capacity / mean context)."""
    cap = kv_capacity_tokens(mode, model, hw)
    return int(max(1, min(bs_max, cap // max(mean_ctx, 1.0))))


def saturated_token_rate(
    mode: ParallelMode, mean_ctx: float, bs_max: int, model: ModelSpec, hw: HardwareSpec
) -> float:
    """Tokens/s of one full replica at the given mean context."""
    b = saturated_concurrency(mode, mean_ctx, bs_max, model, hw)
    return float(b / step_time(mode, b, b * mean_ctx, model, hw))


def latency_per_token(
    mode: ParallelMode, ctx: ArrayLike, model: ModelSpec, hw: HardwareSpec
) -> F64:
    """Seconds per token of a lone sequence with ``ctx`` context tokens (tail regime)."""
    return step_time(mode, 1.0, ctx, model, hw)


def prefill_time(mode: ParallelMode, tokens: ArrayLike, model: ModelSpec, hw: HardwareSpec) -> F64:
    """Seconds to prefill ``tokens`` (compute-bound) on one replica of ``mode``."""
    t = np.asarray(tokens, dtype=np.float64)
    flops = (
        2.0 * model.active_params * t + 2.0 * model.layers * model.n_heads * model.head_dim * t**2
    )
    return flops / (mode.gpus * hw.flops * hw.eta_flop)


def kv_move_cost(
    ctx: ArrayLike,
    dst: ParallelMode,
    model: ModelSpec,
    hw: HardwareSpec,
    *,
    same_node: bool = False,
) -> tuple[NDArray[np.bool_], F64]:
    """Cheaper way to move sequences of ``ctx`` tokens: (use_transfer, seconds).

    Transfer ships the KV over NVLink (same node) or RDMA; recompute re-prefills the context
    on the destination.
    """
    c = np.asarray(ctx, dtype=np.float64)
    bw = hw.link_bw if same_node else hw.net_bw
    transfer = hw.coll_a0 * 100 + c * model.kv_bytes_per_token / bw
    recompute = prefill_time(dst, c, model, hw)
    use = transfer <= recompute
    return use, np.where(use, transfer, recompute)


def switch_time(mode: ParallelMode, model: ModelSpec, hw: HardwareSpec) -> float:
    """Seconds a node is down while it restarts its replicas in ``mode``."""
    shard = model.weight_bytes / max(mode.tp, 1)
    return hw.switch_fixed_s + shard / hw.host_bw

"""Rollout replica configurations (AReaL-Hex §4.2.2's ``psi``) and their cost per length class.

A replica is a pipeline of one or more stages; each stage is a TP group of ``tp`` GPUs within
one node of one pool, and stages may sit on different GPU types (``v_psi`` counts GPUs per
type, ``s_psi`` the TP degree per stage). Layers are split across stages in proportion to
each stage's HBM bandwidth (decode is bandwidth bound), in whole layers.

Cost of a replica for length class ``w`` (mean length ``l``, longest ``l_max``), from
:func:`~flowrl.sched.costmodel.step_time` on each stage's share of the model:

- it runs ``b = min(bs_max, KV capacity / (prompt + l/2))`` sequences (the KV capacity is the
  smallest over stages of free HBM over that stage's KV bytes per token), in ``S`` micro-
  batches of ``b/S`` that circulate through the ``S`` stages; its rate is ``(b/S) / max_s
  t_s`` tokens/s, ``t_s`` being stage ``s``'s step on one micro-batch plus the activation
  hop to the next stage over the network;
- ``seconds[w] = l / rate``: replica-seconds per rollout of the class;
- ``tail_s[w] = l_max * sum_s t_s(1 sequence at prompt + l_max/2)``: the longest response
  decoded alone, a floor on the makespan of any replica given the class (the straggler);
- a class whose longest response does not fit the KV capacity gets ``inf`` for both.

:func:`replica_configs` enumerates every multiset of stages up to ``max_stages`` and drops
a configuration that another dominates (no more GPUs of any type, no slower on any class,
no longer tail): such a replica can always be swapped for the dominating one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import final

import msgspec
import numpy as np

from flowrl.errors import ConfigError
from flowrl.sched._hex_spec import GpuPool, HexWorkload, LengthClass, length_classes
from flowrl.sched.costmodel import ModelSpec, ParallelMode, step_time

__all__ = ["TP_DEGREES", "ReplicaConfig", "replica_config", "replica_configs"]

TP_DEGREES = (1, 2, 4, 8)

Stage = tuple[int, int]  # (pool index, tp)


@final
@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """A rollout replica: ``stages`` as ``(pool, tp)`` holding ``layers`` layers each;
    ``gpus`` per pool; per length class ``seconds`` (replica-seconds per rollout) and
    ``tail_s`` (the class's longest response decoded alone), ``inf`` where it does not fit."""

    stages: tuple[Stage, ...]
    layers: tuple[int, ...]
    gpus: tuple[int, ...]
    seconds: tuple[float, ...]
    tail_s: tuple[float, ...]


def _split_layers(weights: list[float], layers: int) -> list[int] | None:
    """Whole layers in proportion to ``weights``, at least one each (largest remainder)."""
    if len(weights) > layers:
        return None
    raw = np.asarray(weights) / sum(weights) * layers
    out = np.maximum(np.floor(raw).astype(int), 1)
    while out.sum() > layers:
        out[np.argmax(out - raw)] -= 1
    while out.sum() < layers:
        out[np.argmax(raw - out)] += 1
    return [int(n) for n in out]


def _stage_model(model: ModelSpec, layers: int) -> ModelSpec:
    frac = layers / model.layers
    return msgspec.structs.replace(
        model, params=model.params * frac, expert_params=model.expert_params * frac, layers=layers
    )


def replica_config(
    stages: tuple[Stage, ...],
    pools: tuple[GpuPool, ...] | list[GpuPool],
    workload: HexWorkload,
    classes: tuple[LengthClass, ...] | None = None,
) -> ReplicaConfig | None:
    """The cost of one replica of ``stages`` (None: its weights do not fit)."""
    classes = classes if classes is not None else length_classes(workload)
    model = workload.model
    hws = [pools[p].hw for p, _ in stages]
    split = _split_layers(
        [tp * hw.hbm_bw for (_, tp), hw in zip(stages, hws, strict=True)], model.layers
    )
    if split is None:
        return None
    cap = np.inf
    for (_, tp), hw, n in zip(stages, hws, split, strict=True):
        frac = n / model.layers
        free = tp * hw.hbm_bytes * hw.hbm_usable - model.weight_bytes * frac
        if free <= 0:
            return None
        cap = min(cap, free / (model.kv_bytes_per_token * frac))
    mean = np.array([c.mean_length for c in classes])
    longest = np.array([c.max_length for c in classes])
    ctx = workload.prompt_tokens + mean / 2
    tail_ctx = workload.prompt_tokens + longest / 2
    conc = np.maximum(1.0, np.minimum(workload.bs_max, np.floor(cap / ctx)))
    micro = np.maximum(conc / len(stages), 1.0)
    slowest = np.zeros(len(classes))
    lone = np.zeros(len(classes))
    for s, ((_, tp), hw, n) in enumerate(zip(stages, hws, split, strict=True)):
        part = _stage_model(model, n)
        mode = ParallelMode.tensor(tp)
        t = step_time(mode, micro, micro * ctx, part, hw)
        t1 = step_time(mode, 1.0, tail_ctx, part, hw)
        if s + 1 < len(stages):  # activations to the next stage, over the slower network
            bw = min(hw.net_bw, hws[s + 1].net_bw)
            t = t + hw.coll_a0 + micro * model.hidden * model.dtype_bytes / bw
            t1 = t1 + hw.coll_a0 + model.hidden * model.dtype_bytes / bw
        slowest = np.maximum(slowest, t)
        lone = lone + t1
    fits = cap >= workload.prompt_tokens + longest
    seconds = np.where(fits, mean * slowest / micro, np.inf)
    tail = np.where(fits, longest * lone, np.inf)
    gpus = [0] * len(pools)
    for p, tp in stages:
        gpus[p] += tp
    return ReplicaConfig(
        stages=stages,
        layers=tuple(split),
        gpus=tuple(gpus),
        seconds=tuple(float(v) for v in seconds),
        tail_s=tuple(float(v) for v in tail),
    )


def _dominated(configs: list[ReplicaConfig]) -> np.ndarray:
    g = np.array([c.gpus for c in configs], dtype=np.float64)
    cost = np.hstack(
        [g, np.array([c.seconds for c in configs]), np.array([c.tail_s for c in configs])]
    )
    le = np.all(cost[:, None, :] <= cost[None, :, :], axis=2)  # le[a, b]: a no worse than b
    lt = np.any(cost[:, None, :] < cost[None, :, :], axis=2)
    first = np.triu(np.ones((len(configs),) * 2, dtype=bool), 1)  # equal twins: keep the first
    return np.any(le & (lt | first), axis=0)


def replica_configs(
    pools: tuple[GpuPool, ...] | list[GpuPool], workload: HexWorkload, *, max_stages: int = 2
) -> list[ReplicaConfig]:
    """Every undominated replica of up to ``max_stages`` in-node TP stages that holds the model
    and at least one length class."""
    if max_stages < 1:
        raise ConfigError(f"a replica needs max_stages >= 1 pipeline stages, got {max_stages}")
    classes = length_classes(workload)
    kinds = [
        (p, tp)
        for p, pool in enumerate(pools)
        if pool.count > 0
        for tp in TP_DEGREES
        if tp <= min(pool.hw.gpus_per_node, pool.count)
    ]
    found = []
    for n in range(1, max_stages + 1):
        for stages in itertools.combinations_with_replacement(kinds, n):
            if any(sum(tp for q, tp in stages if q == p) > pools[p].count for p, _ in stages):
                continue
            cfg = replica_config(stages, pools, workload, classes)
            if cfg is not None and np.isfinite(cfg.seconds).any():
                found.append(cfg)
    if not found:
        return []
    keep = ~_dominated(found)
    return [c for c, k in zip(found, keep, strict=True) if k]

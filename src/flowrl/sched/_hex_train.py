"""Training plans of AReaL-Hex §4.2.1, enumerated for every train/rollout split at once.

The paper's constrained search: TP and DP within one GPU type; each type hosts ``S_t``
pipeline stages of ``tp_t x dp`` GPUs, layers split in proportion to stage compute; memory
(bf16 weights and grads, fp32 Adam states sharded over DP) must fit; step time = 1F1B
``(M + S - 1)`` times the slowest stage's micro-batch time (compute + TP all-reduces) + the
DP gradient all-reduce. Training takes whole nodes of each pool (or the whole pool).

:func:`training_candidates` evaluates every ``(dp, tp_t, S_t)`` combination as numpy arrays
(one row per combination) instead of looping per split, and keeps per GPU vector the fastest
plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.sched._hex_replicas import TP_DEGREES
from flowrl.sched._hex_spec import GpuPool, HexWorkload

__all__ = ["TrainCandidates", "TrainPlan", "split_counts", "training_candidates"]


@final
@dataclass(frozen=True, slots=True)
class TrainPlan:
    """Per pool ``(tp, stages)`` (stages 0: pool not used), data-parallel degree ``dp``."""

    dp: int
    stages: tuple[tuple[int, int], ...]
    step_s: float


@final
@dataclass(frozen=True, slots=True)
class TrainCandidates:
    """The fastest plan per training GPU vector: ``gpus[k]`` per pool, ``step_s[k]``, its
    data-parallel degree ``dp[k]`` and per pool ``tp[k]`` and ``stages[k]``."""

    gpus: NDArray[np.int64]
    step_s: NDArray[np.float64]
    dp: NDArray[np.int64]
    tp: NDArray[np.int64]
    stages: NDArray[np.int64]

    def plan(self, k: int) -> TrainPlan:
        pairs = zip(self.tp[k], self.stages[k], strict=True)
        return TrainPlan(
            dp=int(self.dp[k]),
            stages=tuple((int(a), int(b)) for a, b in pairs),
            step_s=float(self.step_s[k]),
        )


def split_counts(pool: GpuPool) -> list[int]:
    """GPUs training may take from ``pool``: whole nodes, or all of it."""
    node = pool.hw.gpus_per_node
    return sorted({*range(0, pool.count + 1, node), pool.count})


def _options(pool: GpuPool, dp: int, only: int | None, layers: int) -> list[tuple[int, int, int]]:
    """``(gpus, tp, stages)`` one pool can give a plan of data-parallel degree ``dp``
    (``only``: with exactly that many GPUs)."""
    out = [(0, 0, 0)] if not only else []
    for g in split_counts(pool) if only is None else [only]:
        if g == 0 or g % dp:
            continue
        for tp in TP_DEGREES:
            if tp <= pool.hw.gpus_per_node and (g // dp) % tp == 0 and g // dp // tp <= layers:
                out.append((g, tp, g // dp // tp))
    return out


def training_candidates(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    workload: HexWorkload,
    only: tuple[int, ...] | None = None,
) -> TrainCandidates:
    """Every split's fastest training plan (splits with no plan that fits are absent);
    ``only``: just the split of exactly those GPUs per pool."""
    model = workload.model
    tokens = workload.rollouts * (workload.prompt_tokens + workload.mean_length)
    mbt = workload.microbatch_tokens
    msg = mbt * model.hidden * model.dtype_bytes
    rows: list[tuple[NDArray[np.int64], ...]] = []
    steps: list[NDArray[np.float64]] = []
    for dp in range(1, max(p.count for p in pools) + 1):
        opts = [
            np.array(
                _options(p, dp, None if only is None else only[t], model.layers), dtype=np.int64
            )
            for t, p in enumerate(pools)
        ]
        if any(len(o) == 0 for o in opts) or all(len(o) == 1 and not o[0, 0] for o in opts):
            continue
        idx = np.stack(np.meshgrid(*[np.arange(len(o)) for o in opts], indexing="ij"), -1)
        idx = idx.reshape(-1, len(pools))
        g, tp, st = (
            np.stack([opts[t][idx[:, t], j] for t in range(len(pools))], 1) for j in range(3)
        )
        n_stages = st.sum(1)
        ok = (n_stages > 0) & (n_stages <= model.layers)
        g, tp, st, n_stages = g[ok], tp[ok], st[ok], n_stages[ok]
        if not len(g):
            continue
        flops = np.array([p.hw.flops for p in pools]) * workload.train_eta
        power = tp * flops  # one stage's FLOP/s per type (0 where unused)
        share = power / (power * st).sum(1, keepdims=True)  # layer fraction on one stage
        used = st > 0
        params = model.params * share
        tpd = np.maximum(tp, 1)
        mem = params * (4.0 + 12.0 / dp) / tpd
        hbm = np.array([p.hw.hbm_bytes * p.hw.hbm_usable for p in pools])
        fits = np.all(~used | (mem <= hbm), axis=1)
        compute = mbt * workload.flops_per_token * share / np.where(used, power, 1.0)
        a0 = np.array([p.hw.coll_a0 for p in pools])
        link = np.array([p.hw.link_bw for p in pools])
        comm = np.where(
            tp > 1, 4 * model.layers * share * (a0 + 2 * (tpd - 1) / tpd * msg / link), 0.0
        )
        slow = np.where(used, compute + comm, 0.0).max(1)
        sync = np.zeros(len(g))
        if dp > 1:
            node = np.array([p.hw.gpus_per_node for p in pools])
            bw = np.where(tpd * dp <= node, link, np.array([p.hw.net_bw for p in pools]))
            sync = np.where(used, 2 * (dp - 1) / dp * params * 2 / tpd / bw, 0.0).max(1)
        mb = math.ceil(tokens / dp / mbt)
        step = (mb + n_stages - 1) * slow + sync
        rows.append((g[fits], tp[fits], st[fits], np.full(int(fits.sum()), dp)))
        steps.append(step[fits])
    if not rows:
        none = np.zeros((0, len(pools)), dtype=np.int64)
        return TrainCandidates(none, np.zeros(0), np.zeros(0, dtype=np.int64), none, none)
    g, tp, st, dps = (np.concatenate([r[j] for r in rows]) for j in range(4))
    step = np.concatenate(steps)
    # the fastest plan per GPU vector: sort by (vector, step), keep each vector's first
    order = np.lexsort((step, *g.T[::-1]))
    g, tp, st, dps, step = g[order], tp[order], st[order], dps[order], step[order]
    first = np.ones(len(g), dtype=bool)
    first[1:] = np.any(g[1:] != g[:-1], axis=1)
    return TrainCandidates(g[first], step[first], dps[first], tp[first], st[first])

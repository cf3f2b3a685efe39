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

import functools
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


def _combine(op: np.ufunc, per_type: list[NDArray[np.float64]]) -> NDArray[np.float64]:
    """Per-type option arrays ``(G_t, tp)`` combined by ``op``, one axis pair per type."""
    return functools.reduce(lambda acc, new: op(acc[..., None, None], new), per_type)


def training_candidates(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    workload: HexWorkload,
    only: tuple[int, ...] | None = None,
) -> TrainCandidates:
    """Every split's fastest training plan (splits with no plan that fits are absent);
    ``only``: just the split of exactly those GPUs per pool.

    With ``P = sum_t F_t * g_t / dp`` (training FLOP/s: it does not depend on the TP
    degrees), layers in proportion to stage compute make every term a per-type quantity over
    ``P``: compute ``tokens * flops / P``, type ``t``'s TP all-reduces ``4 L tp F_t c_t(tp) /
    P``, its share of the DP all-reduce ``4 (dp-1)/dp * params * F_t / bw_t / P``, and its
    memory fits when ``P >= params * F_t * (4 + 12/dp) / hbm_t``. So each type's options are
    computed once per ``dp`` and combined across types by broadcasting (sums for stages and
    ``P``, maxima for the rest), one axis pair (GPUs, TP) per type; the fastest TP choice per
    GPU vector is a minimum over the TP axes.
    """
    model = workload.model
    tokens = workload.rollouts * (workload.prompt_tokens + workload.mean_length)
    mbt = workload.microbatch_tokens
    msg = mbt * model.hidden * model.dtype_bytes
    tps = np.array(TP_DEGREES, dtype=np.float64)
    grids = [
        np.array(split_counts(p) if only is None else [only[t]], dtype=np.int64)
        for t, p in enumerate(pools)
    ]
    shape = tuple(len(g) for g in grids)
    best = np.full(shape, np.inf)
    best_dp = np.zeros(shape, dtype=np.int64)
    best_tp = np.zeros(shape, dtype=np.int64)  # TP choices, base len(TP_DEGREES), type 0 first
    for dp in range(1, max(p.count for p in pools) + 1):
        picks = [np.flatnonzero(g % dp == 0) for g in grids]
        if any(len(k) == 0 for k in picks) or not any(
            np.any(grids[t][k] > 0) for t, k in enumerate(picks)
        ):
            continue
        parts: list[tuple[NDArray[np.float64], ...]] = []
        for t, pool in enumerate(pools):
            hw = pool.hw
            g = grids[t][picks[t]].astype(np.float64)[:, None]
            f = hw.flops * workload.train_eta
            used = g > 0
            per_rank = g / dp
            stages = per_rank / tps
            ok = np.where(
                used,
                (per_rank % tps == 0) & (tps <= hw.gpus_per_node) & (stages <= model.layers),
                tps == tps[0],  # an unused type: one option
            )
            coll = hw.coll_a0 + 2 * (tps - 1) / tps * msg / hw.link_bw
            bw = np.where(tps * dp <= hw.gpus_per_node, hw.link_bw, hw.net_bw)
            mem = model.params * f * (4 + 12 / dp) / (hw.hbm_bytes * hw.hbm_usable)
            parts.append(
                (
                    np.where(used, stages, 0.0),  # pipeline stages
                    f * g / dp + np.zeros_like(stages),  # training FLOP/s
                    np.where(used & (tps > 1), 4 * model.layers * tps * f * coll, 0.0),
                    np.where(used, f / bw, 0.0),  # DP all-reduce time x P / share
                    np.where(used, mem, 0.0),  # the P that fits the memory
                    ok.astype(np.float64),
                )
            )
        n, p_sum = _combine(np.add, [q[0] for q in parts]), _combine(np.add, [q[1] for q in parts])
        alpha, sigma, need, valid = (
            _combine(np.minimum if j == 5 else np.maximum, [q[j] for q in parts])
            for j in range(2, 6)
        )
        fits = (valid > 0) & (n > 0) & (n <= model.layers) & (p_sum >= need)
        mb = math.ceil(tokens / dp / mbt)
        safe = np.where(fits, p_sum, 1.0)
        step = (mb + n - 1) * (mbt * workload.flops_per_token + alpha) / safe
        step = np.where(fits, step + 4 * (dp - 1) / dp * model.params * sigma / safe, np.inf)
        axes = len(pools)
        step = step.transpose([*range(0, 2 * axes, 2), *range(1, 2 * axes, 2)])
        step = step.reshape(*[len(k) for k in picks], -1)
        choice = step.argmin(-1)
        fastest = np.take_along_axis(step, choice[..., None], -1)[..., 0]
        at = np.ix_(*picks)
        better = fastest < best[at]
        best[at] = np.where(better, fastest, best[at])
        best_dp[at] = np.where(better, dp, best_dp[at])
        best_tp[at] = np.where(better, choice, best_tp[at])
    found = np.argwhere(np.isfinite(best))
    gpus = np.stack([grids[t][found[:, t]] for t in range(len(pools))], 1).reshape(-1, len(pools))
    keep = gpus.sum(1) > 0
    found, gpus = found[keep], gpus[keep]
    idx = tuple(found.T)
    digits = np.stack(
        [
            best_tp[idx] // len(TP_DEGREES) ** (len(pools) - 1 - t) % len(TP_DEGREES)
            for t in range(len(pools))
        ],
        1,
    ).reshape(-1, len(pools))
    dps = best_dp[idx]
    tp = np.where(gpus > 0, np.array(TP_DEGREES)[digits], 0)
    stages = (gpus // np.maximum(dps[:, None] * tp, 1)).astype(np.int64)  # 0 where unused
    return TrainCandidates(gpus, best[idx], dps, tp, stages)

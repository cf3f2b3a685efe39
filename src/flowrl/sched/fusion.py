"""Inter-stage fusion (RLHFuse §4): migrate a step's long tail, lend the freed GPUs onward.

When fewer than ``R_t`` requests of a step remain, they are consolidated onto ``m``
replicas and the other replicas start the next stage (reference / reward inference) on
the samples already finished, overlapping the tail.

- :func:`consolidation_size` — ``m = max(ceil(R / bs_max), ceil(kv_demand / kv_capacity))``:
  enough replicas that the tail still runs at full batch and its KV fits. RLHFuse sizes KV
  with the longest possible sample (``R * M / C``); we pass the tail's expected KV demand
  (``sum(context + E[remaining])`` from the forecaster), which is less wasteful; a caller
  wanting the paper's bound passes ``R * max_footprint``.
  RLHFuse's ``BS_max`` assumes decode latency is flat up to the saturating batch; that holds
  for short contexts but not for a long-context tail, whose KV reads grow with the batch.
  :func:`flat_batch` gives the largest batch whose step time stays within ``1 + slack`` of a
  lone sequence's at the tail's context; callers pass ``min(bs_max, flat_batch)``.
- :func:`select_targets` — the ``m`` units holding the most remaining requests (fewest moves).
- :func:`choose_threshold` — simulates, on a sample of the forecast length distribution,
  the generation wave of one representative replica (continuous batching with the
  :mod:`~flowrl.sched.costmodel` step time), and for every candidate ``R_t`` the consolidated
  tail plus the next stage on freed and then all GPUs; returns the ``R_t`` with the smallest
  predicted end of the next stage (``R_t = 0`` is "no fusion", so fusion is chosen only
  when predicted to help).

Invariants (asserted by tests): ``consolidation_size`` is within ``[1, n_units]`` and
non-decreasing in ``R``; ``select_targets`` returns ``m`` distinct units holding at least as
many requests as any unit left out; ``choose_threshold``'s prediction for its choice is
never worse than its prediction for ``R_t = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import msgspec
import numpy as np
from numpy.typing import ArrayLike, NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    kv_capacity_tokens,
    step_time,
)

__all__ = [
    "FusionConfig",
    "ThresholdChoice",
    "choose_threshold",
    "consolidation_size",
    "flat_batch",
    "select_targets",
]

F64 = NDArray[np.float64]


@final
class FusionConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Candidate thresholds (fractions of the step's requests) and the next stage's cost."""

    fractions: tuple[float, ...] = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2)
    infer_flops_per_token: float = 2 * 14.7e9
    infer_eta: float = 0.5
    setup_s: float = 3.0
    bs_max: int = 256
    slack: float = 0.25

    def __post_init__(self) -> None:
        if not self.fractions or any(not 0 <= f < 1 for f in self.fractions):
            raise ConfigError(f"FusionConfig.fractions must lie in [0, 1), got {self.fractions}")
        if self.infer_flops_per_token <= 0 or not 0 < self.infer_eta <= 1:
            raise ConfigError("FusionConfig needs infer_flops_per_token > 0, 0 < infer_eta <= 1")
        if self.setup_s < 0 or self.bs_max < 1:
            raise ConfigError("FusionConfig needs setup_s >= 0 and bs_max >= 1")


@final
@dataclass(frozen=True, slots=True)
class ThresholdChoice:
    threshold: int
    fraction: float
    predicted_end: float
    predicted_serial_end: float
    fractions: tuple[float, ...]
    predicted: tuple[float, ...]


def consolidation_size(
    remaining: int, kv_demand: float, bs_max: int, kv_capacity: float, n_units: int
) -> int:
    """Replicas needed to run ``remaining`` requests at full batch within KV capacity."""
    if remaining <= 0:
        return 1
    m = max(math.ceil(remaining / bs_max), math.ceil(kv_demand / max(kv_capacity, 1.0)), 1)
    return int(min(m, n_units))


def flat_batch(
    mode: ParallelMode, ctx: float, bs_max: int, model: ModelSpec, hw: HardwareSpec, slack: float
) -> int:
    """Largest batch (<= bs_max) of ``ctx``-token sequences with step <= (1+slack) * step(1)."""
    b = np.arange(1, bs_max + 1, dtype=np.float64)
    t = step_time(mode, b, b * max(ctx, 1.0), model, hw)
    return int(np.nonzero(t <= (1.0 + slack) * t[0])[0][-1] + 1)


def select_targets(remaining_per_unit: ArrayLike, m: int) -> NDArray[np.int64]:
    """Indices of the ``m`` units with the most remaining requests (ties: lower index)."""
    r = np.asarray(remaining_per_unit)
    return np.sort(np.argsort(-r, kind="stable")[: max(0, min(m, len(r)))]).astype(np.int64)


def _wave(
    lengths: F64,
    prompts: F64,
    mode: ParallelMode,
    bs_max: int,
    model: ModelSpec,
    hw: HardwareSpec,
    marks: list[int],
) -> tuple[float, dict[int, tuple[float, F64, F64]]]:
    """Continuous batching on one replica; state at each remaining-count mark."""
    cap = kv_capacity_tokens(mode, model, hw)
    n = len(lengths)
    gen = np.zeros(n)
    done = np.zeros(n, dtype=bool)
    running = np.zeros(n, dtype=bool)
    nxt = 0
    t = 0.0
    out: dict[int, tuple[float, F64, F64]] = {}
    pending = sorted(set(marks), reverse=True)
    while True:
        kv = float((prompts[running] + gen[running]).sum())
        while nxt < n and running.sum() < bs_max and kv + prompts[nxt] <= cap:
            running[nxt] = True
            kv += prompts[nxt]
            nxt += 1
        left = n - int(done.sum())
        while pending and left <= pending[0]:
            alive = ~done
            out[pending.pop(0)] = (t, lengths[alive] - gen[alive], prompts[alive] + gen[alive])
        if left == 0:
            return t, out
        idx = np.nonzero(running)[0]
        rem = lengths[idx] - gen[idx]
        k = float(rem.min())
        b = len(idx)
        t += k * float(step_time(mode, b, kv + b * k / 2, model, hw))
        gen[idx] += k
        fin = idx[rem <= k]
        done[fin] = True
        running[fin] = False


def _tail_time(rem: F64, ctx: F64, mode: ParallelMode, model: ModelSpec, hw: HardwareSpec) -> float:
    """All ``rem`` running together on one replica until the last finishes."""
    if not len(rem):
        return 0.0
    o = np.argsort(rem)
    r, c = rem[o], ctx[o]
    d = np.diff(np.r_[0.0, r])
    b = len(r) - np.arange(len(r))
    ctx_alive = np.cumsum(c[::-1])[::-1]
    kv = ctx_alive + b * (np.r_[0.0, r[:-1]] + d / 2)
    return float((d * step_time(mode, b, kv, model, hw)).sum())


def choose_threshold(
    lengths: ArrayLike,
    prompts: ArrayLike,
    *,
    n_replicas: int,
    mode: ParallelMode,
    total_gpus: int,
    model: ModelSpec,
    hw: HardwareSpec,
    config: FusionConfig,
    unit_replicas: int = 1,
) -> ThresholdChoice:
    """Pick ``R_t`` by simulating each candidate on a forecast sample (module docstring).

    Consolidation keeps whole units of ``unit_replicas`` replicas (e.g. a node), as the
    simulator does; the other units' GPUs go to the next stage.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    proms = np.asarray(prompts, dtype=np.float64)
    if len(lens) != len(proms) or not len(lens):
        raise ConfigError("choose_threshold needs equally long, non-empty lengths and prompts")
    if n_replicas < 1:
        raise ConfigError(f"n_replicas must be >= 1, got {n_replicas}")
    n_total = len(lens)
    per = max(1, n_total // n_replicas)
    group_l, group_p = lens[:per], proms[:per]
    marks = sorted({round(f * n_total / n_replicas) for f in config.fractions if f > 0})
    gen_end, states = _wave(group_l, group_p, mode, config.bs_max, model, hw, marks)
    rate = hw.flops * config.infer_eta / config.infer_flops_per_token  # tokens/s per GPU
    work = float((lens + proms).sum())
    serial = gen_end + config.setup_s + work / (rate * total_gpus)
    cap = kv_capacity_tokens(mode, model, hw)
    results = []
    for f in config.fractions:
        mark = round(f * n_total / n_replicas)
        if f == 0 or mark not in states:
            results.append(serial)
            continue
        t_r, rem, ctx = states[mark]
        if not len(rem):
            results.append(serial)
            continue
        r_tot = len(rem) * n_replicas
        demand = float((ctx + rem).sum()) * n_replicas
        units = max(1, n_replicas // unit_replicas)
        bs = flat_batch(mode, float(np.mean(ctx + rem)), config.bs_max, model, hw, config.slack)
        mu = consolidation_size(r_tot, demand, bs * unit_replicas, cap * unit_replicas, units)
        m = mu * unit_replicas
        per_m = max(1, math.ceil(r_tot / m))
        reps = np.resize(np.arange(len(rem)), per_m)
        move = float(ctx.max(initial=0.0)) * model.kv_bytes_per_token / hw.net_bw
        end = t_r + move + _tail_time(rem[reps], ctx[reps], mode, model, hw)
        freed = total_gpus - m * mode.gpus
        tail_work = float((ctx + rem).sum()) * n_replicas
        early = min(work - tail_work, rate * freed * max(0.0, end - t_r - config.setup_s))
        results.append(end + (work - early) / (rate * total_gpus))
    i = int(np.argmin(results))
    f = config.fractions[i]
    return ThresholdChoice(
        threshold=round(f * n_total),
        fraction=f,
        predicted_end=results[i],
        predicted_serial_end=serial,
        fractions=config.fractions,
        predicted=tuple(results),
    )

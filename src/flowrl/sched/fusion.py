"""Inter-stage fusion (RLHFuse §4): migrate a step's long tail, lend the freed GPUs onward.

When at most ``R_t`` requests of a step remain, they are consolidated onto ``m`` units
(nodes) and the other units start the next stage (reference / reward inference) on the
samples already finished, overlapping the tail.

- :func:`consolidation_size` — RLHFuse's lower bound on ``m``:
  ``max(ceil(R / bs_max), ceil(kv_demand / kv_capacity))``, enough units that the tail still
  runs at full batch and its KV fits. We pass the tail's expected KV demand
  (``sum(context + E[remaining])`` from the forecaster), which is less wasteful than
  RLHFuse's longest-sample bound ``R * M / C``.
- :func:`select_targets` — the ``m`` units holding the most remaining requests (fewest moves).
- :func:`choose_threshold` — simulates candidates on the forecast distribution: given a
  sample of the pending requests' remaining lengths (drawn from the forecaster's conditional
  distribution) and their contexts, it runs the rest of the wave on one representative
  replica (continuous batching with the :mod:`~flowrl.sched.costmodel` step time) and, for
  every candidate ``R_t`` and every ``m`` from the lower bound up to all units, the
  consolidated tail plus the next stage on the freed and then all GPUs. It returns the
  ``(R_t, m)`` with the earliest predicted end of the next stage; ``R_t = 0`` is "no fusion",
  so fusion is chosen only when predicted to help. RLHFuse's ``BS_max`` rule assumes decode
  latency is flat up to a saturating batch; a long-context tail is KV-read bound instead, so
  ``m`` is chosen by the same simulation rather than by that rule alone. Callers re-run it as
  the wave progresses ("we refine the distribution by incorporating new generation
  samples, which allows us to update R_t as needed").

Invariants (asserted by tests): ``consolidation_size`` is within ``[1, n_units]`` and
non-decreasing in ``R``; ``select_targets`` returns ``m`` distinct units holding at least as
many requests as any unit left out; ``choose_threshold``'s prediction for its choice is
never worse than its prediction for ``R_t = 0``, and its ``units`` lie in
``[consolidation_size(R_t, ...), n_units]``.
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
    """``threshold`` requests (``fraction`` of the step) onto ``units`` units; ``predicted``
    holds the best predicted next-stage end per candidate fraction (seconds from now)."""

    threshold: int
    fraction: float
    units: int
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


def _unit_options(lowest: int, n_units: int) -> list[int]:
    """Every count from ``lowest`` to ``n_units`` when few, else a geometric ladder."""
    if n_units - lowest <= 16:
        return list(range(lowest, n_units + 1))
    ladder = np.unique(np.round(lowest * 1.5 ** np.arange(64)).astype(np.int64))
    return [int(m) for m in ladder if m < n_units] + [n_units]


def choose_threshold(
    remaining: ArrayLike,
    context: ArrayLike,
    *,
    total: int,
    next_tokens: float,
    n_units: int,
    unit_replicas: int,
    mode: ParallelMode,
    model: ModelSpec,
    hw: HardwareSpec,
    config: FusionConfig,
) -> ThresholdChoice:
    """Pick ``(R_t, m)`` by simulating each candidate from now on (module docstring).

    ``remaining``/``context``: a forecast sample of the pending requests' remaining lengths
    and their current contexts; ``total`` the step's requests (candidates are
    ``config.fractions`` of it); ``next_tokens`` the tokens the next stage processes for the
    whole step; the generation cluster is ``n_units`` units of ``unit_replicas`` replicas of
    ``mode``. Times in the result are seconds from now.
    """
    rem = np.maximum(np.asarray(remaining, dtype=np.float64), 1.0)
    ctx = np.asarray(context, dtype=np.float64)
    if len(rem) != len(ctx) or not len(rem):
        raise ConfigError("choose_threshold needs equally long, non-empty remaining and context")
    if n_units < 1 or unit_replicas < 1 or total < len(rem):
        raise ConfigError(
            f"choose_threshold needs n_units, unit_replicas >= 1 and total >= pending, got "
            f"{n_units}, {unit_replicas}, {total} (pending {len(rem)})"
        )
    n_rep = n_units * unit_replicas
    marks = {f: round(f * total / n_rep) for f in config.fractions if f > 0}
    gen_end, states = _wave(
        rem[::n_rep], ctx[::n_rep], mode, config.bs_max, model, hw, sorted(set(marks.values()))
    )
    rate = hw.flops * config.infer_eta / config.infer_flops_per_token  # tokens/s per GPU
    gpus = n_units * unit_replicas * mode.gpus
    serial = gen_end + config.setup_s + next_tokens / (rate * gpus)
    cap = kv_capacity_tokens(mode, model, hw) * unit_replicas
    results: list[tuple[float, int]] = []
    for f in config.fractions:
        t_r, left, held = states.get(marks.get(f, -1), (0.0, rem[:0], ctx[:0]))
        if f == 0 or not len(left):
            results.append((serial, n_units))
            continue
        r_tot = len(left) * n_rep
        lowest = consolidation_size(
            r_tot, float((held + left).sum()) * n_rep, config.bs_max * unit_replicas, cap, n_units
        )
        move = float(held.max(initial=0.0)) * model.kv_bytes_per_token / hw.net_bw
        tail_work = float((held + left).sum()) * n_rep
        best = (serial, n_units)
        for m in _unit_options(lowest, n_units):
            per = max(1, math.ceil(r_tot / (m * unit_replicas)))
            pick = np.resize(np.arange(len(left)), per)
            end = t_r + move + _tail_time(left[pick], held[pick], mode, model, hw)
            freed = gpus - m * unit_replicas * mode.gpus
            early = min(
                next_tokens - tail_work, rate * freed * max(0.0, end - t_r - config.setup_s)
            )
            best = min(best, (end + (next_tokens - early) / (rate * gpus), m))
        results.append(best)
    i = min(range(len(results)), key=lambda j: results[j][0])
    f = config.fractions[i]
    return ThresholdChoice(
        threshold=round(f * total),
        fraction=f,
        units=results[i][1],
        predicted_end=results[i][0],
        predicted_serial_end=serial,
        fractions=config.fractions,
        predicted=tuple(r[0] for r in results),
    )

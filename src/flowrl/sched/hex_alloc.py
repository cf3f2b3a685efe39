"""Heterogeneous GPU allocation for asynchronous RL (AReaL-Hex §4): who trains, who rolls out.

Given GPU pools (a :class:`~flowrl.sched.costmodel.HardwareSpec`, a count and a price each)
and a workload (model, rollouts per step, prompt length, a sample of response lengths), choose
which GPUs train and which generate, the rollout replicas, the rollouts of each length class
each replica configuration takes, and the training parallelism, so that the asynchronous step
``max(C_T, C_I)`` is shortest (all GPUs are paid for, so this also maximises throughput per
dollar). ``C_I`` is generation's makespan plus reward and weight sync.

The model (the paper's, without its mean-length shortcut):

- length classes (:func:`length_classes`): the profiled lengths cut into classes, each with
  its share of the rollouts, mean and longest length;
- replica configurations (:func:`replica_configs`): pipelines of up to ``max_stages`` TP
  groups, each within a node of one GPU type, types mixed across stages; a rate per class
  and the straggler time of each class's longest response (``_hex_replicas``);
- training plans per split (whole nodes per pool), the paper's constrained search
  (``_hex_train``);
- generation: a replica count ``y`` per configuration and rollouts ``x[psi, w]`` per class,
  a configuration's load ``sum_w x * seconds <= y * Theta``, GPUs per type shared with
  training, and ``Theta >=`` the tail of every (configuration, class) pair in use
  (``stragglers=False`` drops this).

:func:`allocate` (``method="exact"``) solves the whole model — split, training plan, replicas,
assignment — as MILPs at breakpoints of the step time (``_hex_milp``): exact up to HiGHS's
1e-6 relative gap. ``method="bisect"`` is the paper's repartition phase: a binary search on
the training share of compute, each share picking the split that maximises eq. 3 (training's
share of interconnect bandwidth + generation's share of HBM bandwidth), each split then
planned exactly.

Invariants (asserted by tests, against an exact MILP written separately in the tests): the
plan's step equals the model's optimum; every plan respects the GPU counts per type; its
assignment covers every class; the predicted makespan equals the plan's true one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, final

import numpy as np

from flowrl.errors import ConfigError
from flowrl.sched import _hex_milp
from flowrl.sched._hex_replicas import ReplicaConfig, replica_config, replica_configs
from flowrl.sched._hex_spec import GpuPool, HexWorkload, LengthClass, length_classes
from flowrl.sched._hex_train import TrainPlan, training_candidates

__all__ = [
    "GpuPool",
    "HexPlan",
    "HexWorkload",
    "LengthClass",
    "ReplicaConfig",
    "RolloutPlan",
    "TrainPlan",
    "allocate",
    "length_classes",
    "replica_config",
    "replica_configs",
    "search_training",
    "solve_rollout",
]

Pools = tuple[GpuPool, ...] | list[GpuPool]


@final
@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """``replicas[j]`` of ``configs[j]``; ``assigned[j][w]`` rollouts of ``classes[w]`` to
    them; ``makespan`` of generation alone (tails included)."""

    configs: tuple[ReplicaConfig, ...]
    replicas: tuple[int, ...]
    assigned: tuple[tuple[float, ...], ...]
    classes: tuple[LengthClass, ...]
    makespan: float


@final
@dataclass(frozen=True, slots=True)
class HexPlan:
    train_gpus: tuple[int, ...]
    rollout_gpus: tuple[int, ...]
    train: TrainPlan
    rollout: RolloutPlan
    step_s: float
    train_s: float
    rollout_s: float
    tokens_per_s: float
    cost_per_hour: float
    tokens_per_dollar: float
    evaluated: int  # LPs and MILPs solved


def _check_pools(pools: Pools, counts: tuple[int, ...]) -> None:
    if len(counts) != len(pools):
        raise ConfigError(f"expected one GPU count per pool ({len(pools)}), got {len(counts)}")
    for p, c in zip(pools, counts, strict=True):
        if not 0 <= c <= p.count:
            raise ConfigError(f"pool {p.name!r} has {p.count} GPUs, asked for {c}")


def _instance(
    configs: list[ReplicaConfig],
    classes: tuple[LengthClass, ...],
    counts: tuple[int, ...],
    train_gpus: np.ndarray,
    train_s: np.ndarray,
    fixed_s: float,
    stragglers: bool,
) -> _hex_milp.Instance:
    seconds = np.array([c.seconds for c in configs])
    tail = np.array([c.tail_s for c in configs])
    if not stragglers:
        tail = np.where(np.isfinite(tail), 0.0, tail)
    return _hex_milp.Instance(
        seconds=seconds,
        tail=tail,
        config_gpus=np.array([c.gpus for c in configs], dtype=np.int64),
        demand=np.array([c.rollouts for c in classes]),
        train_gpus=train_gpus,
        train_s=train_s,
        counts=np.array(counts, dtype=np.int64),
        fixed_s=fixed_s,
    )


def _rollout_plan(
    configs: list[ReplicaConfig], classes: tuple[LengthClass, ...], sol: _hex_milp.Solution
) -> RolloutPlan:
    used = [j for j, n in enumerate(sol.replicas) if n > 0]
    return RolloutPlan(
        configs=tuple(configs[j] for j in used),
        replicas=tuple(int(sol.replicas[j]) for j in used),
        assigned=tuple(tuple(float(v) for v in sol.assigned[j]) for j in used),
        classes=classes,
        makespan=sol.makespan,
    )


def solve_rollout(
    pools: Pools,
    counts: tuple[int, ...],
    workload: HexWorkload,
    *,
    stragglers: bool = True,
    max_stages: int = 2,
) -> RolloutPlan:
    """The fastest generation plan on ``counts[t]`` GPUs of each pool (exact)."""
    _check_pools(pools, counts)
    configs = replica_configs(pools, workload, max_stages=max_stages)
    have = {p.name: c for p, c in zip(pools, counts, strict=True)}
    usable = [c for c in configs if all(g <= n for g, n in zip(c.gpus, counts, strict=True))]
    if not usable:
        raise ConfigError(
            f"no rollout replica of {workload.model.name!r} fits the GPUs {have}; "
            "give generation more or larger GPUs"
        )
    classes = length_classes(workload)
    zero = np.zeros((1, len(pools)), dtype=np.int64)
    inst = _instance(usable, classes, counts, zero, np.zeros(1), 0.0, stragglers)
    try:
        sol = _hex_milp.solve(inst)
    except ConfigError:
        raise ConfigError(
            f"the GPUs {have} cannot generate every length class of the workload "
            "(the longest responses do not fit any replica's KV cache)"
        ) from None
    return _rollout_plan(usable, classes, sol)


def search_training(
    pools: Pools, counts: tuple[int, ...], workload: HexWorkload
) -> TrainPlan | None:
    """Fastest training plan using exactly ``counts`` GPUs per pool (None: none fits)."""
    _check_pools(pools, counts)
    cands = training_candidates(pools, workload, only=counts)
    return cands.plan(0) if len(cands.gpus) else None


def _interconnect(pools: Pools, counts: tuple[int, ...]) -> float:
    """Aggregate bandwidth among ``counts`` GPUs: NVLink within nodes, network across."""
    total = 0.0
    for p, n in zip(pools, counts, strict=True):
        node = p.hw.gpus_per_node
        full, rest = divmod(n, node)
        within = full * node * (node - 1) + rest * (rest - 1)
        total += within * p.hw.link_bw + (n * (n - 1) - within) * p.hw.net_bw
    n_all = sum(counts)
    cross = n_all * (n_all - 1) - sum(n * (n - 1) for n in counts)
    net = min((p.hw.net_bw for p in pools), default=0.0)
    return total + cross * net


def _bisect_search(
    pools: Pools,
    gpus: np.ndarray,
    train_s: np.ndarray,
    fixed_s: float,
    rounds: int,
    solve: Callable[[np.ndarray], _hex_milp.Solution],
) -> tuple[_hex_milp.Solution, int]:
    """The paper's repartition phase over the splits ``gpus`` (rows: training GPUs per pool)."""
    counts = np.array([p.count for p in pools])
    flops = np.array([p.hw.flops for p in pools])
    hbm = np.array([p.hw.hbm_bw for p in pools])
    frac = gpus @ flops / (counts @ flops)
    link_total = _interconnect(pools, tuple(int(n) for n in counts))
    metric = np.array(
        [_interconnect(pools, tuple(int(n) for n in g)) / link_total for g in gpus]
    ) + (counts - gpus) @ hbm / (counts @ hbm)
    q, r = 0.0, 1.0
    seen: dict[int, _hex_milp.Solution | None] = {}
    best: _hex_milp.Solution | None = None
    evaluated = 0
    for _ in range(rounds):
        gamma = (q + r) / 2
        gap = np.abs(frac - gamma)
        band = np.flatnonzero(gap <= gap.min() + 1e-12)
        k = int(band[np.argmax(metric[band])])
        if k not in seen:
            try:
                found = solve(np.array([k]))
            except ConfigError:  # the split leaves generation nothing that fits
                found = None
            seen[k] = found
            evaluated += found.probes if found else 0
        sol = seen[k]
        if sol is None:
            r = gamma
            continue
        if best is None or sol.step_s < best.step_s:
            best = sol
        if train_s[k] < sol.makespan + fixed_s:  # training waits: give it less
            r = gamma
        else:
            q = gamma
    if best is None:
        raise ConfigError("no split gives both training and generation a plan that fits")
    return best, evaluated


def _hex_plan(
    pools: Pools,
    workload: HexWorkload,
    train_gpus: np.ndarray,
    train: TrainPlan,
    rollout: RolloutPlan,
    step_s: float,
    evaluated: int,
) -> HexPlan:
    price = sum(p.count * p.price_per_hour for p in pools)
    tps = workload.rollouts * workload.mean_length / step_s
    return HexPlan(
        train_gpus=tuple(int(n) for n in train_gpus),
        rollout_gpus=tuple(p.count - int(n) for p, n in zip(pools, train_gpus, strict=True)),
        train=train,
        rollout=rollout,
        step_s=step_s,
        train_s=train.step_s,
        rollout_s=rollout.makespan + workload.fixed_s,
        tokens_per_s=tps,
        cost_per_hour=price,
        tokens_per_dollar=tps * 3600 / price if price > 0 else math.inf,
        evaluated=evaluated,
    )


def allocate(
    pools: Pools,
    workload: HexWorkload,
    *,
    method: Literal["exact", "bisect"] = "exact",
    rounds: int = 12,
    stragglers: bool = True,
    max_stages: int = 2,
) -> HexPlan:
    """The split, training plan and rollout plan with the shortest asynchronous step."""
    if method not in ("exact", "bisect"):
        raise ConfigError(f"allocate method must be 'exact' or 'bisect', got {method!r}")
    if not pools or sum(p.count for p in pools) < 2:
        raise ConfigError("allocate needs at least two GPUs in its pools")
    configs = replica_configs(pools, workload, max_stages=max_stages)
    if not configs:
        raise ConfigError(f"no GPU type can hold a rollout replica of {workload.model.name!r}")
    cands = training_candidates(pools, workload)
    if not len(cands.gpus):
        raise ConfigError("no train/rollout split fits the model's training memory")
    classes = length_classes(workload)
    counts = tuple(p.count for p in pools)

    def solve(idx: np.ndarray) -> _hex_milp.Solution:
        inst = _instance(
            configs,
            classes,
            counts,
            cands.gpus[idx],
            cands.step_s[idx],
            workload.fixed_s,
            stragglers,
        )
        sol = _hex_milp.solve(inst)
        return _hex_milp.Solution(
            sol.step_s, int(idx[sol.train]), sol.replicas, sol.assigned, sol.makespan, sol.probes
        )

    if method == "exact":
        best = solve(np.arange(len(cands.gpus)))
        evaluated = best.probes
    else:
        best, evaluated = _bisect_search(
            pools, cands.gpus, cands.step_s, workload.fixed_s, rounds, solve
        )
    return _hex_plan(
        pools,
        workload,
        cands.gpus[best.train],
        cands.plan(best.train),
        _rollout_plan(configs, classes, best),
        best.step_s,
        evaluated,
    )

"""Heterogeneous GPU allocation for asynchronous RL (AReaL-Hex §4): who trains, who rolls out.

Given GPU pools (a :class:`~flowrl.sched.costmodel.HardwareSpec`, a count and a price each)
and a workload (model, rollouts per step, prompt length, a sample of response lengths), choose
which GPUs train and which generate, the rollout replicas and the training parallelism, so
that the asynchronous step ``max(C_T, C_I)`` is shortest (all GPUs are paid for, so this also
maximises throughput per dollar).

- :func:`replica_configs` — rollout replica configurations ``psi``: one GPU type, TP within a
  node (the paper's restriction), weights and KV fitting; per-replica token rate ``h_psi``
  (saturated, :func:`~flowrl.sched.costmodel.saturated_token_rate` at the mean context) and
  per-token latency of a lone long sequence.
- :func:`solve_rollout` — the paper's MILP (eq. 2): ``min Theta`` s.t. ``sum x_psi = B``,
  ``x_psi * len <= h_psi * y_psi * Theta``, ``sum_psi gpus * y_psi <= count`` per type. The
  bilinear ``y_psi * Theta`` is linearised *exactly*: ``y_psi = sum_k 2^k b_psik`` (binary
  digits) and ``z_psik = b_psik * Theta`` by the four McCormick inequalities, which are exact
  for a binary times a bounded continuous (``Theta <= Theta_bar``, the makespan of a feasible
  greedy plan). Ours adds the straggler term the paper's mean-length model lacks: a used
  configuration cannot finish before its lone-sequence latency times the longest response
  (``Theta >= lat_psi * L_max * u_psi``, ``y_psi <= Y_psi * u_psi``). Solved by HiGHS.
- :func:`search_training` — the paper's constrained search: TP and DP within one GPU type;
  each type hosts ``S_t`` pipeline stages of ``tp_t x dp`` GPUs, layers split in proportion
  to stage compute; memory (bf16 weights and grads, fp32 Adam states sharded over DP) must
  fit; step time = 1F1B ``(M + S - 1)`` times the slowest stage's micro-batch time (compute +
  TP all-reduces) + the DP gradient all-reduce.
- :func:`allocate` — the outer search over the train/rollout split (node granularity per
  pool). ``method="bisect"`` is the paper's repartition phase: binary search on the training
  compute fraction ``gamma`` (``C_T < C_I`` -> less training), each ``gamma`` giving the split
  that maximises the paper's metric (eq. 3: training's share of interconnect bandwidth +
  rollout's share of HBM bandwidth) among those with that compute fraction.
  ``method="exhaustive"`` (ours, the default) evaluates every split, best bound first,
  skipping a split's MILP when an optimistic bound (training time, and a rollout makespan
  with every GPU at its best rate) cannot beat the incumbent: exact over the splits, and
  below a second at 64 GPUs of two types.

Invariants (asserted by tests): the MILP's makespan equals brute-force enumeration of the
replica counts on small instances; every plan respects the GPU counts per type; its
assignment sums to ``B`` and no configuration's load exceeds ``Theta``; ``allocate``'s
exhaustive plan is never slower than the bisection's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Literal, final

import msgspec
import numpy as np
from scipy import sparse

from flowrl.errors import ConfigError
from flowrl.sched import _highs
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    kv_capacity_tokens,
    latency_per_token,
    saturated_token_rate,
)

__all__ = [
    "GpuPool",
    "HexPlan",
    "HexWorkload",
    "ReplicaConfig",
    "RolloutPlan",
    "TrainPlan",
    "allocate",
    "replica_configs",
    "search_training",
    "solve_rollout",
]

TP_DEGREES = (1, 2, 4, 8)


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
    drawn from ``response_lengths`` (a profiled sample); training at ``train_eta`` of peak
    FLOPs on ``train_flops_per_token`` (default ``8 * params``: forward, backward, logprob
    recompute) in micro-batches of ``microbatch_tokens``; reward ``reward_s`` per step; weight
    sync over ``sync_bw`` bytes/s."""

    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    rollouts: int = 4096
    prompt_tokens: float = 512.0
    response_lengths: tuple[float, ...] = (1500.0,)
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


@final
@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """A rollout replica: ``tp`` GPUs of pool ``pool``; ``rate`` tokens/s when full,
    ``tail_s`` seconds to decode the longest response alone."""

    pool: int
    tp: int
    rate: float
    tail_s: float


@final
@dataclass(frozen=True, slots=True)
class RolloutPlan:
    configs: tuple[ReplicaConfig, ...]
    replicas: tuple[int, ...]
    assigned: tuple[float, ...]
    makespan: float
    status: str


@final
@dataclass(frozen=True, slots=True)
class TrainPlan:
    """Per pool ``(tp, stages)`` (stages 0: pool not used), data-parallel degree ``dp``."""

    dp: int
    stages: tuple[tuple[int, int], ...]
    step_s: float


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
    evaluated: int


def _check_pools(pools: tuple[GpuPool, ...] | list[GpuPool], counts: tuple[int, ...]) -> None:
    if len(counts) != len(pools):
        raise ConfigError(f"expected one GPU count per pool ({len(pools)}), got {len(counts)}")
    for p, c in zip(pools, counts, strict=True):
        if not 0 <= c <= p.count:
            raise ConfigError(f"pool {p.name!r} has {p.count} GPUs, asked for {c}")


def replica_configs(
    pools: tuple[GpuPool, ...] | list[GpuPool], workload: HexWorkload
) -> list[ReplicaConfig]:
    """Every single-type, in-node TP replica that holds the model and one mean context."""
    ctx = workload.prompt_tokens + workload.mean_length / 2
    tail_ctx = workload.prompt_tokens + workload.max_length / 2
    out = []
    for i, pool in enumerate(pools):
        for tp in TP_DEGREES:
            if tp > pool.hw.gpus_per_node:
                continue
            mode = ParallelMode.tensor(tp)
            try:
                if kv_capacity_tokens(mode, workload.model, pool.hw) < ctx:
                    continue
            except ConfigError:  # the weights alone do not fit
                continue
            rate = saturated_token_rate(mode, ctx, workload.bs_max, workload.model, pool.hw)
            lat = float(latency_per_token(mode, tail_ctx, workload.model, pool.hw))
            out.append(ReplicaConfig(pool=i, tp=tp, rate=rate, tail_s=lat * workload.max_length))
    return out


def _makespan(
    configs: list[ReplicaConfig], y: tuple[int, ...] | list[int], work: float, stragglers: bool
) -> float:
    """Optimal makespan for fixed replica counts (the assignment proportional to rates)."""
    rate = sum(c.rate * n for c, n in zip(configs, y, strict=True))
    if rate <= 0:
        return math.inf
    if not stragglers:
        return work / rate
    tail = max((c.tail_s for c, n in zip(configs, y, strict=True) if n > 0), default=0.0)
    return max(work / rate, tail)


def _greedy_replicas(
    configs: list[ReplicaConfig],
    counts: tuple[int, ...],
    pools: tuple[GpuPool, ...] | list[GpuPool],
) -> list[int]:
    """Per pool, as many replicas as fit of its best-rate-per-GPU configuration."""
    y = [0] * len(configs)
    for i in range(len(pools)):
        mine = [j for j, c in enumerate(configs) if c.pool == i]
        if mine:
            j = max(mine, key=lambda j: configs[j].rate / configs[j].tp)
            y[j] = counts[i] // configs[j].tp
    return y


def solve_rollout(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    counts: tuple[int, ...],
    workload: HexWorkload,
    *,
    method: Literal["knapsack", "milp"] = "knapsack",
    stragglers: bool = True,
) -> RolloutPlan:
    """The generation plan on ``counts[t]`` GPUs of each pool (see the module docstring):
    ``"milp"`` solves the paper's MILP with HiGHS, ``"knapsack"`` the same problem exactly by
    dynamic programming; ``stragglers=False`` drops our tail term (the paper's model)."""
    _check_pools(pools, counts)
    if method not in ("knapsack", "milp"):
        raise ConfigError(f"solve_rollout method must be 'knapsack' or 'milp', got {method!r}")
    configs = [c for c in replica_configs(pools, workload) if counts[c.pool] >= c.tp]
    if not configs:
        have = {p.name: c for p, c in zip(pools, counts, strict=True)}
        raise ConfigError(
            f"no rollout replica of {workload.model.name!r} fits the GPUs {have}; "
            "give generation more or larger GPUs"
        )
    if method == "knapsack":
        return _solve_knapsack(configs, counts, workload, stragglers)
    work = workload.rollouts * workload.mean_length
    tails = [c.tail_s if stragglers else 0.0 for c in configs]
    start = _greedy_replicas(configs, counts, pools)
    theta_bar = _makespan(configs, start, work, stragglers) * (1.0 + 1e-9)
    ymax = [counts[c.pool] // c.tp for c in configs]
    bits = [max(1, int(m).bit_length()) for m in ymax]
    # columns: theta | per config: x, u, b_0..b_K-1, z_0..z_K-1
    col = 1
    cx, cu, cb, cz = [], [], [], []
    for k in bits:
        cx.append(col)
        cu.append(col + 1)
        cb.append(list(range(col + 2, col + 2 + k)))
        cz.append(list(range(col + 2 + k, col + 2 + 2 * k)))
        col += 2 + 2 * k
    n = col
    rows: list[tuple[dict[int, float], float, float]] = []
    rows.append(({cx[j]: 1.0 for j in range(len(configs))}, workload.rollouts, workload.rollouts))
    for j, c in enumerate(configs):
        # x_j * len <= rate_j * sum_k 2^k z_jk
        coef = {cx[j]: workload.mean_length}
        for k, zc in enumerate(cz[j]):
            coef[zc] = -c.rate * 2**k
        rows.append((coef, -math.inf, 0.0))
        for bc, zc in zip(cb[j], cz[j], strict=True):
            rows.append(({zc: 1.0, bc: -theta_bar}, -math.inf, 0.0))  # z <= theta_bar * b
            rows.append(({zc: 1.0, 0: -1.0}, -math.inf, 0.0))  # z <= theta
            rows.append(({0: 1.0, zc: -1.0, bc: theta_bar}, -math.inf, theta_bar))  # z >= ...
        digits = {bc: float(2**k) for k, bc in enumerate(cb[j])}
        rows.append(({**digits, cu[j]: -float(ymax[j])}, -math.inf, 0.0))  # y <= Y u
        if tails[j] > 0:
            rows.append(({0: 1.0, cu[j]: -tails[j]}, 0.0, math.inf))  # theta >= tail u
    for i in range(len(pools)):
        coef = {}
        for j, c in enumerate(configs):
            if c.pool == i:
                for k, bc in enumerate(cb[j]):
                    coef[bc] = float(c.tp * 2**k)
        if coef:
            rows.append((coef, -math.inf, float(counts[i])))
    data, ri, ci = [], [], []
    lo, hi = [], []
    for r, (coef, a, b) in enumerate(rows):
        for cidx, v in coef.items():
            ri.append(r)
            ci.append(cidx)
            data.append(v)
        lo.append(a)
        hi.append(b)
    a_mat = sparse.csr_matrix((data, (ri, ci)), shape=(len(rows), n))
    cost = np.zeros(n)
    cost[0] = 1.0
    col_lo = np.zeros(n)
    col_hi = np.full(n, np.inf)
    col_hi[0] = theta_bar
    integer = np.zeros(n, dtype=bool)
    for j in range(len(configs)):
        col_hi[cx[j]] = workload.rollouts
        for bc in (cu[j], *cb[j]):
            col_hi[bc] = 1.0
            integer[bc] = True
        for zc in cz[j]:
            col_hi[zc] = theta_bar
    res = _highs.solve(
        cost, a_mat, np.array(lo), np.array(hi), col_lo, col_hi, integer=integer, mip_rel_gap=1e-7
    )
    if not res.ok:
        raise ConfigError(
            f"the rollout MILP found no plan (HiGHS: {res.status})"
        )  # pragma: no cover
    y = [round(sum(res.x[bc] * 2**k for k, bc in enumerate(cb[j]))) for j in range(len(configs))]
    span = _makespan(configs, y, work, stragglers)
    rate = sum(c.rate * m for c, m in zip(configs, y, strict=True))
    assigned = tuple(workload.rollouts * c.rate * m / rate for c, m in zip(configs, y, strict=True))
    return RolloutPlan(tuple(configs), tuple(y), assigned, span, res.status)


def _solve_knapsack(
    configs: list[ReplicaConfig], counts: tuple[int, ...], workload: HexWorkload, stragglers: bool
) -> RolloutPlan:
    """The MILP solved exactly without a solver. For fixed replica counts the best
    assignment is proportional to rate, so ``Theta = max(B * len / sum(h * y), max tail of
    the used configs)``. For each tail level ``tau`` (only configurations with tail <= tau
    allowed), the rate is maximised per pool independently — an unbounded knapsack over
    that pool's GPUs with item sizes = TP degrees — and the best ``max(work / R, tau)`` over
    the levels is the optimum."""
    levels = sorted({c.tail_s for c in configs}) if stragglers else [math.inf]
    work = workload.rollouts * workload.mean_length
    best_y: list[int] | None = None
    best_span = math.inf
    for tau in levels:
        y = [0] * len(configs)
        for pool, n in enumerate(counts):
            mine = [j for j, c in enumerate(configs) if c.pool == pool and c.tail_s <= tau]
            if not mine or n == 0:
                continue
            value = [0.0] * (n + 1)
            pick = [-1] * (n + 1)
            for g in range(1, n + 1):
                value[g], pick[g] = value[g - 1], -1
                for j in mine:
                    tp = configs[j].tp
                    if tp <= g and value[g - tp] + configs[j].rate > value[g]:
                        value[g], pick[g] = value[g - tp] + configs[j].rate, j
            g = n
            while g > 0:
                if pick[g] < 0:
                    g -= 1
                else:
                    y[pick[g]] += 1
                    g -= configs[pick[g]].tp
        span = _makespan(configs, y, work, stragglers)
        if span < best_span:
            best_span, best_y = span, y
    if best_y is None:  # pragma: no cover - configs is non-empty and fits its pool
        raise ConfigError("no rollout replica fits")
    rate = sum(c.rate * m for c, m in zip(configs, best_y, strict=True))
    assigned = tuple(
        work / workload.mean_length * c.rate * m / rate
        for c, m in zip(configs, best_y, strict=True)
    )
    return RolloutPlan(tuple(configs), tuple(best_y), assigned, best_span, "optimal")


def search_training(
    pools: tuple[GpuPool, ...] | list[GpuPool], counts: tuple[int, ...], workload: HexWorkload
) -> TrainPlan | None:
    """Fastest training plan using exactly ``counts`` GPUs per pool (None: none fits)."""
    _check_pools(pools, counts)
    used = [i for i, c in enumerate(counts) if c > 0]
    if not used:
        return None
    model = workload.model
    tokens = workload.rollouts * (workload.prompt_tokens + workload.mean_length)
    best: TrainPlan | None = None
    for dp in range(1, min(counts[i] for i in used) + 1):
        if any(counts[i] % dp for i in used):
            continue
        per = []
        for i in used:
            hw = pools[i].hw
            per.append(
                [tp for tp in TP_DEGREES if tp <= hw.gpus_per_node and (counts[i] // dp) % tp == 0]
            )
        for tps in itertools.product(*per):
            stages = [(counts[i] // dp) // tp for i, tp in zip(used, tps, strict=True)]
            n_stages = sum(stages)
            if n_stages > model.layers:
                continue
            power = [
                tp * pools[i].hw.flops * workload.train_eta for i, tp in zip(used, tps, strict=True)
            ]
            total = sum(p * s for p, s in zip(power, stages, strict=True))
            mb = math.ceil(tokens / dp / workload.microbatch_tokens)
            slow = 0.0
            sync = 0.0
            fits = True
            for i, tp, p in zip(used, tps, power, strict=True):
                hw = pools[i].hw
                share = p / total  # fraction of the layers on one stage of this type
                params = model.params * share
                mem = params * (4.0 + 12.0 / dp) / tp
                if mem > hw.hbm_bytes * hw.hbm_usable:
                    fits = False
                    break
                compute = workload.microbatch_tokens * workload.flops_per_token * share / p
                msg = workload.microbatch_tokens * model.hidden * model.dtype_bytes
                comm = 0.0
                if tp > 1:
                    comm = (
                        4
                        * model.layers
                        * share
                        * (hw.coll_a0 + 2 * (tp - 1) / tp * msg / hw.link_bw)
                    )
                slow = max(slow, compute + comm)
                if dp > 1:
                    bw = hw.link_bw if tp * dp <= hw.gpus_per_node else hw.net_bw
                    sync = max(sync, 2 * (dp - 1) / dp * params * 2 / tp / bw)
            if not fits:
                continue
            step = (mb + n_stages - 1) * slow + sync
            if best is None or step < best.step_s:
                plan = [(0, 0)] * len(pools)
                for i, tp, s in zip(used, tps, stages, strict=True):
                    plan[i] = (tp, s)
                best = TrainPlan(dp=dp, stages=tuple(plan), step_s=step)
    return best


def _splits(pools: tuple[GpuPool, ...] | list[GpuPool]) -> list[tuple[int, ...]]:
    """Training GPU counts per pool, in whole nodes, leaving both sides some GPUs."""
    ranges = []
    for p in pools:
        node = p.hw.gpus_per_node
        ranges.append(sorted({*range(0, p.count + 1, node), p.count}))
    total = sum(p.count for p in pools)
    return [s for s in itertools.product(*ranges) if 0 < sum(s) < total]


def _plan(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    split: tuple[int, ...],
    workload: HexWorkload,
    train: TrainPlan,
    evaluated: int,
    stragglers: bool,
    rollout_method: Literal["knapsack", "milp"],
) -> HexPlan | None:
    rollout_gpus = tuple(p.count - s for p, s in zip(pools, split, strict=True))
    try:
        roll = solve_rollout(
            pools, rollout_gpus, workload, method=rollout_method, stragglers=stragglers
        )
    except ConfigError:
        return None
    sync = workload.model.weight_bytes / workload.sync_bw
    c_i = roll.makespan + workload.reward_s + sync
    step = max(train.step_s, c_i)
    price = sum(p.count * p.price_per_hour for p in pools)
    tps = workload.rollouts * workload.mean_length / step
    return HexPlan(
        train_gpus=split,
        rollout_gpus=rollout_gpus,
        train=train,
        rollout=roll,
        step_s=step,
        train_s=train.step_s,
        rollout_s=c_i,
        tokens_per_s=tps,
        cost_per_hour=price,
        tokens_per_dollar=tps * 3600 / price if price > 0 else math.inf,
        evaluated=evaluated,
    )


def _optimistic_rollout(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    rollout_gpus: tuple[int, ...],
    best_per_gpu: list[float],
    min_tail: float,
    workload: HexWorkload,
) -> float:
    rate = sum(n * r for n, r in zip(rollout_gpus, best_per_gpu, strict=True))
    if rate <= 0:
        return math.inf
    sync = workload.model.weight_bytes / workload.sync_bw
    return max(workload.rollouts * workload.mean_length / rate, min_tail) + workload.reward_s + sync


def _interconnect(pools: tuple[GpuPool, ...] | list[GpuPool], counts: tuple[int, ...]) -> float:
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


def allocate(
    pools: tuple[GpuPool, ...] | list[GpuPool],
    workload: HexWorkload,
    *,
    method: Literal["exhaustive", "bisect"] = "exhaustive",
    rounds: int = 12,
    rollout_method: Literal["knapsack", "milp"] = "knapsack",
    stragglers: bool = True,
) -> HexPlan:
    """The split, training plan and rollout plan with the shortest asynchronous step."""
    if method not in ("exhaustive", "bisect"):
        raise ConfigError(f"allocate method must be 'exhaustive' or 'bisect', got {method!r}")
    if not pools or sum(p.count for p in pools) < 2:
        raise ConfigError("allocate needs at least two GPUs in its pools")
    configs = replica_configs(pools, workload)
    if not configs:
        raise ConfigError(f"no GPU type can hold a rollout replica of {workload.model.name!r}")
    best_per_gpu = [
        max((c.rate / c.tp for c in configs if c.pool == i), default=0.0) for i in range(len(pools))
    ]
    min_tail = min(c.tail_s for c in configs) if stragglers else 0.0
    splits = _splits(pools)
    found = {s: search_training(pools, s, workload) for s in splits}
    trains = {s: t for s, t in found.items() if t is not None}
    candidates = list(trains)
    if not candidates:
        raise ConfigError("no train/rollout split fits the model's training memory")
    evaluated = 0
    best: HexPlan | None = None
    if method == "exhaustive":
        bounds = {}
        for s in candidates:
            roll = tuple(p.count - n for p, n in zip(pools, s, strict=True))
            bounds[s] = max(
                trains[s].step_s,
                _optimistic_rollout(pools, roll, best_per_gpu, min_tail, workload),
            )
        for s in sorted(candidates, key=lambda s: bounds[s]):
            if best is not None and bounds[s] >= best.step_s:
                break
            evaluated += 1
            plan = _plan(pools, s, workload, trains[s], evaluated, stragglers, rollout_method)
            if plan is not None and (best is None or plan.step_s < best.step_s):
                best = plan
    else:
        compute = [p.hw.flops for p in pools]
        total = sum(c * p.count for c, p in zip(compute, pools, strict=True))
        hbm_total = sum(p.hw.hbm_bw * p.count for p in pools)
        link_total = _interconnect(pools, tuple(p.count for p in pools))
        frac = {s: sum(c * n for c, n in zip(compute, s, strict=True)) / total for s in candidates}

        def metric(s: tuple[int, ...]) -> float:
            roll = [p.count - n for p, n in zip(pools, s, strict=True)]
            hbm = sum(p.hw.hbm_bw * n for p, n in zip(pools, roll, strict=True))
            return _interconnect(pools, s) / link_total + hbm / hbm_total

        q, r = 0.0, 1.0
        seen: dict[tuple[int, ...], HexPlan | None] = {}
        for _ in range(rounds):
            gamma = (q + r) / 2
            near = min(abs(frac[s] - gamma) for s in candidates)
            band = [s for s in candidates if abs(frac[s] - gamma) <= near + 1e-12]
            s = max(band, key=metric)
            if s not in seen:
                evaluated += 1
                seen[s] = _plan(
                    pools, s, workload, trains[s], evaluated, stragglers, rollout_method
                )
            plan = seen[s]
            if plan is None:
                r = gamma
                continue
            if best is None or plan.step_s < best.step_s:
                best = plan
            if plan.train_s < plan.rollout_s:
                r = gamma
            else:
                q = gamma
    if best is None:
        raise ConfigError("no split gives both training and generation a plan that fits")
    return replace(best, evaluated=evaluated)

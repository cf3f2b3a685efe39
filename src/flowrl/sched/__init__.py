"""Generation scheduling: pure functions over immutable cluster snapshots.

Nothing here imports Ray, zmq or the hub: a real pipeline and the simulator
(:mod:`flowrl.sim`) feed the same snapshots to the same functions.

- :mod:`~flowrl.sched.costmodel` — decode step time, KV capacity, migrate-vs-recompute;
- :mod:`~flowrl.sched.forecast` — online remaining-length distribution (ARIMA + Kaplan-Meier);
- :mod:`~flowrl.sched.planner` — proactive planner (MILP over modes and length buckets);
- :mod:`~flowrl.sched.balancer` — reactive balancer (congestion score, KV-headroom moves);
- :mod:`~flowrl.sched.fusion` — long-tail migration threshold and consolidation.
"""

from __future__ import annotations

from flowrl.sched.balancer import (
    BalanceDecision,
    BalancerConfig,
    BalancerMemory,
    Migration,
    congestion_scores,
    rebalance,
)
from flowrl.sched.costmodel import (
    HardwareSpec,
    ModelSpec,
    ParallelMode,
    kv_capacity_tokens,
    kv_move_cost,
    latency_per_token,
    prefill_time,
    saturated_concurrency,
    saturated_token_rate,
    step_time,
    switch_time,
)
from flowrl.sched.forecast import (
    ForecastConfig,
    ForecastStatistics,
    LengthDistribution,
    LengthForecaster,
    RemainingEstimate,
    bucket_relative_error,
    kaplan_meier,
)
from flowrl.sched.fusion import (
    FusionConfig,
    ThresholdChoice,
    choose_threshold,
    consolidation_size,
    select_targets,
)
from flowrl.sched.planner import Plan, PlannerConfig, candidate_modes, plan, realize
from flowrl.sched.problem import Evaluation, PlanProblem, build_problem, evaluate, feasible
from flowrl.sched.snapshot import ClusterSnapshot, ReplicaView, RequestView
from flowrl.sched.solver import Solution, assign_greedy, assign_lp, solve_milp, solve_relaxed

__all__ = [
    "BalanceDecision",
    "BalancerConfig",
    "BalancerMemory",
    "ClusterSnapshot",
    "Evaluation",
    "ForecastConfig",
    "ForecastStatistics",
    "FusionConfig",
    "HardwareSpec",
    "LengthDistribution",
    "LengthForecaster",
    "Migration",
    "ModelSpec",
    "ParallelMode",
    "Plan",
    "PlanProblem",
    "PlannerConfig",
    "RemainingEstimate",
    "ReplicaView",
    "RequestView",
    "Solution",
    "ThresholdChoice",
    "assign_greedy",
    "assign_lp",
    "bucket_relative_error",
    "build_problem",
    "candidate_modes",
    "choose_threshold",
    "congestion_scores",
    "consolidation_size",
    "evaluate",
    "feasible",
    "kaplan_meier",
    "kv_capacity_tokens",
    "kv_move_cost",
    "latency_per_token",
    "plan",
    "prefill_time",
    "realize",
    "rebalance",
    "saturated_concurrency",
    "saturated_token_rate",
    "select_targets",
    "solve_milp",
    "solve_relaxed",
    "step_time",
    "switch_time",
]

"""Generation scheduling: pure functions over immutable cluster snapshots.

Nothing here imports Ray, zmq or the hub: a real pipeline and the simulator
(:mod:`flowrl.sim`) feed the same snapshots to the same functions.

- :mod:`~flowrl.sched.costmodel` — decode step time, KV capacity, migrate-vs-recompute;
- :mod:`~flowrl.sched.forecast` — online remaining-length distribution (ARIMA + Kaplan-Meier);
- :mod:`~flowrl.sched.planner` — proactive planner (MILP over modes and length buckets);
- :mod:`~flowrl.sched.balancer` — reactive balancer (congestion score, KV-headroom moves);
- :mod:`~flowrl.sched.fusion` — long-tail migration threshold and consolidation;
- :mod:`~flowrl.sched.pipeline_schedule` — fused bidirectional pipeline schedules (RLHFuse
  intra-stage fusion): problem, lower bounds, 1F1B baselines, validation, JSON file;
- :mod:`~flowrl.sched.pipeline_search` — greedy, the paper's annealing, our search;
- :mod:`~flowrl.sched.pipeline_improve` — justification and tabu search of a fused schedule;
- :mod:`~flowrl.sched.hex_alloc` — heterogeneous GPU allocation (AReaL-Hex): rollout MILP,
  training-parallelism search, train/rollout split;
- :mod:`~flowrl.sched.fabric` — RFabric: optical-core topologies per traffic phase and the
  policy that reconfigures them in the slack between phases.
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
from flowrl.sched.fabric import (
    FabricDecision,
    FabricPolicy,
    FabricSpec,
    Topology,
    materialize,
    phase_demand,
    template,
    transfer_time,
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
from flowrl.sched.hex_alloc import (
    GpuPool,
    HexPlan,
    HexWorkload,
    ReplicaConfig,
    RolloutPlan,
    TrainPlan,
    allocate,
    replica_configs,
    search_training,
    solve_rollout,
)
from flowrl.sched.pipeline_schedule import (
    FusedProblem,
    FusedSchedule,
    PipelineModel,
    ScheduledOp,
    lower_bound,
    one_f_one_b,
    serial_1f1b,
    timed,
    validate_schedule,
)
from flowrl.sched.pipeline_search import (
    anneal_schedule,
    concurrent_1f1b,
    greedy_schedule,
    search_schedule,
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
    "FabricDecision",
    "FabricPolicy",
    "FabricSpec",
    "ForecastConfig",
    "ForecastStatistics",
    "FusedProblem",
    "FusedSchedule",
    "FusionConfig",
    "GpuPool",
    "HardwareSpec",
    "HexPlan",
    "HexWorkload",
    "LengthDistribution",
    "LengthForecaster",
    "Migration",
    "ModelSpec",
    "ParallelMode",
    "PipelineModel",
    "Plan",
    "PlanProblem",
    "PlannerConfig",
    "RemainingEstimate",
    "ReplicaConfig",
    "ReplicaView",
    "RequestView",
    "RolloutPlan",
    "ScheduledOp",
    "Solution",
    "ThresholdChoice",
    "Topology",
    "TrainPlan",
    "allocate",
    "anneal_schedule",
    "assign_greedy",
    "assign_lp",
    "bucket_relative_error",
    "build_problem",
    "candidate_modes",
    "choose_threshold",
    "concurrent_1f1b",
    "congestion_scores",
    "consolidation_size",
    "evaluate",
    "feasible",
    "greedy_schedule",
    "kaplan_meier",
    "kv_capacity_tokens",
    "kv_move_cost",
    "latency_per_token",
    "lower_bound",
    "materialize",
    "one_f_one_b",
    "phase_demand",
    "plan",
    "prefill_time",
    "realize",
    "rebalance",
    "replica_configs",
    "saturated_concurrency",
    "saturated_token_rate",
    "search_schedule",
    "search_training",
    "select_targets",
    "serial_1f1b",
    "solve_milp",
    "solve_relaxed",
    "solve_rollout",
    "step_time",
    "switch_time",
    "template",
    "timed",
    "transfer_time",
    "validate_schedule",
]

"""Discrete-event simulator of a disaggregated RL cluster that drives :mod:`flowrl.sched`.

Emits the hub's own event types (:mod:`flowrl.events`) to observers, so planner, balancer
and forecaster subscribe exactly as they would to a real hub. CLI: :func:`flowrl.sim.cli.main`.
"""

from __future__ import annotations

from flowrl.sim.cluster import ClusterSpec
from flowrl.sim.engine import SimResult, Simulator, StepResult
from flowrl.sim.network import FabricRun, FabricWorkload, flow_time, run_fabric
from flowrl.sim.schemes import Scheme, latency_mode, standard_schemes, throughput_mode
from flowrl.sim.workload import StepRequests, Workload

__all__ = [
    "ClusterSpec",
    "FabricRun",
    "FabricWorkload",
    "Scheme",
    "SimResult",
    "Simulator",
    "StepRequests",
    "StepResult",
    "Workload",
    "flow_time",
    "latency_mode",
    "run_fabric",
    "standard_schemes",
    "throughput_mode",
]

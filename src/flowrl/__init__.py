"""flowrl: a streaming data hub for reinforcement-learning post-training of LLMs.

The user API is re-exported here; implementation modules are private (``flowrl._*``).
Public sub-namespaces: ``flowrl.errors``, ``flowrl.events``, ``flowrl.hooks``,
``flowrl.sched``, ``flowrl.sched_hooks``, ``flowrl.sim``, ``flowrl.testing``, ``flowrl.tracking``,
``flowrl.integrations.verl``, ``flowrl.integrations.slime`` (imported on demand).

Each name below is imported on first use (PEP 562 ``__getattr__``), so importing a
sub-package does not load the hub: ``import flowrl.sched`` plans without zmq or Ray, and
``import flowrl.errors`` costs what that module costs. The ``TYPE_CHECKING`` imports say the
same thing as ``_HOMES`` to type checkers; tests/unit/test_exports.py keeps the two equal.
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from flowrl._client.base import Partial
    from flowrl._client.batch import Batch
    from flowrl._client.batcher import HeldPut, PutBatcher
    from flowrl._client.future import PutFuture
    from flowrl._client.inproc import Hub
    from flowrl._config import (
        ColumnCounters,
        HubConfig,
        HubCounters,
        HubStats,
        JournalConfig,
        Readiness,
        TaskCounters,
        TaskStats,
        UnitStats,
    )
    from flowrl._controller.meta import BatchMeta
    from flowrl._controller.samplers import (
        BalancedSampler,
        CandidateView,
        FifoSampler,
        GroupSampler,
        Sampler,
        StalenessSampler,
    )
    from flowrl._launch.processes import connect, launch_hub
    from flowrl._launch.ray_hub import launch_ray_hub
    from flowrl._observers.dashboard import Dashboard, serve_dashboard
    from flowrl._observers.prometheus import MetricsServer, serve_metrics
    from flowrl._observers.staleness import StalenessMetrics, StalenessStep
    from flowrl._observers.timeline import Timeline
    from flowrl._observers.trace import ChromeTrace
    from flowrl._pipeline.admission import AdmissionController, AdmissionStats, Staleness
    from flowrl._pipeline.executors.base import Executor
    from flowrl._pipeline.executors.processes import ProcessExecutor
    from flowrl._pipeline.executors.ray import RayExecutor
    from flowrl._pipeline.executors.threads import ThreadExecutor
    from flowrl._pipeline.loader import Loader, LoaderStats
    from flowrl._pipeline.pipeline import Pipeline, PipelineRun
    from flowrl._pipeline.result import RunResult, StageStats
    from flowrl._pipeline.stage import Rows, StageContext, StageSpec, stage
    from flowrl._schema.columns import Column
    from flowrl._schema.ragged import RaggedArray
    from flowrl._transport.auth import HubKey
    from flowrl._transport.remote import RemoteHub
    from flowrl._weights.object_store import RayWeightPublisher, RayWeightSubscriber
    from flowrl._weights.sync import (
        BaseWeightPublisher,
        BaseWeightSubscriber,
        WeightPublisher,
        WeightSnapshot,
        WeightStore,
        WeightSubscriber,
    )
    from flowrl.errors import FlowRLError
    from flowrl.hooks import Observer

__version__ = "0.1.0"

__all__ = [
    "AdmissionController",
    "AdmissionStats",
    "BalancedSampler",
    "BaseWeightPublisher",
    "BaseWeightSubscriber",
    "Batch",
    "BatchMeta",
    "CandidateView",
    "ChromeTrace",
    "Column",
    "ColumnCounters",
    "Dashboard",
    "Executor",
    "FifoSampler",
    "FlowRLError",
    "GroupSampler",
    "HeldPut",
    "Hub",
    "HubConfig",
    "HubCounters",
    "HubKey",
    "HubStats",
    "JournalConfig",
    "Loader",
    "LoaderStats",
    "MetricsServer",
    "Observer",
    "Partial",
    "Pipeline",
    "PipelineRun",
    "ProcessExecutor",
    "PutBatcher",
    "PutFuture",
    "RaggedArray",
    "RayExecutor",
    "RayWeightPublisher",
    "RayWeightSubscriber",
    "Readiness",
    "RemoteHub",
    "Rows",
    "RunResult",
    "Sampler",
    "StageContext",
    "StageSpec",
    "StageStats",
    "Staleness",
    "StalenessMetrics",
    "StalenessSampler",
    "StalenessStep",
    "TaskCounters",
    "TaskStats",
    "ThreadExecutor",
    "Timeline",
    "UnitStats",
    "WeightPublisher",
    "WeightSnapshot",
    "WeightStore",
    "WeightSubscriber",
    "__version__",
    "connect",
    "launch_hub",
    "launch_ray_hub",
    "serve_dashboard",
    "serve_metrics",
    "stage",
]

# public name -> the module that defines it
_HOMES: dict[str, str] = {
    "AdmissionController": "flowrl._pipeline.admission",
    "AdmissionStats": "flowrl._pipeline.admission",
    "BalancedSampler": "flowrl._controller.samplers",
    "BaseWeightPublisher": "flowrl._weights.sync",
    "BaseWeightSubscriber": "flowrl._weights.sync",
    "Batch": "flowrl._client.batch",
    "BatchMeta": "flowrl._controller.meta",
    "CandidateView": "flowrl._controller.samplers",
    "ChromeTrace": "flowrl._observers.trace",
    "Column": "flowrl._schema.columns",
    "ColumnCounters": "flowrl._config",
    "Dashboard": "flowrl._observers.dashboard",
    "Executor": "flowrl._pipeline.executors.base",
    "FifoSampler": "flowrl._controller.samplers",
    "FlowRLError": "flowrl.errors",
    "GroupSampler": "flowrl._controller.samplers",
    "HeldPut": "flowrl._client.batcher",
    "Hub": "flowrl._client.inproc",
    "HubConfig": "flowrl._config",
    "HubCounters": "flowrl._config",
    "HubKey": "flowrl._transport.auth",
    "HubStats": "flowrl._config",
    "JournalConfig": "flowrl._config",
    "Loader": "flowrl._pipeline.loader",
    "MetricsServer": "flowrl._observers.prometheus",
    "LoaderStats": "flowrl._pipeline.loader",
    "Observer": "flowrl.hooks",
    "Partial": "flowrl._client.base",
    "Pipeline": "flowrl._pipeline.pipeline",
    "PipelineRun": "flowrl._pipeline.pipeline",
    "ProcessExecutor": "flowrl._pipeline.executors.processes",
    "PutBatcher": "flowrl._client.batcher",
    "PutFuture": "flowrl._client.future",
    "RaggedArray": "flowrl._schema.ragged",
    "RayExecutor": "flowrl._pipeline.executors.ray",
    "RayWeightPublisher": "flowrl._weights.object_store",
    "RayWeightSubscriber": "flowrl._weights.object_store",
    "Readiness": "flowrl._config",
    "RemoteHub": "flowrl._transport.remote",
    "Rows": "flowrl._pipeline.stage",
    "RunResult": "flowrl._pipeline.result",
    "Sampler": "flowrl._controller.samplers",
    "StageContext": "flowrl._pipeline.stage",
    "StageSpec": "flowrl._pipeline.stage",
    "StageStats": "flowrl._pipeline.result",
    "Staleness": "flowrl._pipeline.admission",
    "StalenessMetrics": "flowrl._observers.staleness",
    "StalenessSampler": "flowrl._controller.samplers",
    "StalenessStep": "flowrl._observers.staleness",
    "TaskCounters": "flowrl._config",
    "TaskStats": "flowrl._config",
    "ThreadExecutor": "flowrl._pipeline.executors.threads",
    "Timeline": "flowrl._observers.timeline",
    "UnitStats": "flowrl._config",
    "WeightPublisher": "flowrl._weights.sync",
    "WeightSnapshot": "flowrl._weights.sync",
    "WeightStore": "flowrl._weights.sync",
    "WeightSubscriber": "flowrl._weights.sync",
    "connect": "flowrl._launch.processes",
    "launch_hub": "flowrl._launch.processes",
    "launch_ray_hub": "flowrl._launch.ray_hub",
    "serve_dashboard": "flowrl._observers.dashboard",
    "serve_metrics": "flowrl._observers.prometheus",
    "stage": "flowrl._pipeline.stage",
}


def __getattr__(name: str) -> typing.Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain dict hit
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(k for k in globals() if k.startswith("__"))})

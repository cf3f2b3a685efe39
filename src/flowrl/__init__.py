"""flowrl: a streaming data hub for reinforcement-learning post-training of LLMs.

The user API is re-exported here; implementation modules are private (``flowrl._*``).
Public sub-namespaces: ``flowrl.errors``, ``flowrl.events``, ``flowrl.hooks``,
``flowrl.testing``, ``flowrl.integrations.verl``, ``flowrl.integrations.slime`` (imported
on demand).
"""

from flowrl._client.base import Partial
from flowrl._client.config import HubConfig, HubStats, JournalConfig, TaskStats, UnitStats
from flowrl._client.future import PutFuture
from flowrl._client.inproc import Hub
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import (
    BalancedSampler,
    CandidateView,
    FifoSampler,
    GroupSampler,
    Sampler,
    StalenessSampler,
)
from flowrl._pipeline.admission import AdmissionController, AdmissionStats, Staleness
from flowrl._pipeline.executors.base import Executor
from flowrl._pipeline.executors.processes import ProcessExecutor
from flowrl._pipeline.executors.ray import RayExecutor
from flowrl._pipeline.executors.threads import ThreadExecutor
from flowrl._pipeline.loader import Loader, LoaderStats
from flowrl._pipeline.pipeline import Pipeline, PipelineRun
from flowrl._pipeline.result import RunResult, StageStats
from flowrl._pipeline.stage import Rows, StageContext, StageSpec, stage
from flowrl._pipeline.staleness import StalenessMetrics, StalenessStep
from flowrl._pipeline.timeline import Timeline
from flowrl._pipeline.weights import (
    BaseWeightPublisher,
    BaseWeightSubscriber,
    WeightPublisher,
    WeightSnapshot,
    WeightStore,
    WeightSubscriber,
)
from flowrl._pipeline.weights_ray import RayWeightPublisher, RayWeightSubscriber
from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray
from flowrl._store.batch import Batch
from flowrl._transport.launch import connect, launch_hub
from flowrl._transport.ray_hub import launch_ray_hub
from flowrl._transport.remote import RemoteHub
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
    "Column",
    "Executor",
    "FifoSampler",
    "FlowRLError",
    "GroupSampler",
    "Hub",
    "HubConfig",
    "HubStats",
    "JournalConfig",
    "Loader",
    "LoaderStats",
    "Observer",
    "Partial",
    "Pipeline",
    "PipelineRun",
    "ProcessExecutor",
    "PutFuture",
    "RaggedArray",
    "RayExecutor",
    "RayWeightPublisher",
    "RayWeightSubscriber",
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
    "stage",
]

"""flowrl: a streaming data hub for reinforcement-learning post-training of LLMs.

The user API is re-exported here; implementation modules are private (``flowrl._*``).
Public sub-namespaces: ``flowrl.errors``, ``flowrl.events``, ``flowrl.hooks``.
"""

from flowrl._client.config import HubConfig, HubStats, TaskStats, UnitStats
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
from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray
from flowrl._store.batch import Batch
from flowrl._transport.launch import connect, launch_hub
from flowrl._transport.remote import RemoteHub
from flowrl.errors import FlowRLError
from flowrl.hooks import Observer

__version__ = "0.1.0"

__all__ = [
    "BalancedSampler",
    "Batch",
    "BatchMeta",
    "CandidateView",
    "Column",
    "FifoSampler",
    "FlowRLError",
    "GroupSampler",
    "Hub",
    "HubConfig",
    "HubStats",
    "Observer",
    "RaggedArray",
    "RemoteHub",
    "Sampler",
    "StalenessSampler",
    "TaskStats",
    "UnitStats",
    "__version__",
    "connect",
    "launch_hub",
]

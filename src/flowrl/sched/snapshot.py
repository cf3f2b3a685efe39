"""Immutable snapshots of a generation cluster: what planner, balancer and fusion read.

A real pipeline (or the simulator) builds one :class:`ClusterSnapshot` per decision from
the state its rollout workers report; the scheduling functions never look anywhere else.
Everything is a numpy array indexed by *replica* (``ReplicaView``), by *pending request*
(``RequestView``) or by *node* (``node_mode``), frozen and made read-only on construction.

Units: token counts are tokens, rates are tokens per second, times are seconds.

Invariants (checked by :meth:`ClusterSnapshot.validate`, asserted by tests):
- all arrays of a view have the same length;
- every request's ``replica`` is a valid replica index, every replica's ``node`` a valid
  node index, and ``mode`` indexes ``modes`` (or is ``-1`` for a replica/node that is off);
- a replica's ``running``/``waiting`` equal the number of requests on it in each state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import ParallelMode

__all__ = ["ClusterSnapshot", "ReplicaView", "RequestView"]

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]


def _frozen(name: str, arr: object, dtype: type) -> NDArray:
    out: NDArray = np.array(arr, dtype=dtype, copy=True)
    if out.ndim != 1:
        raise ConfigError(f"snapshot field {name!r} must be one-dimensional, got shape {out.shape}")
    out.flags.writeable = False
    return out


@final
@dataclass(frozen=True, slots=True)
class ReplicaView:
    """Per-replica state (a replica is one model instance, e.g. a vLLM engine).

    ``token_rate`` is the observed decode throughput over the last window; ``kv_used`` the KV
    tokens held by running requests; ``kv_capacity`` the KV tokens the replica can hold.
    """

    node: I64
    mode: I64
    running: I64
    waiting: I64
    kv_used: I64
    kv_capacity: I64
    bs_max: I64
    token_rate: F64

    def __post_init__(self) -> None:
        for f in ("node", "mode", "running", "waiting", "kv_used", "kv_capacity", "bs_max"):
            object.__setattr__(self, f, _frozen(f, getattr(self, f), np.int64))
        object.__setattr__(self, "token_rate", _frozen("token_rate", self.token_rate, np.float64))
        n = len(self.node)
        for f in ("mode", "running", "waiting", "kv_used", "kv_capacity", "bs_max", "token_rate"):
            if len(getattr(self, f)) != n:
                raise ConfigError(
                    f"ReplicaView.{f} has {len(getattr(self, f))} entries, node has {n}"
                )

    def __len__(self) -> int:
        return len(self.node)


@final
@dataclass(frozen=True, slots=True)
class RequestView:
    """Per-pending-request state: where it is, how long its context is, whether it runs."""

    rid: I64
    replica: I64
    prompt: I64
    generated: I64
    running: NDArray[np.bool_]

    def __post_init__(self) -> None:
        for f in ("rid", "replica", "prompt", "generated"):
            object.__setattr__(self, f, _frozen(f, getattr(self, f), np.int64))
        object.__setattr__(self, "running", _frozen("running", self.running, np.bool_))
        n = len(self.rid)
        for f in ("replica", "prompt", "generated", "running"):
            if len(getattr(self, f)) != n:
                raise ConfigError(
                    f"RequestView.{f} has {len(getattr(self, f))} entries, rid has {n}"
                )

    def __len__(self) -> int:
        return len(self.rid)

    @property
    def context(self) -> I64:
        """Tokens of KV a request holds (or must rebuild): prompt + generated."""
        return self.prompt + self.generated


@final
@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The generation cluster at time ``t`` of step ``step``.

    ``node_mode[n]`` indexes ``modes`` (``-1``: node off or lent to another stage);
    ``total``/``finished`` count the requests of the step, so ``finished / total`` is how far
    the step's wave has progressed.
    """

    t: float
    step: int
    total: int
    finished: int
    modes: tuple[ParallelMode, ...]
    node_mode: I64
    node_gpus: I64
    replicas: ReplicaView
    requests: RequestView

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_mode", _frozen("node_mode", self.node_mode, np.int64))
        object.__setattr__(self, "node_gpus", _frozen("node_gpus", self.node_gpus, np.int64))

    @property
    def progress(self) -> float:
        return self.finished / self.total if self.total else 1.0

    def validate(self) -> None:
        """Raise :class:`ConfigError` unless the invariants in the module docstring hold."""
        n_nodes, n_rep, m = len(self.node_mode), len(self.replicas), len(self.modes)
        if len(self.node_gpus) != n_nodes:
            raise ConfigError("ClusterSnapshot.node_gpus and node_mode differ in length")
        if np.any(self.node_mode >= m) or np.any(self.node_mode < -1):
            raise ConfigError(f"node_mode must index modes (0..{m - 1}) or be -1")
        r = self.replicas
        if np.any((r.node < 0) | (r.node >= n_nodes)):
            raise ConfigError(f"ReplicaView.node must index nodes (0..{n_nodes - 1})")
        if np.any(r.mode >= m) or np.any(r.mode < -1):
            raise ConfigError(f"ReplicaView.mode must index modes (0..{m - 1}) or be -1")
        q = self.requests
        if np.any((q.replica < 0) | (q.replica >= n_rep)):
            raise ConfigError(f"RequestView.replica must index replicas (0..{n_rep - 1})")
        run = np.bincount(q.replica[q.running], minlength=n_rep)
        wait = np.bincount(q.replica[~q.running], minlength=n_rep)
        if not (np.array_equal(run, r.running) and np.array_equal(wait, r.waiting)):
            raise ConfigError("ReplicaView.running/waiting disagree with RequestView")

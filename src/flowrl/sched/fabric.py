"""RFabric (OrchestrRL §5): an optical core reconfigured in the slack between traffic phases.

The fabric is modelled at PoD level. Each PoD (``pod_gpus`` GPUs behind electrical ToR and
aggregation switches) has ``uplinks`` core-facing ports of ``link_bw`` bytes/s each; a
:class:`Topology` says how many of them go to the electrical (EPS) core — shared, packet
switched, always on — and how many optical circuits join each pair of PoDs (``circuits[p,
q]``, symmetric, at most ``uplinks - eps_ports`` per PoD, each ``link_bw`` per direction).
Intra-PoD traffic (TP, PP, EP within a PoD) is the same under every fabric and not modelled.

- Traffic phases (the paper's Table 1, the parts that cross the core): ``train`` — DP
  gradient all-reduce among the training PoDs (each sends ``2 (P_T - 1) / P_T`` of the
  gradient bytes, spread evenly); ``sync`` — weight broadcast, each generation PoD receives
  the weights once, from the training PoDs evenly (the multicast tree's inter-PoD edges).
  Generation traffic stays inside its PoDs (TP, EP, AFD) and the responses streamed back are
  small: the EPS ports carry them. :func:`phase_demand` builds each PoD-by-PoD byte matrix.
  Two more kinds of traffic cross the core during generation and run over the circuits in
  place: ``kv`` — KV caches of requests the balancer migrates between generation PoDs
  (each sends its bytes evenly to the other generation PoDs), which the train layout's
  generation mesh serves; ``hub`` — the data hub's rollout columns, from the generation
  PoDs that produce them to the training PoDs that consume them (evenly), which ride the
  EPS slice (the paper's "small slice of core bandwidth ... for streaming of generated
  responses back to Train PoDs").
- Templates (Figure 8): :func:`template` gives the paper's circuit layout per phase —
  a uniform mesh over the training PoDs (train), a bipartite tree from training to
  generation PoDs (sync). In asynchronous RL the next step's generation runs while
  training trains, and the training mesh leaves the generation PoDs' optical ports idle:
  the train layout gives them a mesh among the generation PoDs, which carries the KV of
  requests migrated between generation instances (the paper materializes a generation
  topology "once before a new parallel deployment" and keeps it for the deployment). The
  sync tree takes every optical port; once the weights have landed
  (:meth:`FabricPolicy.record_end`) the policy lays the train layout again, so the
  generation keeps its circuits for all but the sync's seconds.
  :func:`materialize` (ours) instead derives circuits from the phase's demand matrix:
  repeatedly give one more circuit to the PoD pair whose transfer currently ends last
  (``demand / capacity``), within each PoD's port budget — the layout the bottleneck asks
  for, which equals the template where the template is right and differs where demand is
  uneven (e.g. unequal numbers of training and generation PoDs).
- :func:`transfer_time` — the estimate a policy plans with: per PoD pair, demand over its
  circuits plus its fair share of the EPS ports of both ends (the simulator's flow-level
  model, :mod:`flowrl.sim.network`, is the reference).
- :class:`FabricPolicy` — subscribes to the hub's events (``Claimed`` and ``Acked`` of the
  training task, ``VersionPublished``). First it profiles: the gap between the event that
  precedes a phase (``Claimed`` for training's all-reduce, ``Acked`` — backward done — for
  the weight sync) and the phase's traffic is its *slack* (the paper's Stage 1). Then, at
  that event, it decides whether to reconfigure for the coming phase (Stage 2, lookahead).
  The paper's rule (``rule="slack"``): reconfigure when the predicted slack covers the OCS
  delay, else keep the circuits. Ours (``rule="benefit"``): compare three steady regimes by
  their network time per step — alternating per-phase layouts (transfers + the delay the
  slacks do not hide), one *blended* layout materialized for both phases' summed demand
  and then left alone, or the current layout — and steer to the cheapest; when alternating,
  a phase reconfigures only if it saves more than its unhidden delay. A slow OCS (delay
  above the slacks) thus gets one blended layout, laid in the largest slack, instead of a
  core that stays wrong for one of the phases.

Invariants (asserted by tests): every topology respects the port budget and is symmetric;
:func:`materialize` never does worse than the template on its own demand
(:func:`transfer_time`); the policy never schedules a reconfiguration whose delay exceeds
the slack under the slack rule; decisions depend only on the events seen.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Literal, final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.events import Acked, Claimed, VersionPublished

__all__ = [
    "FabricDecision",
    "FabricPolicy",
    "FabricSpec",
    "Topology",
    "materialize",
    "phase_demand",
    "template",
    "transfer_time",
]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
Phase = Literal["train", "sync"]
PHASES: tuple[Phase, ...] = ("train", "sync")
#: a boundary the policy decides at: before a phase, or "gen" once the weights landed
Boundary = Literal["train", "sync", "gen"]
Traffic = Literal["train", "sync", "kv", "hub"]
TRAFFIC: tuple[Traffic, ...] = (*PHASES, "kv", "hub")


@final
class FabricSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A cluster's fabric: ``gpus`` in PoDs of ``pod_gpus``, the first ``train_pods`` train.

    ``uplinks`` core ports per PoD of ``link_bw`` bytes/s (400 Gb/s: 50e9); ``eps_ports`` of
    them go to the electrical core (all of them: a static fat-tree; fewer: oversubscribed),
    the rest to the optical core, which changes circuits in ``ocs_delay_s`` (switching +
    traffic steering)."""

    gpus: int
    pod_gpus: int = 256
    train_pods: int = 0
    uplinks: int = 256
    eps_ports: int = 256
    link_bw: float = 50e9
    ocs_delay_s: float = 0.05

    def __post_init__(self) -> None:
        if self.pod_gpus < 1 or self.gpus < 2 * self.pod_gpus or self.gpus % self.pod_gpus:
            raise ConfigError(
                f"FabricSpec.gpus={self.gpus} must be a multiple (>= 2) of pod_gpus={self.pod_gpus}"
            )
        if not 0 <= self.eps_ports <= self.uplinks or self.uplinks < 1:
            raise ConfigError(
                f"FabricSpec needs 0 <= eps_ports <= uplinks, got {self.eps_ports}, {self.uplinks}"
            )
        if not 0 <= self.train_pods < self.pods:
            raise ConfigError(
                f"FabricSpec.train_pods must lie in [0, {self.pods}), got {self.train_pods}"
            )
        if self.link_bw <= 0 or self.ocs_delay_s < 0:
            raise ConfigError("FabricSpec needs link_bw > 0 and ocs_delay_s >= 0")

    @property
    def pods(self) -> int:
        return self.gpus // self.pod_gpus

    @property
    def n_train(self) -> int:
        """Training PoDs (``train_pods``, default half)."""
        return self.train_pods or self.pods // 2

    @property
    def ocs_ports(self) -> int:
        return self.uplinks - self.eps_ports


@final
@dataclass(frozen=True)
class Topology:
    """Circuits between PoD pairs (symmetric, zero diagonal) and EPS ports per PoD."""

    circuits: I64
    eps_ports: int
    name: str = ""

    def check(self, spec: FabricSpec) -> None:
        c = self.circuits
        if c.shape != (spec.pods, spec.pods) or (c != c.T).any() or np.diag(c).any():
            raise ConfigError("a topology's circuits must be a symmetric PoD matrix, zero diagonal")
        if (c < 0).any() or (c.sum(axis=1) > spec.ocs_ports).any():
            raise ConfigError(
                f"a topology uses more than the {spec.ocs_ports} optical ports of a PoD"
            )


def empty(spec: FabricSpec, name: str = "static") -> Topology:
    return Topology(np.zeros((spec.pods, spec.pods), dtype=np.int64), spec.eps_ports, name)


def phase_demand(spec: FabricSpec, phase: Traffic, nbytes: float) -> F64:
    """Inter-PoD bytes of a kind of traffic (module docstring); ``nbytes``: gradient bytes
    (train), weight bytes (sync), bytes each generation PoD sends (kv, hub)."""
    p, t = spec.pods, spec.n_train
    g = p - t
    d = np.zeros((p, p))
    train, gen = slice(0, t), slice(t, p)
    if phase == "train":
        if t > 1:
            d[train, train] = 2.0 * nbytes / t  # each sends 2 (t-1)/t of it, evenly
            np.fill_diagonal(d, 0.0)
    elif phase == "sync":
        d[train, gen] = nbytes / t  # every generation PoD receives the weights once
    elif phase == "kv":
        if g > 1:
            d[gen, gen] = nbytes / (g - 1)  # migrations between generation PoDs, evenly
            np.fill_diagonal(d, 0.0)
    elif phase == "hub":
        d[gen, train] = nbytes / t  # rollouts to the trainers that consume them
    else:
        raise ConfigError(f"unknown traffic {phase!r}; expected one of {TRAFFIC}")
    return d


def _spread(spec: FabricSpec, rows: range, cols: range, ports: int, c: I64) -> None:
    """Give each PoD in ``rows`` up to ``ports`` circuits spread evenly over ``cols``."""
    for r in rows:
        targets = [q for q in cols if q != r]
        if not targets:
            continue
        for k in range(ports):  # start at a row-dependent offset: no hot first targets
            q = targets[(r + k) % len(targets)]
            if c[r].sum() < spec.ocs_ports and c[q].sum() < spec.ocs_ports:
                c[r, q] += 1
                c[q, r] += 1


def template(spec: FabricSpec, phase: Phase) -> Topology:
    """The paper's circuit template for a phase (Figure 8)."""
    c = np.zeros((spec.pods, spec.pods), dtype=np.int64)
    t, p, k = spec.n_train, spec.pods, spec.ocs_ports
    if phase == "train":  # high-bisection mesh among training PoDs; the generation PoDs,
        # generating meanwhile, get a mesh among themselves for migrated requests' KV
        _spread(spec, range(t), range(t), k // 2, c)
        _spread(spec, range(t, p), range(t, p), k // 2, c)
    elif phase == "sync":  # tree: every training PoD to the generation PoDs
        _spread(spec, range(t), range(t, p), k, c)
    else:
        raise ConfigError(f"unknown phase {phase!r}; expected one of {PHASES}")
    return Topology(c, spec.eps_ports, f"template:{phase}")


def transfer_time(spec: FabricSpec, topo: Topology, demand: F64) -> float:
    """Estimated seconds to move ``demand``: per pair, bytes over (its circuits + its share
    of both ends' EPS ports, split among the pairs each end talks to over EPS)."""
    if not (demand > 0).any():
        return 0.0
    bw = spec.link_bw
    live = demand > 0
    out_n = np.maximum(live.sum(axis=1), 1)
    in_n = np.maximum(live.sum(axis=0), 1)
    eps = topo.eps_ports * bw * np.minimum(1.0 / out_n[:, None], 1.0 / in_n[None, :])
    cap = topo.circuits * bw + eps
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(live, demand / cap, 0.0)
    return float(np.max(t))


def materialize(spec: FabricSpec, demand: F64, name: str = "materialized") -> Topology:
    """Circuits for ``demand`` (ours): each pair first gets its proportional share of the
    busier end's ports, then one circuit at a time goes to the pair whose transfer ends last
    (a heap, lazily dropping pairs whose ends have no port left)."""
    p = spec.pods
    k = spec.ocs_ports
    sym = np.maximum(demand, demand.T)
    np.fill_diagonal(sym, 0.0)
    c = np.zeros((p, p), dtype=np.int64)
    if k == 0 or not (sym > 0).any():
        return Topology(c, spec.eps_ports, name)
    rows = sym.sum(axis=1)
    busier = np.maximum(rows[:, None], rows[None, :])
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(sym > 0, np.floor(k * sym / busier), 0).astype(np.int64)
    live = sym > 0
    out_n = np.maximum(live.sum(axis=1), 1)
    eps = spec.eps_ports * spec.link_bw / np.maximum(out_n[:, None], out_n[None, :])
    used = c.sum(axis=1)
    bw = spec.link_bw

    def finish(i: int, j: int) -> float:
        return float(sym[i, j] / (c[i, j] * bw + eps[i, j]))

    heap = [
        (-finish(int(i), int(j)), int(i), int(j))
        for i, j in zip(*np.nonzero(np.triu(live)), strict=True)
    ]
    heapq.heapify(heap)
    while heap:
        _, i, j = heapq.heappop(heap)
        if used[i] >= k or used[j] >= k:
            continue  # an end is out of ports: this pair cannot grow any more
        c[i, j] += 1
        c[j, i] += 1
        used[i] += 1
        used[j] += 1
        heapq.heappush(heap, (-finish(i, j), i, j))
    return Topology(c, spec.eps_ports, name)


@final
@dataclass(frozen=True, slots=True)
class FabricDecision:
    """At ``t``, before ``phase``: reconfigure (or not) given the predicted ``slack``;
    ``stall`` is the part of the OCS delay the slack does not hide."""

    t: float
    phase: Boundary
    reconfigure: bool
    slack: float
    stall: float
    saved: float


@final
@dataclass
class FabricPolicy:
    """The fabric coordinator: observe hub events, decide reconfigurations (see module doc).

    ``volumes`` gives each phase's bytes (gradient, weight) and, under ``"kv"``, the KV
    bytes each generation PoD migrates per step (the demand materializer gives them
    circuits in the train layout; the template always meshes the generation PoDs).
    ``critical`` names the phases whose transfers delay the step, which the benefit rule
    weighs (with one-step off-policy RL the weight sync has a step of slack: pass
    ``("train",)``). Call
    :meth:`observe` with every hub event; :meth:`decisions` lists what was decided, and
    :attr:`topology` is the circuit plan in force."""

    spec: FabricSpec
    volumes: dict[str, float]
    rule: Literal["slack", "benefit"] = "slack"
    materializer: Literal["template", "demand"] = "template"
    critical: tuple[Phase, ...] = PHASES
    train_task: str = "train"
    topology: Topology = field(init=False)
    _slack: dict[str, float] = field(default_factory=dict, init=False)
    _last: dict[str, float] = field(default_factory=dict, init=False)
    _decisions: list[FabricDecision] = field(default_factory=list, init=False)
    _plans: dict[str, Topology] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not set(self.critical) <= set(PHASES):
            raise ConfigError(f"FabricPolicy.critical must name phases of {PHASES}")
        if self.rule not in ("slack", "benefit") or self.materializer not in ("template", "demand"):
            raise ConfigError(
                f"FabricPolicy rule must be 'slack' or 'benefit' and materializer 'template' or "
                f"'demand', got {self.rule!r}, {self.materializer!r}"
            )
        self.topology = self.plan("train")

    def plan(self, phase: Phase) -> Topology:
        """The circuit plan this policy materializes for ``phase`` (computed once, cached,
        like the paper's per-job cache of phase mappings)."""
        if phase not in self._plans:
            if self.materializer == "template":
                self._plans[phase] = template(self.spec, phase)
            else:
                d = self._demand(phase)
                if phase == "train":  # generation runs meanwhile: its KV moves get circuits
                    d = d + self._kv_demand()
                self._plans[phase] = materialize(self.spec, d, f"demand:{phase}")
        return self._plans[phase]

    # The event that precedes each phase; the gap to the phase's traffic is its slack.
    _BEFORE = {"sync": "trained", "train": "claimed"}

    def observe(self, event: object) -> None:
        if isinstance(event, Acked) and event.task == self.train_task:
            self._mark("trained", event.t)
            self._before("sync", event.t)
        elif isinstance(event, VersionPublished):
            self._start("sync", event.t)
        elif isinstance(event, Claimed) and event.task == self.train_task:
            self._mark("claimed", event.t)
            self._before("train", event.t)

    def record_start(self, phase: Phase, t: float) -> None:
        """Tell the policy when a phase's traffic began (events that the hub does not carry,
        e.g. the first gradient all-reduce); used to learn the slack."""
        self._start(phase, t)

    def record_end(self, phase: Phase, t: float) -> None:
        """Tell the policy when a phase's traffic ended (no hub event says when the weights
        landed). After the sync the generation PoDs get their circuits back: the train
        layout is laid again, its delay hidden in the generation (no phase waits on it; the
        circuits both layouts share stay up meanwhile). Under the benefit rule only when it
        alternates layouts, and only where that speeds up the KV moves."""
        if phase != "sync" or "sync" not in self._slack:
            return  # profiling step: the sync kept the circuits in place
        target = self.plan("train")
        if np.array_equal(target.circuits, self.topology.circuits):
            return
        steady = self.rule == "benefit" and len(self._slack) == len(PHASES)
        if steady and self._regime() != "alternate":
            return
        kv = self._kv_demand()
        saved = transfer_time(self.spec, self.topology, kv) - transfer_time(self.spec, target, kv)
        go = self.rule == "slack" or saved > 0.0
        self._decisions.append(FabricDecision(t, "gen", go, math.inf, 0.0, saved))
        if go:
            self.topology = target

    def _mark(self, name: str, t: float) -> None:
        self._last[name] = t

    def _start(self, phase: Phase, t: float) -> None:
        before = self._BEFORE[phase]
        if before in self._last and phase not in self._slack:
            self._slack[phase] = max(0.0, t - self._last[before])  # profiled once, then cached

    def _before(self, phase: Phase, t: float) -> None:
        if phase not in self._slack:  # profiling step: no prediction yet, keep the circuits
            return
        slack = self._slack[phase]
        stall = max(0.0, self.spec.ocs_delay_s - slack)
        target = self.plan(phase)
        if self.rule == "benefit" and len(self._slack) == len(PHASES):
            regime = self._regime()
            if regime == "stay":
                return
            if regime == "blend":
                target = self._blend()
        if np.array_equal(target.circuits, self.topology.circuits):
            return
        demand = self._demand(phase)
        saved = transfer_time(self.spec, self.topology, demand) - transfer_time(
            self.spec, target, demand
        )
        if self.rule == "slack":
            go = stall == 0.0
        else:  # a blend is laid once: it pays back over the steps, not on this phase
            go = saved > stall or target is self._plans.get("blend")
        self._decisions.append(FabricDecision(t, phase, go, slack, stall if go else 0.0, saved))
        if go:
            self.topology = target

    def _demand(self, phase: Phase) -> F64:
        return phase_demand(self.spec, phase, self.volumes.get(phase, 0.0))

    def _kv_demand(self) -> F64:
        return phase_demand(self.spec, "kv", self.volumes.get("kv", 0.0))

    def _blend(self) -> Topology:
        """One layout for both phases and the generation's KV moves: circuits for their
        summed demand."""
        if "blend" not in self._plans:
            total = sum(self._demand(p) for p in PHASES) + self._kv_demand()
            self._plans["blend"] = materialize(self.spec, np.asarray(total), "demand:blend")
        return self._plans["blend"]

    def _regime(self) -> Literal["alternate", "blend", "stay"]:
        """Per-step network time of the three steady regimes (transfers + unhidden delay of
        the ``critical`` phases): alternate per-phase layouts, one blended layout, or the
        current layout."""
        delay = self.spec.ocs_delay_s

        def cost(layout: dict[Phase, Topology]) -> float:
            return sum(transfer_time(self.spec, layout[p], self._demand(p)) for p in self.critical)

        alternate = cost({p: self.plan(p) for p in PHASES}) + sum(
            max(0.0, delay - self._slack[p]) for p in self.critical
        )
        blend = cost({p: self._blend() for p in PHASES})
        stay = cost({p: self.topology for p in PHASES})
        best = min(alternate, blend, stay)
        if best == stay:
            return "stay"
        return "alternate" if best == alternate else "blend"

    def decisions(self) -> list[FabricDecision]:
        return list(self._decisions)

    @property
    def reconfigurations(self) -> int:
        return sum(d.reconfigure for d in self._decisions)

    def slack(self, phase: Phase) -> float:
        """The profiled slack before ``phase`` (``nan`` until seen)."""
        return self._slack.get(phase, math.nan)

"""Flow-level network model and an RL step loop that drives a fabric policy by hub events.

- :func:`flow_time` — seconds to move a PoD-by-PoD byte matrix over a
  :class:`~flowrl.sched.fabric.Topology`: every PoD pair with bytes to send is one flow;
  its rate is its circuits' bandwidth (dedicated) plus a max-min fair share of the EPS core
  (each PoD's ``eps_ports * link_bw`` out and in, shared by progressive filling); rates are
  recomputed whenever a flow finishes, until all have.
- :func:`run_fabric` — asynchronous RL at the granularity of the phases that cross the core:
  generation of step ``s`` (``gen_s``, inside its PoDs) needs the weights of step ``s - 1 -
  staleness`` (``staleness=1``: one-step off-policy, the weight sync off the critical path;
  ``0``: on-policy, generation waits for it); training of step ``s`` starts when its
  rollouts are done and training of ``s - 1`` has ended, computes ``train_s`` and starts its
  gradient all-reduce ``first_comm_s`` in; a share ``1 - overlap`` of the all-reduce (the
  last buckets) runs after the backward, the rest overlaps it; ``optimizer_s`` after the
  backward the weights are published and broadcast to the generation PoDs. The hub's events
  (``Claimed`` and ``Acked`` of ``train``, ``VersionPublished``) go to the policy, which
  reconfigures the optical core; a reconfiguration the slack does not hide stalls the phase.
  When a weight sync's transfer ends the loop tells the policy (``record_end``), which may
  give the generation PoDs their circuits back. Static fabrics run the same loop with fixed
  circuits. During each generation the balancer's KV migrations (``kv_bytes`` per
  generation PoD) and the data hub's rollout traffic (``hub_bytes``) cross the core over
  the circuits in place, which may change during the generation: their transfer time is
  that of the step's bytes at the generation window's time-averaged capacity
  (``1 / sum_i (share_i / flow_time_i)`` over the layouts in force, a layout being
  switched counting only the circuits it keeps). The bytes spread over the generation,
  which hides them: the figure is the fabric's capacity for them, not a delay of the step.

Invariants (asserted by tests): ``flow_time`` equals bytes/bandwidth for a single flow and
never exceeds the time with the EPS alone; a non-blocking fabric (``eps_ports ==
uplinks``) is never slower than an oversubscribed one; events reach the policy in
non-decreasing ``t``; runs are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.events import Acked, Claimed, VersionPublished
from flowrl.sched.fabric import FabricPolicy, FabricSpec, Topology, phase_demand

__all__ = ["FabricRun", "FabricWorkload", "flow_time", "run_fabric"]

F64 = NDArray[np.float64]


def _max_min(src: NDArray[np.int64], dst: NDArray[np.int64], cap: float, pods: int) -> F64:
    """Max-min fair rates of flows ``src -> dst`` over per-PoD EPS capacity ``cap`` (out, in)."""
    rate = np.zeros(len(src))
    left_out = np.full(pods, cap)
    left_in = np.full(pods, cap)
    frozen = np.zeros(len(src), dtype=bool)
    while not frozen.all() and cap > 0:
        live = ~frozen
        n_out = np.bincount(src[live], minlength=pods)
        n_in = np.bincount(dst[live], minlength=pods)
        share = min(
            np.min(np.divide(left_out, n_out, out=np.full(pods, np.inf), where=n_out > 0)),
            np.min(np.divide(left_in, n_in, out=np.full(pods, np.inf), where=n_in > 0)),
        )
        rate[live] += share
        left_out -= share * n_out
        left_in -= share * n_in
        full_out = left_out <= cap * 1e-12
        full_in = left_in <= cap * 1e-12
        frozen |= full_out[src] | full_in[dst]
    return rate


def flow_time(spec: FabricSpec, topo: Topology, demand: F64) -> float:
    """Seconds until every PoD pair has moved its bytes (flow-level, max-min fair EPS)."""
    src, dst = np.nonzero(demand > 0)
    if len(src) == 0:
        return 0.0
    left = demand[src, dst].astype(np.float64)
    direct = topo.circuits[src, dst] * spec.link_bw
    eps_cap = topo.eps_ports * spec.link_bw
    t = 0.0
    alive = np.ones(len(src), dtype=bool)
    while alive.any():
        rate = np.zeros(len(src))
        rate[alive] = direct[alive] + _max_min(src[alive], dst[alive], eps_cap, spec.pods)
        if not (rate[alive] > 0).all():
            return float("inf")  # a flow with no path
        dt = float(np.min(left[alive] / rate[alive]))
        t += dt
        left[alive] -= rate[alive] * dt
        alive &= left > 1e-9 * demand[src, dst]
    return t


@final
class FabricWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Per-step times (seconds) and volumes (bytes) of the phases that use the core.

    ``kv_bytes`` and ``hub_bytes`` are what each generation PoD sends per step. Defaults, a
    72B dense model on 256-GPU PoDs: 8 k requests per PoD, 3 % migrated (the simulator's
    balancer), 4 k tokens of context at 320 KB of KV per token -> 335 GB; the hub carries
    token ids and three log-prob columns, 16 bytes a token over 4 k tokens -> 0.5 GB.
    """

    gen_s: float = 120.0
    train_s: float = 90.0
    first_comm_s: float = 5.0
    overlap: float = 0.5
    optimizer_s: float = 2.0
    grad_bytes: float = 144e9
    weight_bytes: float = 144e9
    kv_bytes: float = 335e9
    hub_bytes: float = 0.5e9
    staleness: int = 1
    steps: int = 6

    def __post_init__(self) -> None:
        if min(self.gen_s, self.train_s, self.first_comm_s, self.optimizer_s) < 0:
            raise ConfigError("FabricWorkload times must be >= 0")
        if min(self.grad_bytes, self.weight_bytes, self.kv_bytes, self.hub_bytes) < 0:
            raise ConfigError("FabricWorkload volumes must be >= 0")
        if not 0 <= self.overlap <= 1 or self.steps < 3 or self.staleness < 0:
            raise ConfigError(
                "FabricWorkload needs 0 <= overlap <= 1, steps >= 3 and staleness >= 0"
            )


@final
@dataclass(frozen=True, slots=True)
class FabricRun:
    """``step_s``: mean time per step over the steady steps (after the first two);
    ``sync_s``/``allreduce_s``/``kv_s``/``hub_s``: mean transfer times (weight sync, gradient
    all-reduce, KV migration, data-hub traffic); ``stall_s``: reconfiguration time the
    slack did not hide; ``slack_used_s``: reconfiguration time the slack did hide;
    ``eps_ports``/``ocs_ports``: core ports per PoD on the electrical and optical cores (a
    static fabric without circuits has no optical core: 0)."""

    fabric: str
    step_s: float
    sync_s: float
    allreduce_s: float
    kv_s: float
    hub_s: float
    exposed_s: float
    reconfigurations: int
    stall_s: float
    slack_used_s: float
    eps_ports: int
    ocs_ports: int


def _topology_of(policy: FabricPolicy | None, static: Topology | None) -> Topology:
    """The circuits in force: the policy's, else the static layout."""
    if policy is not None:
        return policy.topology
    if static is None:
        raise ConfigError("run_fabric needs exactly one of policy= or static=")
    return static


class _Layouts:
    """The layouts in force over time, for the traffic that runs during generation."""

    def __init__(self, spec: FabricSpec, first: Topology) -> None:
        self.spec = spec
        self.starts: list[float] = [0.0]
        self.topos: list[Topology] = [first]

    def note(self, t: float, topo: Topology) -> None:
        """``topo`` is in force from ``t`` (after the OCS delay; meanwhile only the circuits
        the old and new layouts share are up)."""
        while len(self.starts) > 1 and self.starts[-1] > t:  # a switch cut short
            self.starts.pop()
            self.topos.pop()
        old = self.topos[-1]
        if np.array_equal(old.circuits, topo.circuits):
            return
        delay = self.spec.ocs_delay_s
        if delay > 0:
            kept = Topology(np.minimum(old.circuits, topo.circuits), topo.eps_ports, "switching")
            self.starts.append(t)
            self.topos.append(kept)
        self.starts.append(t + delay)
        self.topos.append(topo)

    def mean_flow_time(self, demand: F64, t0: float, t1: float) -> float:
        """Seconds to move ``demand`` at the mean capacity the layouts offer in [t0, t1]."""
        if t1 <= t0:  # an instant: the layout in force then
            t1 = t0 + 1e-9
        ends = [*self.starts[1:], math.inf]
        rate = 0.0
        for start, end, topo in zip(self.starts, ends, self.topos, strict=True):
            share = max(0.0, min(end, t1) - max(start, t0)) / (t1 - t0)
            if share > 0:
                ft = flow_time(self.spec, topo, demand)
                if ft == 0.0:
                    return 0.0
                rate += share / ft
        return 1.0 / rate if rate > 0 else math.inf


def run_fabric(
    spec: FabricSpec,
    work: FabricWorkload,
    *,
    policy: FabricPolicy | None = None,
    static: Topology | None = None,
    name: str = "",
) -> FabricRun:
    """Run ``work.steps`` steps under a policy (reconfiguring) or a ``static`` topology."""
    if (policy is None) == (static is None):
        raise ConfigError("run_fabric needs exactly one of policy= or static=")
    seq = 0
    clock = 0.0
    layouts = _Layouts(spec, _topology_of(policy, static))
    weights_landed: list[float] = []  # the sync end not yet told to the policy

    def tell_sync_ends(upto: float) -> None:
        while policy is not None and weights_landed and weights_landed[0] <= upto:
            t = weights_landed.pop(0)
            policy.record_end("sync", t)
            layouts.note(t, policy.topology)

    def emit(ev: Claimed | Acked | VersionPublished) -> None:
        nonlocal clock
        t = ev.t
        if t < clock:  # pragma: no cover - the loop below emits in time order
            raise AssertionError("events out of order")
        clock = t
        tell_sync_ends(t)
        if policy is not None:
            policy.observe(ev)
            layouts.note(t, policy.topology)

    def topology() -> Topology:
        return _topology_of(policy, static)

    def stall_for(phase: str, since: int) -> float:
        if policy is None:
            return 0.0
        return sum(d.stall for d in policy.decisions()[since:] if d.phase == phase)

    grad = phase_demand(spec, "train", work.grad_bytes)
    weights = phase_demand(spec, "sync", work.weight_bytes)
    kv = phase_demand(spec, "kv", work.kv_bytes)
    hub = phase_demand(spec, "hub", work.hub_bytes)
    gen_end: list[float] = []
    sync_end: list[float] = []
    train_end = 0.0
    syncs, reduces, exposed_all, stalls, ends = [], [], [], [], []
    windows = []
    for s in range(work.steps):
        start = gen_end[-1] if gen_end else 0.0
        if s > work.staleness:  # generation of s uses the weights of step s - 1 - staleness
            start = max(start, sync_end[s - 1 - work.staleness])
        gen_end.append(start + work.gen_s)
        windows.append((start, gen_end[-1]))
        t0 = max(gen_end[s], train_end)
        seq += 1
        n_dec = len(policy.decisions()) if policy is not None else 0
        emit(Claimed(seq=seq, t=t0, task="train", lease=s, indices=()))
        st_train = stall_for("train", n_dec)
        comm_start = t0 + work.first_comm_s + st_train
        if policy is not None:
            policy.record_start("train", t0 + work.first_comm_s)
        reduce = flow_time(spec, topology(), grad)
        backward_end = max(t0 + work.train_s + (1.0 - work.overlap) * reduce, comm_start + reduce)
        exposed = backward_end - t0 - work.train_s
        seq += 1
        n_dec = len(policy.decisions()) if policy is not None else 0
        emit(Acked(seq=seq, t=backward_end, task="train", lease=s, indices=()))
        st_sync = stall_for("sync", n_dec)
        publish = backward_end + work.optimizer_s
        train_end = publish
        seq += 1
        emit(VersionPublished(seq=seq, t=publish, version=s))
        sync = flow_time(spec, topology(), weights)
        sync_end.append(publish + st_sync + sync)
        weights_landed.append(sync_end[-1])
        syncs.append(sync)
        reduces.append(reduce)
        exposed_all.append(exposed)
        stalls.append(st_train + st_sync)
        ends.append(max(train_end, sync_end[-1]))
    tell_sync_ends(float("inf"))
    done = policy.decisions() if policy is not None else []
    hidden = sum(min(spec.ocs_delay_s, d.slack) for d in done if d.reconfigure)
    kvs = [layouts.mean_flow_time(kv, *w) for w in windows]
    hubs = [layouts.mean_flow_time(hub, *w) for w in windows]
    steady = slice(2, None)
    span = (ends[-1] - ends[1]) / (work.steps - 2)
    label = name or (topology().name if static is not None else "policy")
    return FabricRun(
        fabric=label,
        step_s=span,
        sync_s=float(np.mean(syncs[steady])),
        allreduce_s=float(np.mean(reduces[steady])),
        kv_s=float(np.mean(kvs[steady])),
        hub_s=float(np.mean(hubs[steady])),
        exposed_s=float(np.mean(exposed_all[steady])),
        reconfigurations=policy.reconfigurations if policy is not None else 0,
        stall_s=float(np.sum(stalls)),
        slack_used_s=float(hidden),
        eps_ports=spec.eps_ports,
        ocs_ports=spec.ocs_ports if policy is not None or topology().circuits.any() else 0,
    )

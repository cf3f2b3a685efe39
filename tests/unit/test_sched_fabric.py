"""Invariants of RFabric (topologies, templates, materialization, the slack-aware policy)
and of the simulator's flow-level network model and fabric loop."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.events import Acked, Claimed, VersionPublished
from flowrl.sched import (
    FabricPolicy,
    FabricSpec,
    Topology,
    materialize,
    phase_demand,
    template,
    transfer_time,
)
from flowrl.sched.fabric import empty
from flowrl.sim import FabricWorkload, flow_time, run_fabric

VOLUMES = {"train": 144e9, "sync": 144e9}


@pytest.mark.parametrize("gpus,train_pods", [(1024, 0), (4096, 0), (8192, 8), (16384, 40)])
def test_topologies_respect_ports_and_materialize_beats_templates(
    gpus: int, train_pods: int
) -> None:
    spec = FabricSpec(gpus=gpus, eps_ports=32, train_pods=train_pods)
    for phase in ("train", "sync"):
        demand = phase_demand(spec, phase, 144e9)  # type: ignore[arg-type]
        ours = materialize(spec, demand)
        paper = template(spec, phase)  # type: ignore[arg-type]
        for topo in (ours, paper):
            topo.check(spec)
        assert transfer_time(spec, ours, demand) <= transfer_time(spec, paper, demand) + 1e-12
        assert flow_time(spec, ours, demand) <= flow_time(spec, empty(spec), demand) + 1e-12


def test_phase_demands_have_the_expected_volumes() -> None:
    spec = FabricSpec(gpus=2048)  # 8 PoDs, 4 train
    grad = phase_demand(spec, "train", 100.0)
    assert grad[:4, :4].sum(axis=1) == pytest.approx([150.0] * 4)  # 2 (t-1)/t of it
    assert grad[4:].sum() == 0 and np.diag(grad).sum() == 0
    sync = phase_demand(spec, "sync", 100.0)
    assert sync.sum(axis=0)[4:] == pytest.approx([100.0] * 4)  # each gen PoD gets it once
    assert sync[:, :4].sum() == 0


def test_generation_traffic_demands_have_the_expected_volumes() -> None:
    spec = FabricSpec(gpus=2048)  # 8 PoDs, 4 train
    kv = phase_demand(spec, "kv", 90.0)
    assert kv[4:, 4:].sum(axis=1) == pytest.approx([90.0] * 4)  # each gen PoD sends its bytes
    assert kv[:4].sum() == 0 and kv[:, :4].sum() == 0 and np.diag(kv).sum() == 0
    hub = phase_demand(spec, "hub", 80.0)
    assert hub[4:, :4].sum(axis=1) == pytest.approx([80.0] * 4)  # rollouts to the trainers
    assert hub[:4].sum() == 0 and hub[:, 4:].sum() == 0
    with pytest.raises(ConfigError, match="unknown traffic"):
        phase_demand(spec, "gen", 1.0)  # type: ignore[arg-type]


def test_generation_traffic_runs_over_the_circuits_in_place() -> None:
    """Under a static weight-sync tree KV migration between generation PoDs has only the
    EPS slice; the data hub's rollouts ride the tree."""
    work = FabricWorkload(kv_bytes=64e9, hub_bytes=64e9)
    full = FabricSpec(gpus=2048)
    hybrid = FabricSpec(gpus=2048, eps_ports=32)
    ideal = run_fabric(full, work, static=empty(full))
    sync_tree = run_fabric(hybrid, work, static=template(hybrid, "sync"))
    assert sync_tree.kv_s == pytest.approx(ideal.kv_s * 256 / 32)
    assert ideal.hub_s <= sync_tree.hub_s < ideal.hub_s * 256 / 32
    assert (ideal.eps_ports, ideal.ocs_ports) == (256, 0)
    assert (sync_tree.eps_ports, sync_tree.ocs_ports) == (32, 224)


def test_generation_pods_get_circuits_for_kv_migration() -> None:
    """The train layout meshes the generation PoDs (they generate while training trains)
    and the policies lay it back once the weights landed: KV moves ride circuits for all
    but the sync's seconds, not only the 32-port EPS slice (8x the fat-tree's time)."""
    work = FabricWorkload(kv_bytes=64e9)
    full, hybrid = FabricSpec(gpus=2048), FabricSpec(gpus=2048, eps_ports=32)
    t = hybrid.n_train
    mesh = template(hybrid, "train")
    mesh.check(hybrid)
    assert mesh.circuits[t:, t:].sum() > 0 and mesh.circuits[:t, t:].sum() == 0
    ideal = run_fabric(full, work, static=empty(full))
    eps_only = run_fabric(hybrid, work, static=empty(hybrid))
    assert eps_only.kv_s == pytest.approx(ideal.kv_s * 256 / 32)
    for policy in (
        FabricPolicy(hybrid, VOLUMES),
        FabricPolicy(hybrid, {**VOLUMES, "kv": 64e9}, rule="benefit", materializer="demand"),
    ):
        run = run_fabric(hybrid, work, policy=policy)
        assert ideal.kv_s <= run.kv_s < eps_only.kv_s / 4
        assert any(d.phase == "gen" and d.reconfigure for d in policy.decisions())


def test_flow_time_single_flow_and_fair_sharing() -> None:
    spec = FabricSpec(gpus=1024, uplinks=4, eps_ports=2, link_bw=10.0)  # 4 PoDs
    d = np.zeros((4, 4))
    d[0, 1] = 100.0
    c = np.zeros((4, 4), dtype=np.int64)
    c[0, 1] = c[1, 0] = 1
    assert flow_time(spec, Topology(c, 2), d) == pytest.approx(100.0 / 30.0)
    d2 = np.zeros((4, 4))
    d2[0, 1] = d2[0, 2] = 100.0  # two flows share PoD 0's EPS (20 B/s): 10 each
    assert flow_time(spec, empty(spec), d2) == pytest.approx(10.0)
    d2[0, 2] = 50.0  # the short one ends at 5 s, then the long one gets all 20 B/s
    assert flow_time(spec, empty(spec), d2) == pytest.approx(5.0 + 50.0 / 20.0)


def test_non_blocking_is_never_slower_than_oversubscribed() -> None:
    work = FabricWorkload(gen_s=30.0, train_s=60.0, grad_bytes=2e12, weight_bytes=2e12)
    full = run_fabric(FabricSpec(gpus=4096), work, static=empty(FabricSpec(gpus=4096)))
    thin_spec = FabricSpec(gpus=4096, eps_ports=64)
    thin = run_fabric(thin_spec, work, static=empty(thin_spec))
    assert full.step_s <= thin.step_s
    assert full.sync_s < thin.sync_s and full.allreduce_s < thin.allreduce_s


def _events(policy: FabricPolicy, steps: int, slack_sync: float, slack_train: float) -> None:
    t, seq = 0.0, 0
    for s in range(steps):
        seq += 1
        policy.observe(Claimed(seq=seq, t=t, task="train", lease=s, indices=()))
        policy.record_start("train", t + slack_train)
        t += 60.0
        seq += 1
        policy.observe(Acked(seq=seq, t=t, task="train", lease=s, indices=()))
        t += slack_sync
        seq += 1
        policy.observe(VersionPublished(seq=seq, t=t, version=s))
        t += 30.0


def test_policy_profiles_then_reconfigures_only_inside_the_slack() -> None:
    spec = FabricSpec(gpus=4096, eps_ports=32, ocs_delay_s=1.0)
    policy = FabricPolicy(spec, VOLUMES)
    _events(policy, 4, slack_sync=0.5, slack_train=5.0)
    assert policy.slack("sync") == pytest.approx(0.5)
    assert policy.slack("train") == pytest.approx(5.0)
    for d in policy.decisions():
        assert not d.reconfigure or d.slack >= spec.ocs_delay_s  # the paper's rule
    # the sync slack (0.5 s) cannot hide a 1 s OCS: the core stays a training mesh
    assert not any(d.reconfigure for d in policy.decisions() if d.phase == "sync")


def _sync_time_in_force(policy: FabricPolicy, steps: int) -> float:
    """The estimated weight-sync time under the layout in force when each sync starts."""
    spec = policy.spec
    demand = phase_demand(spec, "sync", policy.volumes["sync"])
    seen: list[float] = []
    t, seq = 0.0, 0
    for s in range(steps):
        seq += 1
        policy.observe(Claimed(seq=seq, t=t, task="train", lease=s, indices=()))
        policy.record_start("train", t + 5.0)
        t += 60.0
        seq += 1
        policy.observe(Acked(seq=seq, t=t, task="train", lease=s, indices=()))
        t += 0.5
        seq += 1
        policy.observe(VersionPublished(seq=seq, t=t, version=s))
        seen.append(transfer_time(spec, policy.topology, demand))
        t += 30.0
    return seen[-1]


@pytest.mark.parametrize("delay", [1.0, 10.0])
def test_benefit_rule_serves_a_critical_sync_that_the_slack_rule_leaves_on_the_mesh(
    delay: float,
) -> None:
    spec = FabricSpec(gpus=4096, eps_ports=32, ocs_delay_s=delay)
    volumes = {"train": 144e9, "sync": 5e12}
    paper = FabricPolicy(spec, volumes)
    ours = FabricPolicy(spec, volumes, rule="benefit", materializer="demand")
    assert _sync_time_in_force(ours, 5) < _sync_time_in_force(paper, 5)
    assert paper.reconfigurations == 0  # 0.5 s of sync slack never hides the delay
    if delay > 5.0:  # slower than every slack: one blended layout, laid once
        assert ours.reconfigurations == 1


def test_policy_runs_deterministically_and_counts_reconfigurations() -> None:
    spec = FabricSpec(gpus=2048, eps_ports=32)
    work = FabricWorkload(steps=5)
    policy = FabricPolicy(spec, VOLUMES)
    a = run_fabric(spec, work, policy=policy, name="rfabric")
    b = run_fabric(spec, work, policy=FabricPolicy(spec, VOLUMES), name="rfabric")
    assert a == b
    # step 0 profiles (no prediction), then two changes per step: the tree for the sync,
    # the meshes again once the weights landed (the generation's KV moves get circuits)
    assert [d.phase for d in policy.decisions() if d.reconfigure] == ["sync", "gen"] * 4
    assert a.reconfigurations == 2 * (work.steps - 1)
    assert a.stall_s == 0.0 and a.slack_used_s == pytest.approx(a.reconfigurations * 0.05)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="multiple"):
        FabricSpec(gpus=300)
    with pytest.raises(ConfigError, match="eps_ports"):
        FabricSpec(gpus=1024, eps_ports=300)
    spec = FabricSpec(gpus=1024)
    with pytest.raises(ConfigError, match="rule"):
        FabricPolicy(spec, VOLUMES, rule="always")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="exactly one"):
        run_fabric(spec, FabricWorkload())
    with pytest.raises(ConfigError, match="volumes"):
        FabricWorkload(kv_bytes=-1.0)
    bad = np.zeros((4, 4), dtype=np.int64)
    bad[0, 1] = 1
    with pytest.raises(ConfigError, match="symmetric"):
        Topology(bad, 0).check(spec)


def test_policy_subscribes_to_the_generation_simulator_safely() -> None:
    """On the discrete-event simulator's real event stream (training acks and publishes at
    the same instant: no slack before the weight sync) the paper's rule never reconfigures,
    and the policy profiled that slack from the events alone."""
    from flowrl.sim import ClusterSpec, Simulator, Workload, standard_schemes

    cluster = ClusterSpec(gpus=16)
    spec = FabricSpec(gpus=1024, eps_ports=32, ocs_delay_s=0.05)
    policy = FabricPolicy(spec, VOLUMES)
    seen: list[float] = []
    sim = Simulator(
        cluster,
        Workload(requests_per_step=200, median=400, max_len=2048),
        standard_schemes(cluster)["static-throughput"],
        steps=3,
        tick_s=0.5,
        observers=(policy.observe, lambda ev: seen.append(ev.t)),
    )
    sim.run()
    assert seen == sorted(seen)
    assert policy.slack("sync") == 0.0
    assert policy.reconfigurations == 0
    assert all(not d.reconfigure for d in policy.decisions())

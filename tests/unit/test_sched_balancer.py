"""Invariants of the reactive balancer."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.sched import (
    BalancerConfig,
    ClusterSnapshot,
    ReplicaView,
    RequestView,
    congestion_scores,
    rebalance,
)
from flowrl.sched.costmodel import ParallelMode, step_time
from flowrl.sched.forecast import RemainingEstimate


def _snap(
    per_replica: list[tuple[int, int]],
    *,
    kv_cap: int = 200_000,
    ctx: int = 1000,
    mode: list[int] | None = None,
) -> ClusterSnapshot:
    """Replicas with (running, waiting) requests, every request holding ``ctx`` tokens."""
    rep, running = [], []
    for i, (r, w) in enumerate(per_replica):
        rep += [i] * (r + w)
        running += [True] * r + [False] * w
    n = len(per_replica)
    rep_a = np.array(rep, dtype=np.int64)
    run_a = np.array(running, dtype=bool)
    ctx_a = np.full(len(rep), ctx) + np.arange(len(rep)) % 7
    modes = np.array(mode if mode is not None else [0] * n)
    return ClusterSnapshot(
        t=0.0,
        step=0,
        total=len(rep),
        finished=0,
        modes=(ParallelMode.tensor(1),),
        node_mode=np.zeros(n, dtype=np.int64),
        node_gpus=np.ones(n, dtype=np.int64),
        replicas=ReplicaView(
            node=np.arange(n),
            mode=modes,
            running=np.bincount(rep_a[run_a], minlength=n),
            waiting=np.bincount(rep_a[~run_a], minlength=n),
            kv_used=np.bincount(rep_a[run_a], weights=ctx_a[run_a], minlength=n),
            kv_capacity=np.full(n, kv_cap),
            bs_max=np.full(n, 64),
            token_rate=np.array([r * 50.0 for r, _ in per_replica]),
        ),
        requests=RequestView(
            rid=np.arange(len(rep)),
            replica=rep_a,
            prompt=ctx_a,
            generated=np.zeros(len(rep)),
            running=run_a,
        ),
    )


def _apply(snap: ClusterSnapshot, moves) -> ClusterSnapshot:
    rep = snap.requests.replica.copy()
    run = snap.requests.running.copy()
    for m in moves:
        rep[m.rid] = m.dst
        run[m.rid] = False if not m.running else run[m.rid]
    r, q = snap.replicas, snap.requests
    n = len(r)
    return ClusterSnapshot(
        t=snap.t + 1,
        step=0,
        total=snap.total,
        finished=0,
        modes=snap.modes,
        node_mode=snap.node_mode,
        node_gpus=snap.node_gpus,
        replicas=ReplicaView(
            node=r.node,
            mode=r.mode,
            running=np.bincount(rep[run], minlength=n),
            waiting=np.bincount(rep[~run], minlength=n),
            kv_used=np.bincount(rep[run], weights=q.context[run], minlength=n),
            kv_capacity=r.kv_capacity,
            bs_max=r.bs_max,
            token_rate=r.token_rate,
        ),
        requests=RequestView(
            rid=q.rid, replica=rep, prompt=q.prompt, generated=q.generated, running=run
        ),
    )


def test_moves_waiting_shortest_first_to_least_congested() -> None:
    snap = _snap([(64, 40), (10, 0), (60, 0)])
    dec = rebalance(snap, BalancerConfig())
    assert dec.migrations
    assert all(m.src == 0 and not m.running for m in dec.migrations[:5])
    assert dec.migrations[0].dst == 1
    waiting_ctx = sorted(snap.requests.context[~snap.requests.running])
    assert dec.migrations[0].context == waiting_ctx[0]
    assert dec.gap_after < dec.gap_before


def test_only_destinations_with_kv_headroom() -> None:
    # replica 1 is idle by count but its KV is nearly full: no move may go there
    snap = _snap([(64, 40), (2, 0)], kv_cap=66_000)
    dec = rebalance(snap, BalancerConfig())
    r = snap.replicas
    room = r.kv_capacity - r.kv_used
    for m in dec.migrations:
        assert m.context <= room[m.dst]
        room[m.dst] -= m.context
    tight = _snap([(1, 10), (1, 0)], kv_cap=61_000, ctx=60_000)  # replica 1 has ~1k free
    assert tight.replicas.kv_capacity[1] - tight.replicas.kv_used[1] < 2_000
    assert not rebalance(tight, BalancerConfig()).migrations


def test_hysteresis_prevents_ping_pong() -> None:
    cfg = BalancerConfig(cooldown=4)
    snap = _snap([(64, 30), (5, 0), (64, 25), (8, 0)])
    mem = None
    history: list[tuple[int, int, int, int]] = []  # tick, rid, src, dst
    for tick in range(12):
        dec = rebalance(snap, cfg, mem)
        mem = dec.memory
        history += [(tick, m.rid, m.src, m.dst) for m in dec.migrations]
        snap = _apply(snap, dec.migrations)
    last: dict[int, int] = {}
    for tick, rid, _, _ in history:
        assert tick - last.get(rid, -100) >= cfg.cooldown
        last[rid] = tick
    recv: dict[int, int] = {}
    for tick, _, src, dst in history:
        assert tick - recv.get(src, -100) >= cfg.cooldown  # no A->B then B->A
        recv[dst] = tick


def test_below_threshold_and_off_replicas_untouched() -> None:
    assert not rebalance(_snap([(30, 0), (28, 0)]), BalancerConfig()).migrations
    snap = _snap([(64, 40), (0, 0), (10, 0)], mode=[0, -1, 0])
    assert all(m.dst != 1 for m in rebalance(snap, BalancerConfig()).migrations)
    c, stable, _ = congestion_scores(snap)
    assert c.shape == stable.shape == (3,)


def test_max_moves_and_config_errors() -> None:
    dec = rebalance(_snap([(64, 60), (0, 0), (0, 0)]), BalancerConfig(max_moves=3))
    assert len(dec.migrations) <= 3
    with pytest.raises(ConfigError):
        BalancerConfig(start_gap=0.1, stop_gap=0.2)


def _tail_snap(per_replica: list[list[int]], *, ctx: int = 8000) -> ClusterSnapshot:
    """Tail phase: every request running, replica ``i`` holding ``len(per_replica[i])``
    requests whose remaining lengths are the listed values; TP8 replicas."""
    rep = [i for i, rs in enumerate(per_replica) for _ in rs]
    n = len(per_replica)
    rep_a = np.array(rep, dtype=np.int64)
    ctx_a = np.full(len(rep), ctx, dtype=np.int64)
    return ClusterSnapshot(
        t=0.0,
        step=0,
        total=len(rep),
        finished=0,
        modes=(ParallelMode.tensor(8),),
        node_mode=np.zeros(n, dtype=np.int64),
        node_gpus=np.full(n, 8, dtype=np.int64),
        replicas=ReplicaView(
            node=np.arange(n),
            mode=np.zeros(n, dtype=np.int64),
            running=np.bincount(rep_a, minlength=n),
            waiting=np.zeros(n, dtype=np.int64),
            kv_used=np.bincount(rep_a, weights=ctx_a, minlength=n),
            kv_capacity=np.full(n, 2_000_000),
            bs_max=np.full(n, 256),
            token_rate=100.0 * np.bincount(rep_a, minlength=n),  # equal per-sequence rates
        ),
        requests=RequestView(
            rid=np.arange(len(rep)),
            replica=rep_a,
            prompt=ctx_a,
            generated=np.zeros(len(rep)),
            running=np.ones(len(rep), dtype=bool),
        ),
    )


def _remaining(per_replica: list[list[int]]) -> RemainingEstimate:
    return RemainingEstimate.known([x for rs in per_replica for x in rs])


def test_tail_steal_moves_critical_request_off_the_latest_replica() -> None:
    # replica 0 holds the longest request among 30 long co-runners; replica 2 is nearly idle
    layout = [[20_000] + [6_000] * 29, [5_000] * 10, [1_000]]
    snap = _tail_snap(layout)
    cfg = BalancerConfig()
    assert not rebalance(snap, cfg).migrations  # no estimate: the queue pass sees no gap
    dec = rebalance(snap, cfg, None, _remaining(layout))
    assert dec.migrations
    first = dec.migrations[0]
    assert (first.rid, first.src, first.dst, first.running) == (0, 0, 2, True)
    assert len(dec.migrations) <= cfg.steal_moves
    # the predicted finish of the moved request's new home beats staying
    st = step_time(
        ParallelMode.tensor(8), np.array([30.0, 2.0]), np.array([240e3, 16e3]), cfg.model, cfg.hw
    )
    assert 20_000 * st[1] < 20_000 * st[0]


def test_tail_steal_respects_headroom_cooldown_and_balance() -> None:
    layout = [[20_000] + [6_000] * 29, [5_000] * 10, [1_000]]
    # already balanced: one long request per replica, nothing to gain
    even = [[20_000, 500], [20_000, 500], [20_000, 500]]
    assert not rebalance(_tail_snap(even), BalancerConfig(), None, _remaining(even)).migrations
    # no stealing while any replica has a waiting request (the queue pass's regime)
    q = _snap([(64, 40), (10, 0)])
    est = RemainingEstimate.known(np.full(len(q.requests), 1000.0))
    assert all(not m.running for m in rebalance(q, BalancerConfig(), None, est).migrations)
    # a request moved is not moved again within the cooldown; receivers are no sources
    cfg = BalancerConfig(cooldown=3, steal_gain=0.0)
    snap = _tail_snap(layout)
    dec = rebalance(snap, cfg, None, _remaining(layout))
    mem, moved = dec.memory, {m.rid for m in dec.migrations}
    again = rebalance(snap, cfg, mem, _remaining(layout))
    assert not moved & {m.rid for m in again.migrations}
    assert not {m.dst for m in dec.migrations} & {m.src for m in again.migrations}
    with pytest.raises(ConfigError):
        rebalance(snap, cfg, None, RemainingEstimate.known([1.0]))
    with pytest.raises(ConfigError):
        BalancerConfig(steal_gain=1.0)

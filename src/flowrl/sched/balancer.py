"""Reactive balancer: move requests from the most to the least congested replica.

OrchestrRL §4.2. Each replica ``i`` gets a congestion score (higher = more congested)::

    N_i = max(1, min(bs_max_i, kv_capacity_i // footprint_i))     KV-limited stable concurrency
    mu_i = token_rate_i / running_i                                per-sequence service rate
    C_i = (running_i + waiting_i) / N_i * (mean(mu) / mu_i)

``footprint_i`` is the mean KV tokens per request queued or running on ``i`` (the cluster
mean where ``i`` is empty); a replica with no running request or no observed rate yet gets
``mu_i = mean(mu)`` over the others (``1`` if none is known).
``C`` ranks replicas only — it is not a completion-time prediction.

Each tick, while ``C_max - C_min >= start_gap`` (and then until it drops below
``stop_gap``), the balancer moves one request from the most to the least congested
replica: waiting requests first, shortest context first; running requests (which carry KV)
only when ``move_running`` is set and the source has no waiting request. A move happens
only where the destination has KV headroom — it has a free stable slot
(``running + waiting < N``) and ``kv_used + queued context + context <= kv_capacity`` — so
the move never reduces the destination's effective batch.

Hysteresis against thrashing (state carried in :class:`BalancerMemory`): the trigger
(``start_gap``) is higher than the stop level (``stop_gap``); a request moved at tick ``k`` is
not moved again before tick ``k + cooldown``; a replica that received requests within
``cooldown`` ticks is not used as a source.

**Tail work stealing.** Once no replica has a waiting request (the wave's tail), queue
lengths stop saying anything: every replica runs all it holds, and what sets the makespan is
the replica that will finish last. Given the forecaster's
:class:`~flowrl.sched.forecast.RemainingEstimate` (``rebalance(..., estimate=est)``), the
balancer predicts each replica's finish as ``F_i = H_i * step_i``: ``H_i`` the largest tail
(expected-maximum) remaining length among its requests, ``step_i`` its decode iteration time
at its current batch and KV tokens (:func:`~flowrl.sched.costmodel.step_time`, with
``model``/``hw``). Decode in the tail is KV-read bound, so a long request sharing a replica
with other long requests runs at their combined KV's pace. While moving the most critical
request (largest tail) of the latest-finishing replica to the replica where it would finish
first lowers ``max(F_src, F_dst)`` below ``(1 - steal_gain) * F_src``, it moves (running: its KV
travels), at most ``steal_moves`` per tick, under the same KV-headroom, batch-cap, cooldown
and no-ping-pong rules. The queue pass above is OrchestrRL §4.2 as published; the tail pass
extends its "remaining work" ranking to the tail, where the published score is flat.

Invariants (asserted by tests): a move's destination has KV headroom for it; no request
moves twice within ``cooldown`` ticks; no replica is both source and destination within a
``cooldown`` window (no ping-pong); at most ``max_moves`` moves per tick; replicas with
``mode == -1`` (off) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.sched.costmodel import HardwareSpec, ModelSpec, step_time
from flowrl.sched.forecast import RemainingEstimate
from flowrl.sched.snapshot import ClusterSnapshot

__all__ = [
    "BalanceDecision",
    "BalancerConfig",
    "BalancerMemory",
    "Migration",
    "congestion_scores",
    "rebalance",
]

F64 = NDArray[np.float64]


@final
class BalancerConfig(msgspec.Struct, frozen=True, kw_only=True):
    start_gap: float = 0.3
    stop_gap: float = 0.1
    cooldown: int = 5
    max_moves: int = 64
    move_running: bool = True
    steal_moves: int = 8
    steal_gain: float = 0.02
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    hw: HardwareSpec = msgspec.field(default_factory=HardwareSpec)

    def __post_init__(self) -> None:
        if not 0 <= self.stop_gap <= self.start_gap:
            raise ConfigError(
                f"BalancerConfig needs 0 <= stop_gap <= start_gap, got "
                f"{self.stop_gap}, {self.start_gap}"
            )
        if self.cooldown < 0 or self.max_moves < 0 or self.steal_moves < 0:
            raise ConfigError("BalancerConfig cooldown, max_moves and steal_moves must be >= 0")
        if not 0 <= self.steal_gain < 1:
            raise ConfigError(f"BalancerConfig.steal_gain must be in [0, 1), got {self.steal_gain}")


@final
class Migration(msgspec.Struct, frozen=True):
    """Move request ``rid`` from replica ``src`` to ``dst``; ``running`` says it carries KV."""

    rid: int
    src: int
    dst: int
    running: bool
    context: int


@final
@dataclass(frozen=True, slots=True)
class BalancerMemory:
    """What the balancer remembers between ticks (for hysteresis)."""

    tick: int = 0
    moved_at: dict[int, int] = field(default_factory=dict)
    received_at: dict[int, int] = field(default_factory=dict)
    active: bool = False


@final
@dataclass(frozen=True, slots=True)
class BalanceDecision:
    migrations: tuple[Migration, ...]
    memory: BalancerMemory
    gap_before: float
    gap_after: float


def _footprint(snap: ClusterSnapshot) -> F64:
    r, q = snap.replicas, snap.requests
    n = len(r)
    ctx = q.context.astype(np.float64)
    tot = np.bincount(q.replica, weights=ctx, minlength=n)
    cnt = np.bincount(q.replica, minlength=n)
    mean = float(ctx.mean()) if len(ctx) else 1.0
    return np.where(cnt > 0, tot / np.maximum(cnt, 1), mean)


def congestion_scores(snap: ClusterSnapshot) -> tuple[F64, F64, F64]:
    """``(C, N, mean(mu)/mu)`` per replica (see module docstring)."""
    r = snap.replicas
    foot = np.maximum(_footprint(snap), 1.0)
    stable = np.maximum(1.0, np.minimum(r.bs_max, np.floor(r.kv_capacity / foot)))
    mu = r.token_rate / np.maximum(r.running, 1)
    known = (r.mode >= 0) & (r.running > 0) & (mu > 1e-9)  # a rate that decayed to ~0 is unknown
    ref = float(mu[known].mean()) if known.any() else 1.0
    mu = np.where(known, mu, ref)
    slow = ref / mu
    return (r.running + r.waiting) / stable * slow, stable, slow


def rebalance(
    snap: ClusterSnapshot,
    config: BalancerConfig,
    memory: BalancerMemory | None = None,
    estimate: RemainingEstimate | None = None,
) -> BalanceDecision:
    """One balancer tick over ``snap`` (pure; returns the new memory).

    ``estimate`` (one entry per pending request, in snapshot order) enables the tail
    work-stealing pass (see module docstring); without it only the queue pass runs.
    """
    mem = memory or BalancerMemory()
    tick = mem.tick + 1
    cd = config.cooldown
    moved_at = {k: v for k, v in mem.moved_at.items() if tick - v < cd}
    received_at = {k: v for k, v in mem.received_at.items() if tick - v < cd}
    r, q = snap.replicas, snap.requests
    if estimate is not None and len(estimate) != len(q):
        raise ConfigError(
            f"the estimate has {len(estimate)} entries, the snapshot {len(q)} pending "
            "requests; pass one remaining-length estimate per pending request, in snapshot order"
        )
    on = r.mode >= 0
    if on.sum() < 2:
        return BalanceDecision((), BalancerMemory(tick, moved_at, received_at, False), 0.0, 0.0)
    c, stable, slow = congestion_scores(snap)
    score = np.where(on, c, np.nan)
    gap0 = float(np.nanmax(score) - np.nanmin(score))
    moves: list[Migration] = []
    gap = gap0
    active = mem.active or gap0 >= config.start_gap
    if active:
        gap = _queue_pass(snap, config, tick, moved_at, received_at, score, stable, slow, moves)
    still = bool(moves) and gap >= config.stop_gap
    if (
        estimate is not None
        and not moves
        and config.steal_moves > 0
        and int(r.waiting[on].sum()) == 0
    ):
        _steal_pass(snap, config, estimate, tick, moved_at, received_at, moves)
    return BalanceDecision(
        tuple(moves), BalancerMemory(tick, moved_at, received_at, still), gap0, gap
    )


def _queue_pass(
    snap: ClusterSnapshot,
    config: BalancerConfig,
    tick: int,
    moved_at: dict[int, int],
    received_at: dict[int, int],
    score: F64,
    stable: F64,
    slow: F64,
    moves: list[Migration],
) -> float:
    """OrchestrRL's greedy: most to least congested; appends to ``moves``, returns the gap."""
    r, q = snap.replicas, snap.requests
    cd = config.cooldown
    on = r.mode >= 0
    load = (r.running + r.waiting).astype(np.float64)
    kv_q = np.bincount(q.replica[~q.running], weights=q.context[~q.running], minlength=len(r))
    kv_room = r.kv_capacity - r.kv_used - kv_q
    # candidate requests per replica, cheapest first: waiting before running, short context;
    # a replica with waiting requests offers only those, else its running ones if allowed
    key = (q.replica << 33) | (q.running.astype(np.int64) << 32) | np.minimum(q.context, 2**32 - 1)
    order = np.argsort(key, kind="stable")  # one int64 key: ~8x faster than lexsort
    starts = np.searchsorted(q.replica[order], np.arange(len(r) + 1))
    ptr = starts[:-1].copy()
    offer = np.where(r.waiting > 0, r.waiting, r.running if config.move_running else 0)
    end = ptr + offer
    ctx_all = q.context
    rid_all = q.rid
    run_all = q.running
    src_ok = on & (offer > 0)
    for k in received_at:
        if 0 <= k < len(r):
            src_ok[k] = False
    dst_ok = on.copy()
    src_arr = np.where(src_ok, score, -np.inf)
    dst_arr = np.where(dst_ok & (load < stable), score, np.inf)

    def refresh(j: int) -> None:
        src_arr[j] = score[j] if src_ok[j] else -np.inf
        dst_arr[j] = score[j] if dst_ok[j] and load[j] < stable[j] else np.inf

    gap = float(np.nanmax(score) - np.nanmin(score))
    while len(moves) < config.max_moves:
        s = int(np.argmax(src_arr))
        d = int(np.argmin(dst_arr))
        if s == d or not (np.isfinite(src_arr[s]) and np.isfinite(dst_arr[d])):
            break
        gap = float(src_arr[s] - dst_arr[d])
        if gap < config.stop_gap:
            break
        pick = -1
        while ptr[s] < end[s]:
            i = int(order[ptr[s]])
            ptr[s] += 1
            if cd > 0 and tick - moved_at.get(int(rid_all[i]), -(10**9)) <= cd:
                continue
            pick = i
            break
        if pick < 0:
            src_ok[s] = False
            refresh(s)
            continue
        ctx = int(ctx_all[pick])
        if kv_room[d] < ctx:
            ptr[s] -= 1  # no headroom at d: keep the request, try the next destination
            dst_ok[d] = False
            refresh(d)
            continue
        moves.append(Migration(int(rid_all[pick]), s, d, bool(run_all[pick]), ctx))
        moved_at[int(rid_all[pick])] = tick
        received_at[d] = tick
        src_ok[d] = False
        load[s] -= 1
        load[d] += 1
        kv_room[d] -= ctx
        kv_room[s] += ctx
        score[s] = load[s] / stable[s] * slow[s]
        score[d] = load[d] / stable[d] * slow[d]
        refresh(s)
        refresh(d)
    return gap


def _step_times(
    snap: ClusterSnapshot, config: BalancerConfig, reps: NDArray[np.int64], batch: F64, kv: F64
) -> F64:
    out = np.empty(len(reps))
    modes = snap.replicas.mode[reps]
    for m in np.unique(modes):
        sel = modes == m
        out[sel] = step_time(snap.modes[int(m)], batch[sel], kv[sel], config.model, config.hw)
    return out


def _steal_pass(
    snap: ClusterSnapshot,
    config: BalancerConfig,
    est: RemainingEstimate,
    tick: int,
    moved_at: dict[int, int],
    received_at: dict[int, int],
    moves: list[Migration],
) -> None:
    """Tail work stealing (module docstring): the critical request of the latest-finishing
    replica moves to where it finishes first, while that lowers the predicted makespan."""
    r, q = snap.replicas, snap.requests
    n = len(r)
    cd = config.cooldown
    on_idx = np.nonzero(r.mode >= 0)[0]
    if len(q) < 2 or len(on_idx) < 2:
        return
    hi = np.maximum(est.tail, est.mean)
    rep = q.replica.astype(np.int64).copy()
    ctx = q.context.astype(np.float64)
    batch = np.bincount(rep, minlength=n).astype(np.float64)
    kv: F64 = np.bincount(rep, weights=ctx, minlength=n).astype(np.float64)
    room = (r.kv_capacity - kv).astype(np.float64)
    recent = [k for k, v in moved_at.items() if tick - v <= cd] if cd > 0 else []
    frozen = np.isin(q.rid, np.array(recent, dtype=np.int64))
    # per replica: its requests by tail, largest first
    order = np.lexsort((-hi, rep))
    starts = np.searchsorted(rep[order], np.arange(n + 1))
    head = starts[:-1].copy()  # first request not yet moved away, per replica
    gone = np.zeros(len(q), dtype=bool)

    def top(j: int, skip: int = 0) -> tuple[int, float]:
        """(index, tail) of the ``skip``-th largest-tail request still on replica ``j``."""
        k, seen = int(head[j]), 0
        while k < starts[j + 1]:
            i = int(order[k])
            if not gone[i]:
                if seen == skip:
                    return i, float(hi[i])
                seen += 1
            k += 1
        return -1, 0.0

    big: F64 = np.zeros(n)  # largest tail per replica: the first of its run in ``order``
    has = starts[1:] > starts[:-1]
    big[has] = hi[order[starts[:-1][has]]]
    for _ in range(config.steal_moves):
        busy = on_idx[batch[on_idx] > 0]
        if not len(busy):
            return
        fin = big[busy] * _step_times(snap, config, busy, batch[busy], kv[busy])
        s = int(busy[int(np.argmax(fin))])
        f_s = float(fin.max())
        if s in received_at or batch[s] < 2:
            return
        i, h = top(s)
        if i < 0 or frozen[i]:
            return
        _, h2 = top(s, 1)
        f_src = h2 * float(
            _step_times(snap, config, np.array([s]), batch[s : s + 1] - 1, kv[s : s + 1] - ctx[i])[
                0
            ]
        )
        dst = on_idx[
            (on_idx != s) & (batch[on_idx] + 1 <= r.bs_max[on_idx]) & (room[on_idx] >= ctx[i])
        ]
        if not len(dst):
            return
        f_dst = np.maximum(big[dst], h) * _step_times(
            snap, config, dst, batch[dst] + 1, kv[dst] + ctx[i]
        )
        k = int(np.argmin(f_dst))
        d = int(dst[k])
        if max(float(f_dst[k]), f_src) > (1.0 - config.steal_gain) * f_s:
            return
        moves.append(Migration(int(q.rid[i]), s, d, bool(q.running[i]), int(q.context[i])))
        moved_at[int(q.rid[i])] = tick
        received_at[d] = tick
        frozen[i] = True
        gone[i] = True
        batch[s] -= 1
        batch[d] += 1
        kv[s] -= ctx[i]
        kv[d] += ctx[i]
        room[s] += ctx[i]
        room[d] -= ctx[i]
        big[s] = h2
        big[d] = max(big[d], h)

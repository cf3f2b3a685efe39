"""Discrete-event simulator of disaggregated RL generation, driving the real ``flowrl.sched``.

Model (one run = ``steps`` generation steps of a :class:`~flowrl.sim.workload.Workload`):

- **Generation.** Every node runs one parallel mode (``gpus_per_node // mode.gpus``
  replicas). A replica admits waiting requests FIFO while it runs fewer than ``bs_max`` and
  their contexts fit its KV capacity; admitting costs the prefill of what the request must
  (re)build. Running requests decode one token per iteration; an iteration takes
  :func:`~flowrl.sched.costmodel.step_time` of the replica's batch and KV tokens. When KV
  growth overflows a replica, its newest requests are preempted and later recomputed.
- **Time advance.** Time moves in ticks of ``tick_s``; in a tick every replica runs, in bulk
  (numpy over all requests at once), as many whole iterations as fit since its own clock,
  with the step time fixed at the tick's start. Requests finishing inside a tick get their
  exact finish time; slots they free are refilled at the next tick (admission lags by at
  most ``tick_s``). So a 32 k-request step on 2,048 GPUs costs a few thousand numpy passes,
  not one Python event per token.
- **Policies.** At step start and every ``plan_interval_s`` the planner gets a
  :class:`~flowrl.sched.snapshot.ClusterSnapshot` and the forecaster's remaining-length
  estimates; every ``balance_interval_s`` the balancer gets a snapshot. Mode switches take a
  node down for ``switch_time``; its requests are re-laid out (KV moved over NVLink or
  recomputed, the cheaper). Migrations move KV over RDMA or recompute it (the cheaper);
  waiting requests move for free. ``migrated``/``relaid`` count requests that carried state
  (generated tokens or KV) when moved / re-laid out. With fusion, once fewer requests remain
  than the largest candidate threshold, ``(R_t, m)`` is re-chosen every ``plan_interval_s``
  by :func:`~flowrl.sched.fusion.choose_threshold` on a sample of the forecast remaining
  lengths (never the true ones); when at most ``R_t`` remain they are consolidated onto the
  ``m`` nodes holding most of them and the other nodes start the next stage.
- **Stages after generation.** The next stage (reference inference) runs on generation GPUs
  after the step's generation (or on freed GPUs from the fusion trigger); training of step
  ``s`` starts when that stage ends and training of ``s-1`` is done; generation of step
  ``s+1`` needs policy version ``s`` (one-step asynchronous), available ``sync`` seconds after
  training of step ``s-1`` ends.
- **Events.** The simulator emits ``flowrl.events`` structs to every observer in time order,
  as the hub would: ``TaskRegistered``; ``Put(new=True)`` of the prompts at step start
  (``partition="step-<s>"``); ``Put`` of ``response`` with per-sample ``tokens`` as responses
  finish; ``Claimed``/``Put``/``Acked`` of the reference stage and ``Claimed``/``Acked``/
  ``Evicted`` of training; ``VersionPublished`` when training of a step ends; ``StreamEnded``.
  ``t`` is simulated seconds.

Invariants (asserted by tests): deterministic for a seed (every planner budget is counted —
bisection rounds, evaluated mode mixes, simplex iterations — never timed, so a run does not
depend on machine speed, at 2,048 GPUs as at 16); every request finishes exactly once with
exactly its response length; events carry strictly increasing ``seq`` and non-decreasing
``t``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl.errors import ConfigError
from flowrl.events import (
    Acked,
    Claimed,
    Event,
    Evicted,
    Put,
    StreamEnded,
    TaskRegistered,
    VersionPublished,
)
from flowrl.sched.balancer import BalancerMemory, Migration, rebalance
from flowrl.sched.costmodel import (
    kv_capacity_tokens,
    kv_move_cost,
    prefill_time,
    step_time,
    switch_time,
)
from flowrl.sched.forecast import ForecastConfig, LengthForecaster, RemainingEstimate
from flowrl.sched.fusion import FusionConfig, ThresholdChoice, choose_threshold, select_targets
from flowrl.sched.planner import Plan, plan
from flowrl.sched.snapshot import ClusterSnapshot, ReplicaView, RequestView
from flowrl.sim.cluster import ClusterSpec
from flowrl.sim.schemes import Scheme
from flowrl.sim.workload import Workload

__all__ = ["SimResult", "Simulator", "StepResult"]

Observer = Callable[[Event], None]
I64 = NDArray[np.int64]
F64 = NDArray[np.float64]
WAIT, RUN, DONE, TRANSIT = 0, 1, 2, 3


@final
class StepResult(msgspec.Struct, frozen=True):
    step: int
    start: float
    gen_end: float
    stage_end: float
    tokens: int
    requests: int
    fused_at: float
    threshold: int
    curve_t: tuple[float, ...]
    curve_remaining: tuple[int, ...]

    @property
    def makespan(self) -> float:
        return self.gen_end - self.start


@final
class SimResult(msgspec.Struct, frozen=True):
    scheme: str
    steps: tuple[StepResult, ...]
    total_time: float
    tokens: int
    requests: int
    migrated: int
    relaid: int
    plans: int
    plans_applied: int
    replan_ms: tuple[float, ...]
    balancer_ms: tuple[float, ...]
    forecast_errors: tuple[float, ...]
    events: int
    wall_s: float

    @property
    def throughput(self) -> float:
        """Response tokens per second over the whole run (end-to-end, last training incl.)."""
        return self.tokens / self.total_time

    @property
    def gen_throughput(self) -> float:
        """Response tokens per second of generation-stage time (gen + next stage per step)."""
        return self.tokens / sum(s.stage_end - s.start for s in self.steps)

    @property
    def migrated_fraction(self) -> float:
        return self.migrated / max(self.requests, 1)


@final
class Simulator:
    """Runs ``scheme`` on ``cluster`` over ``steps`` steps of ``workload`` (see module doc)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        workload: Workload,
        scheme: Scheme,
        *,
        steps: int = 4,
        seed: int = 0,
        tick_s: float = 0.25,
        observers: tuple[Observer, ...] = (),
        forecast: ForecastConfig | None = None,
        curve_points: int = 200,
        capture_at: tuple[float, ...] = (),
    ) -> None:
        if steps < 1 or tick_s <= 0:
            raise ConfigError(f"need steps >= 1 and tick_s > 0, got {steps}, {tick_s}")
        self.c, self.w, self.scheme = cluster, workload, scheme
        self.steps, self.seed, self.tick = steps, seed, tick_s
        self.curve_points = curve_points
        self.capture_at = tuple(sorted(capture_at))
        #: ``(snapshot, remaining-length estimate)`` captured when a step's finished fraction
        #: first reaches each of ``capture_at`` (for offline study of the policies)
        self.captured: list[tuple[ClusterSnapshot, RemainingEstimate]] = []
        self._observers = list(observers)
        fc = forecast or ForecastConfig(
            median=workload.median, sigma=max(workload.sigma, 0.05), max_len=workload.max_len
        )
        self.forecaster = LengthForecaster(fc)
        self._observers.insert(0, self.forecaster.observe)
        self._seq = 0
        self._last_t = 0.0
        self._pending: list[tuple[float, int, Event]] = []
        self._order = 0
        per = cluster.hw.gpus_per_node
        self.slots = per
        n_nodes = cluster.nodes
        self.node_mode = np.full(n_nodes, cluster.mode_index(scheme.initial_mode), dtype=np.int64)
        self.node_gpus = np.full(n_nodes, per, dtype=np.int64)
        nr = n_nodes * per
        self.rep_mode = np.full(nr, -1, dtype=np.int64)
        self.rep_clock = np.zeros(nr)
        self.rep_cap = np.zeros(nr, dtype=np.int64)
        self.rep_rate = np.zeros(nr)
        self._caps = np.array(
            [kv_capacity_tokens(m, cluster.model, cluster.hw) for m in cluster.modes]
        )
        for n in range(n_nodes):
            self._activate(n, int(self.node_mode[n]), 0.0)
        self.migrated_ids: set[int] = set()
        self.relaid_ids: set[int] = set()
        self.replan_ms: list[float] = []
        self.balancer_ms: list[float] = []
        self.forecast_errors: list[float] = []
        self.plans = 0
        self.plans_applied = 0
        self._bal_mem = BalancerMemory()

    # -- events -------------------------------------------------------------------------------
    def _emit(self, ev_type: type, t: float, **fields: object) -> None:
        self._seq += 1
        self._last_t = max(self._last_t, float(t))  # the hub stamps events as it sees them
        ev = ev_type(seq=self._seq, t=self._last_t, **fields)
        for obs in self._observers:
            obs(ev)

    def _later(self, t: float, ev_type: type, **fields: object) -> None:
        self._order += 1
        heapq.heappush(self._pending, (float(t), self._order, (ev_type, fields)))  # type: ignore[arg-type, misc]

    def _flush(self, upto: float) -> None:
        while self._pending and self._pending[0][0] <= upto:
            t, _, (ev_type, fields) = heapq.heappop(self._pending)  # type: ignore[misc]
            self._emit(ev_type, t, **fields)

    # -- replicas -----------------------------------------------------------------------------
    def _activate(self, node: int, mode: int, up_at: float) -> None:
        s = self.slots
        sl = slice(node * s, (node + 1) * s)
        self.rep_mode[sl] = -1
        self.rep_cap[sl] = 0
        if mode < 0:
            return
        k = s // self.c.modes[mode].gpus
        self.rep_mode[node * s : node * s + k] = mode
        self.rep_cap[node * s : node * s + k] = self._caps[mode]
        self.rep_clock[node * s : node * s + k] = up_at

    def _node_reps(self, node: int) -> I64:
        s = self.slots
        ids = np.arange(node * s, (node + 1) * s)
        return ids[self.rep_mode[ids] >= 0]

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        c = self.c
        self._emit(TaskRegistered, 0.0, task="reference", columns=("prompt", "response"))
        self._emit(TaskRegistered, 0.0, task="train", columns=("prompt", "response", "ref_logprob"))
        results: list[StepResult] = []
        t = 0.0
        train_end_prev = 0.0
        version_ready = [0.0]  # version v usable by generators at version_ready[v]
        base = 0
        tokens = 0
        lease = 0
        for s in range(self.steps):
            need = max(0, s - 1)
            start = max(t, version_ready[min(need, len(version_ready) - 1)])
            req = self.w.draw(s, self.seed)
            res = self._gen_step(s, start, req.prompt, req.response, base, version=need)
            results.append(res)
            tokens += int(req.response.sum())
            n = len(req.response)
            # reference stage claims/acks between its start and end
            ref_start = res.fused_at if res.fused_at >= 0 else res.gen_end
            for k, chunk in enumerate(np.array_split(np.arange(base, base + n), 8)):
                lease += 1
                tc = ref_start + (res.stage_end - ref_start) * (k + 1) / 8
                idx = tuple(int(i) for i in chunk)
                self._later(tc, Claimed, task="reference", lease=lease, indices=idx)
                self._later(tc, Put, indices=idx, columns=("ref_logprob",), version=need)
                self._later(tc, Acked, task="reference", lease=lease, indices=idx)
            # training of this step's samples
            trained = float((req.prompt + req.response).sum())
            t_start = max(res.stage_end, train_end_prev)
            t_end = t_start + trained * c.train_cost / (c.train_gpus * c.hw.flops * c.train_eta)
            lease += 1
            all_idx = tuple(range(base, base + n))
            self._later(t_start, Claimed, task="train", lease=lease, indices=all_idx)
            self._later(t_end, Acked, task="train", lease=lease, indices=all_idx)
            self._later(t_end, Evicted, indices=all_idx)
            self._later(t_end, VersionPublished, version=s + 1)
            sync = c.sync_fixed_s + c.model.weight_bytes / c.sync_bw
            version_ready.append(t_end + sync)
            train_end_prev = t_end
            t = res.stage_end
            base += n
        self._flush(float("inf"))
        self._emit(StreamEnded, max(train_end_prev, t), columns=("response",))
        return SimResult(
            scheme=self.scheme.name,
            steps=tuple(results),
            total_time=max(train_end_prev, t),
            tokens=tokens,
            requests=base,
            migrated=len(self.migrated_ids),
            relaid=len(self.relaid_ids),
            plans=self.plans,
            plans_applied=self.plans_applied,
            replan_ms=tuple(self.replan_ms),
            balancer_ms=tuple(self.balancer_ms),
            forecast_errors=tuple(self.forecast_errors),
            events=self._seq,
            wall_s=time.perf_counter() - wall,
        )

    # -- one generation step --------------------------------------------------------------------
    def _gen_step(
        self, s: int, start: float, prompt: I64, length: I64, base: int, version: int
    ) -> StepResult:
        c, sch = self.c, self.scheme
        n = len(length)
        self._flush(start)
        self._emit(
            Put,
            start,
            indices=tuple(range(base, base + n)),
            columns=("prompt",),
            new=True,
            partition=f"step-{s}",
            version=version,
            tokens=tuple(int(v) for v in prompt),
        )
        st = _StepState(prompt, length, base)
        self.st = st
        self.rep_clock = np.maximum(self.rep_clock, start)
        active = np.nonzero(self.rep_mode >= 0)[0]
        st.rep[:] = active[np.arange(n) % len(active)]
        choice: ThresholdChoice | None = None
        fused_at = -1.0
        freed_gpus = 0
        next_plan = start
        next_bal = start
        next_fuse = start
        marks = [0.25, 0.5, 0.75]
        captures = list(self.capture_at)
        curve_t: list[float] = [start]
        curve_r: list[int] = [n]
        t = start
        done_count = 0
        while done_count < n:
            self._flush(t)
            if sch.planner is not None and t >= next_plan:
                self._replan(s, t, n, done_count)
                next_plan = t + sch.plan_interval_s
            if sch.balancer is not None and t >= next_bal:
                self._balance(s, t, n, done_count)
                next_bal = t + sch.balance_interval_s
            if sch.fusion is not None and fused_at < 0 and t >= next_fuse:
                if n - done_count <= max(sch.fusion.fractions) * n:
                    choice = self._choose_threshold(n, sch.fusion)
                next_fuse = t + sch.plan_interval_s
            if choice is not None and fused_at < 0 and 0 < n - done_count <= choice.threshold:
                freed_gpus = self._fuse(t, choice.units)
                fused_at = t
            while captures and done_count >= captures[0] * n:
                captures.pop(0)
                snap = self.snapshot(s, t, n, done_count)
                g = st.gen[snap.requests.rid]
                self.captured.append((snap, self.forecaster.estimates(g, g[snap.requests.running])))
            while marks and done_count >= marks[0] * n:
                marks.pop(0)
                self._score_forecast()
            done_count += self._tick(t, t + self.tick, version)
            t += self.tick
            curve_t.append(t)
            curve_r.append(n - done_count)
        gen_end = float(st.finish.max())
        stage_end = self._next_stage_end(prompt, length, st.finish, gen_end, fused_at, freed_gpus)
        if fused_at >= 0:  # lent nodes come back for the next step
            for node in range(c.nodes):
                if self.node_gpus[node] == 0:
                    self.node_gpus[node] = c.hw.gpus_per_node
                    self.node_mode[node] = self.c.mode_index(sch.initial_mode)
                    self._activate(node, int(self.node_mode[node]), stage_end)
        keep = max(1, len(curve_t) // self.curve_points)
        return StepResult(
            step=s,
            start=start,
            gen_end=gen_end,
            stage_end=stage_end,
            tokens=int(length.sum()),
            requests=n,
            fused_at=fused_at,
            threshold=-1 if choice is None else choice.threshold,
            curve_t=(*tuple(curve_t[::keep]), gen_end),
            curve_remaining=(*tuple(curve_r[::keep]), 0),
        )

    def _tick(self, t0: float, t1: float, version: int) -> int:
        st, c = self.st, self.c
        alive = np.nonzero(st.state != DONE)[0]
        # transits arrive: KV is in place, admission costs no prefill
        tr = alive[(st.state[alive] == TRANSIT) & (st.ready[alive] <= t0)]
        st.state[tr] = WAIT
        self._admit(alive, t0)
        run = alive[st.state[alive] == RUN]
        if not len(run):
            self.rep_clock = np.maximum(self.rep_clock, t1)
            return 0
        nr = len(self.rep_mode)
        rep = st.rep[run]
        ctx = st.prompt[run] + st.gen[run]
        b = np.bincount(rep, minlength=nr)
        kv = np.bincount(rep, weights=ctx, minlength=nr)
        step = np.full(nr, np.inf)
        for m in np.unique(self.rep_mode[b > 0]):
            sel = (self.rep_mode == m) & (b > 0)
            step[sel] = step_time(c.modes[m], b[sel], kv[sel], c.model, c.hw)
        clock = np.maximum(self.rep_clock, t0)
        k = np.where(b > 0, np.floor(np.maximum(t1 - clock, 0.0) / step), 0.0)
        rem = st.length[run] - st.gen[run]
        kk = k[rep]
        fin = rem <= kk
        adv = np.minimum(rem, kk).astype(np.int64)
        st.gen[run] += adv
        fin_idx = run[fin]
        st.finish[fin_idx] = clock[rep[fin]] + rem[fin] * step[rep[fin]]
        st.state[fin_idx] = DONE
        produced = np.bincount(rep, weights=adv, minlength=nr)
        self.rep_rate = 0.5 * self.rep_rate + 0.5 * produced / (t1 - t0)
        self.rep_clock = np.where(
            b > 0, clock + k * np.where(b > 0, step, 0.0), np.maximum(clock, t1)
        )
        self._flush(t1)
        if len(fin_idx):
            order = fin_idx[np.lexsort((st.finish[fin_idx], st.rep[fin_idx]))]
            reps = st.rep[order]
            cuts = np.nonzero(np.diff(reps))[0] + 1
            for grp in np.split(order, cuts):
                r = int(st.rep[grp[0]])
                self._emit(
                    Put,
                    t1,
                    indices=tuple(int(i) for i in grp + st.base),
                    columns=("response",),
                    version=version,
                    tokens=tuple(int(v) for v in st.length[grp]),
                    unit=r,
                    producer=f"gen-{r}",
                )
        self._preempt(run[~fin])
        return len(fin_idx)

    def _admit(self, alive: I64, t0: float) -> None:
        st, c = self.st, self.c
        w = alive[st.state[alive] == WAIT]
        if not len(w):
            return
        up = self.rep_mode[st.rep[w]] >= 0
        w = w[up & (self.rep_clock[st.rep[w]] <= t0 + self.tick)]
        if not len(w):
            return
        nr = len(self.rep_mode)
        run = alive[st.state[alive] == RUN]
        b = np.bincount(st.rep[run], minlength=nr)
        kv = np.bincount(st.rep[run], weights=st.prompt[run] + st.gen[run], minlength=nr)
        w = w[np.lexsort((st.qseq[w], st.rep[w]))]
        rep = st.rep[w]
        ctx = (st.prompt[w] + st.gen[w]).astype(np.float64)
        first = np.r_[0, np.nonzero(np.diff(rep))[0] + 1]
        cnt = np.diff(np.r_[first, len(w)])
        rank = np.arange(len(w)) - np.repeat(first, cnt)
        cs = np.cumsum(ctx)
        cum = cs - np.repeat(cs[first] - ctx[first], cnt)
        ok = (rank < c.bs_max - b[rep]) & (cum <= self.rep_cap[rep] - kv[rep])
        adm = w[ok]
        if not len(adm):
            return
        st.state[adm] = RUN
        pre = st.prefill[adm]
        st.prefill[adm] = 0
        cost = np.zeros(len(adm))
        modes = self.rep_mode[st.rep[adm]]
        for m in np.unique(modes):
            sel = modes == m
            cost[sel] = prefill_time(c.modes[m], pre[sel], c.model, c.hw)
        stall = np.bincount(st.rep[adm], weights=cost, minlength=nr)
        touched = stall > 0
        self.rep_clock[touched] = np.maximum(self.rep_clock[touched], t0) + stall[touched]

    def _preempt(self, run: I64) -> None:
        st = self.st
        if not len(run):
            return
        nr = len(self.rep_mode)
        rep = st.rep[run]
        ctx = st.prompt[run] + st.gen[run]
        kv = np.bincount(rep, weights=ctx, minlength=nr)
        over = kv > self.rep_cap
        if not over[rep].any():
            return
        sel = run[over[rep]]
        sel = sel[np.lexsort((-st.qseq[sel], st.rep[sel]))]  # newest first within replica
        r = st.rep[sel]
        cx = (st.prompt[sel] + st.gen[sel]).astype(np.float64)
        first = np.r_[0, np.nonzero(np.diff(r))[0] + 1]
        cnt = np.diff(np.r_[first, len(sel)])
        cs = np.cumsum(cx)
        before = cs - cx - np.repeat(cs[first] - cx[first], cnt)
        evict = kv[r] - before > self.rep_cap[r]
        victims = sel[evict]
        st.state[victims] = WAIT
        st.prefill[victims] = st.prompt[victims] + st.gen[victims]

    # -- policies -------------------------------------------------------------------------------
    def snapshot(self, s: int, t: float, total: int, finished: int) -> ClusterSnapshot:
        st = self.st
        nr = len(self.rep_mode)
        pend = np.nonzero(st.state != DONE)[0]
        running = st.state[pend] != WAIT
        rep = st.rep[pend]
        ctx = st.prompt[pend] + st.gen[pend]
        return ClusterSnapshot(
            t=t,
            step=s,
            total=total,
            finished=finished,
            modes=self.c.modes,
            node_mode=self.node_mode,
            node_gpus=self.node_gpus,
            replicas=ReplicaView(
                node=np.arange(nr) // self.slots,
                mode=self.rep_mode,
                running=np.bincount(rep[running], minlength=nr),
                waiting=np.bincount(rep[~running], minlength=nr),
                kv_used=np.bincount(rep[running], weights=ctx[running], minlength=nr),
                kv_capacity=self.rep_cap,
                bs_max=np.full(nr, self.c.bs_max),
                token_rate=self.rep_rate,
            ),
            requests=RequestView(
                rid=pend,
                replica=rep,
                prompt=st.prompt[pend],
                generated=st.gen[pend],
                running=running,
            ),
        )

    def _replan(self, s: int, t: float, total: int, finished: int) -> None:
        cfg = self.scheme.planner
        if cfg is None:  # guarded by the caller
            return
        snap = self.snapshot(s, t, total, finished)
        st = self.st
        g = st.gen[snap.requests.rid]
        run_g = g[snap.requests.running]
        pl = plan(snap, self.forecaster.estimates(g, run_g, bucket=cfg.bucket), cfg)
        self.plans += 1
        self.replan_ms.append(pl.solve_s * 1e3)
        if pl.apply:
            self.plans_applied += 1
            self._apply_plan(pl, snap, t)

    def _apply_plan(self, pl: Plan, snap: ClusterSnapshot, t: float) -> None:
        c, st = self.c, self.st
        rid = snap.requests.rid
        for node in pl.switched_nodes:
            m = int(pl.node_mode[node])
            self.node_mode[node] = m
            up = t + (switch_time(c.modes[m], c.model, c.hw) if m >= 0 else 0.0)
            self._activate(int(node), m, up)
            mine = rid[(st.rep[rid] // self.slots == node) & (pl.target_node == node)]
            self._count(self.relaid_ids, mine)
            self._place(mine, int(node), up, same_node=True)
        cur_node = st.rep[rid] // self.slots
        movers = pl.target_node != cur_node
        for node in np.unique(pl.target_node[movers]):
            sel = rid[movers & (pl.target_node == node)]
            self._count(self.migrated_ids, sel)
            self._place(sel, int(node), t, same_node=False)

    def _count(self, into: set[int], ids: I64) -> None:
        """Record requests that carry state (tokens generated or KV) as moved."""
        st = self.st
        busy = ids[(st.gen[ids] > 0) | (st.state[ids] == RUN) | (st.state[ids] == TRANSIT)]
        into.update(int(i) + st.base for i in busy)

    def _place(self, ids: I64, node: int, t: float, *, same_node: bool) -> None:
        """Spread ``ids`` over ``node``'s replicas; requests holding KV move it or recompute."""
        if not len(ids):
            return
        st, _c = self.st, self.c
        reps = self._node_reps(node)
        load = np.bincount(st.rep[st.state != DONE], minlength=len(self.rep_mode))[reps]
        order = np.argsort(load, kind="stable")
        st.rep[ids] = reps[order[np.arange(len(ids)) % len(reps)]]
        self._move_kv(ids, t, same_node=same_node)

    def _move_kv(self, ids: I64, t: float, *, same_node: bool) -> None:
        st, c = self.st, self.c
        has_kv = (st.state[ids] == RUN) | (st.state[ids] == TRANSIT)
        kvi = ids[has_kv]
        if len(kvi):
            ctx = st.prompt[kvi] + st.gen[kvi]
            dst = self.c.modes[int(self.rep_mode[st.rep[kvi[0]]])]
            use, cost = kv_move_cost(ctx, dst, c.model, c.hw, same_node=same_node)
            ready = np.maximum(self.rep_clock[st.rep[kvi]], t) + cost
            st.state[kvi] = np.where(use, TRANSIT, WAIT)
            st.ready[kvi] = np.where(use, ready, 0.0)
            st.prefill[kvi] = np.where(use, 0, ctx)

    def _balance(self, s: int, t: float, total: int, finished: int) -> None:
        cfg = self.scheme.balancer
        if cfg is None:  # guarded by the caller
            return
        snap = self.snapshot(s, t, total, finished)
        est = None
        if cfg.steal_moves > 0 and not snap.replicas.waiting.any():
            # the wave's tail: the forecaster's remaining lengths drive work stealing
            g = self.st.gen[snap.requests.rid]
            est = self.forecaster.estimates(g, g[snap.requests.running])
        t0 = time.perf_counter()
        dec = rebalance(snap, cfg, self._bal_mem, est)
        self.balancer_ms.append((time.perf_counter() - t0) * 1e3)
        self._bal_mem = dec.memory
        self._apply_migrations(dec.migrations, t)

    def _apply_migrations(self, moves: tuple[Migration, ...], t: float) -> None:
        st = self.st
        if not moves:
            return
        ids = np.array([m.rid for m in moves], dtype=np.int64)
        dst = np.array([m.dst for m in moves], dtype=np.int64)
        self._count(self.migrated_ids, ids)
        same = (st.rep[ids] // self.slots) == (dst // self.slots)
        st.rep[ids] = dst
        for flag in (True, False):
            sel = ids[same == flag]
            if len(sel):
                self._move_kv(sel, t, same_node=flag)

    def _choose_threshold(self, n: int, fz: FusionConfig) -> ThresholdChoice:
        """``R_t`` and ``m`` for the rest of this step, simulated on a forecast sample."""
        st, c = self.st, self.c
        pend = np.nonzero(st.state != DONE)[0]
        g = st.gen[pend]
        dist = self.forecaster.distribution(g[st.state[pend] != WAIT])
        rng = np.random.default_rng([self.seed, 7, st.base, n - len(pend)])
        rem = dist.remaining_quantile(g, rng.random(len(pend)))
        done = st.state == DONE
        next_tokens = float((st.prompt + st.length)[done].sum() + (st.prompt[pend] + g + rem).sum())
        on = self.node_mode[self.node_mode >= 0]
        mode = c.modes[int(np.bincount(on).argmax())]
        return choose_threshold(
            rem,
            (st.prompt[pend] + g).astype(np.float64),
            total=n,
            next_tokens=next_tokens,
            n_units=len(on),
            unit_replicas=c.hw.gpus_per_node // mode.gpus,
            mode=mode,
            model=c.model,
            hw=c.hw,
            config=fz,
        )

    def _fuse(self, t: float, units: int) -> int:
        """Consolidate the tail on the ``units`` nodes holding most of it; return GPUs freed."""
        st, c = self.st, self.c
        pend = np.nonzero(st.state != DONE)[0]
        on = np.nonzero(self.node_mode >= 0)[0]
        per_node = np.bincount(st.rep[pend] // self.slots, minlength=c.nodes)[on]
        keep = on[select_targets(per_node, units)]
        freed = 0
        for node in on:
            if node in keep:
                continue
            ids = pend[st.rep[pend] // self.slots == node]
            self.node_mode[node] = -1
            self.node_gpus[node] = 0
            self._activate(int(node), -1, t)
            freed += c.hw.gpus_per_node
            self._count(self.migrated_ids, ids)
            for j, dst in enumerate(np.array_split(ids, len(keep))):
                self._place(dst, int(keep[j]), t, same_node=False)
        return freed

    def _next_stage_end(
        self, prompt: I64, length: I64, finish: F64, gen_end: float, fused_at: float, freed: int
    ) -> float:
        c = self.c
        rate = c.hw.flops * c.infer_eta / c.infer_cost  # tokens/s per GPU
        work = float((prompt + length).sum())
        setup = c.infer_setup_s
        r_all = rate * c.gpus
        if fused_at < 0 or freed == 0:
            return gen_end + setup + work / r_all
        avail = float((prompt + length)[finish <= gen_end - 1e-9].sum())
        r1 = rate * freed
        early = min(avail, r1 * max(0.0, gen_end - fused_at - setup))
        left = work - early
        if left <= r1 * setup:
            return gen_end + left / r1
        return gen_end + setup + (left - r1 * setup) / r_all

    def _score_forecast(self) -> None:
        st = self.st
        pend = np.nonzero(st.state != DONE)[0]
        if len(pend) < 2:
            return
        g = st.gen[pend]
        self.forecast_errors.append(self.forecaster.score(g, st.length[pend] - g))


class _StepState:
    """Per-request arrays of the step being simulated (mutable, private to the engine)."""

    def __init__(self, prompt: I64, length: I64, base: int) -> None:
        n = len(length)
        self.base = base
        self.prompt = prompt.astype(np.int64)
        self.length = length.astype(np.int64)
        self.gen = np.zeros(n, dtype=np.int64)
        self.rep = np.zeros(n, dtype=np.int64)
        self.state = np.full(n, WAIT, dtype=np.int64)
        self.prefill = self.prompt.copy()
        self.ready = np.zeros(n)
        self.finish = np.full(n, np.nan)
        self.qseq = np.arange(n, dtype=np.int64)

"""The scheduling layer on a real hub: rollout workers as the instances it steers.

:class:`RolloutScheduler` subscribes to the hub's event stream — the same events the
simulator emits — and runs :mod:`flowrl.sched`'s pure functions on snapshots of the
rollout workers it builds from them. Each worker of one rollout stage is an instance; each
prompt sample waiting for its response is a request. The decisions are applied for real,
through the :class:`~flowrl.Sampler` the rollout stage claims with
(:attr:`RolloutScheduler.sampler`): they decide how many of the ready prompts each worker
claims.

Rollout workers pull: a worker claims only when its previous micro-batch is done, and a
busy worker cannot add requests to the batch it is generating. So, when worker ``w``
claims, the scheduler builds the snapshot in which the ready prompts wait on the idle
workers — where the step's plan put them, else on ``w`` — and busy workers have no free
slot; it runs :func:`~flowrl.sched.rebalance` on it (congestion score: queue over
KV-limited concurrency, times relative slowness, the per-sequence decode rate each worker
showed on its last batches), applies the migrations, and ``w`` takes the oldest of the
prompts left on it. Idle workers thus split the ready work by their service rates instead
of the first one taking a whole micro-batch while the others wait. When no other worker is
idle there is nothing to decide: the claimer takes the oldest ready prompts, without a
balancer tick.

- **planner** — when a step's first prompts arrive (a new ``partition``) and there are
  several workers, :func:`~flowrl.sched.plan` assigns the step's known prompts across
  them; when it predicts a shorter makespan than an even split its assignment is where
  the prompts wait in the balancer's snapshots (a prompt planned for a busy worker waits
  on the claimer instead);
- **forecaster** — :class:`~flowrl.sched.LengthForecaster` observes the events itself
  (prompts open a step; the ``tokens`` of the puts carrying the response column are the
  response lengths, so the rollout stage reports them with ``Rows(tokens=...)``); when a
  step closes, the bucket histogram it predicted for the step's prompts when they arrived
  is scored against the lengths produced (bucket-level relative error).

A rollout worker must say which instance it is: call :meth:`RolloutScheduler.bind` from
the stage's ``setup(ctx)`` with ``ctx.worker``. The sampler runs inside ``claim`` in the
claiming thread (the in-process hub with the threads executor; samplers do not travel over
the wire), so it knows who claims; a claim from an unbound thread is served first-in,
first-out. Subscribe the scheduler as a policy: ``hub.subscribe(sched.observe,
strict=True)``.

Invariants (asserted by tests): a claim takes the oldest ready prompts left on the
claimer (first-in, first-out within a worker, so admission order and staleness bounds are
kept); an idle worker alone with ready prompts always gets some; statistics count what
was applied.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import final

import msgspec
import numpy as np
from numpy.typing import NDArray

from flowrl._controller.samplers import CandidateView, Sampler
from flowrl.errors import ConfigError
from flowrl.events import Event, LeaseExpired, Put, Released
from flowrl.sched.balancer import BalancerConfig, BalancerMemory, rebalance
from flowrl.sched.costmodel import ParallelMode
from flowrl.sched.forecast import ForecastConfig, LengthForecaster, bucket_relative_error
from flowrl.sched.planner import PlannerConfig, plan
from flowrl.sched.snapshot import ClusterSnapshot, ReplicaView, RequestView

__all__ = ["RolloutScheduler", "SchedulerStatistics"]

I64 = NDArray[np.int64]


@final
class SchedulerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler did: claims per worker, plans, balancer moves, forecast error."""

    claimed: tuple[int, ...]
    claims: int
    plans: int
    plans_applied: int
    balancer_ticks: int
    rebalances: int
    migrations: int
    steps_scored: int
    forecast_bucket_error: float


@dataclass(slots=True)
class _Step:
    """One step's prompts: the histogram forecast when they arrived, the lengths so far."""

    prediction: NDArray[np.float64]
    total: int = 0
    lengths: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _State:
    prompt: dict[int, int] = field(default_factory=dict)  # pending: index -> prompt tokens
    running: dict[int, int] = field(default_factory=dict)  # claimed: index -> worker
    planned: dict[int, int] = field(default_factory=dict)  # this step's plan: index -> worker
    step_of: dict[int, int] = field(default_factory=dict)  # pending: index -> step
    steps: dict[int, _Step] = field(default_factory=dict)  # steps with pending prompts
    rates: list[float] = field(default_factory=list)  # tokens/s per sequence, per worker
    claimed_at: list[float] = field(default_factory=list)
    finished: int = 0
    errors: list[float] = field(default_factory=list)


@final
class RolloutScheduler:
    """Planner, balancer and forecaster steering ``workers`` rollout workers (module doc)."""

    def __init__(
        self,
        *,
        task: str,
        workers: int,
        mode: ParallelMode,
        planner: PlannerConfig | None,
        balancer: BalancerConfig,
        forecast: ForecastConfig,
        kv_capacity: int,
        bs_max: int,
    ) -> None:
        if workers < 1 or kv_capacity < 1 or bs_max < 1:
            raise ConfigError(
                "RolloutScheduler needs workers, kv_capacity and bs_max >= 1, got "
                f"{workers}, {kv_capacity}, {bs_max}"
            )
        self.task = task
        self.workers = workers
        self.mode = mode
        self.planner = planner
        self.balancer = balancer
        self.forecaster = LengthForecaster(forecast)
        self.kv_capacity = int(kv_capacity)
        self.bs_max = int(bs_max)
        self.sampler: Sampler = _ScheduledSampler(self)
        self._lock = threading.Lock()
        self._threads: dict[int, int] = {}
        self._s = _State(rates=[0.0] * workers, claimed_at=[0.0] * workers)
        self._memory = BalancerMemory()
        self._partition: str | None = None
        self._step_id = 0
        self._claimed = [0] * workers
        self._claims = self._plans = self._applied = 0
        self._ticks = self._rebalances = self._migrations = 0

    def bind(self, worker: int) -> None:
        """Declare that the calling thread is rollout worker ``worker`` (from ``setup``)."""
        if not 0 <= worker < self.workers:
            raise ConfigError(f"worker must be in 0..{self.workers - 1}, got {worker}")
        with self._lock:
            self._threads[threading.get_ident()] = worker

    # -- events (the hub's dispatcher thread) ----------------------------------------------------
    def observe(self, event: Event) -> None:
        """Feed one hub event (subscribe this with ``strict=True``)."""
        if isinstance(event, Put):
            if event.new:
                self._open(event)
            elif self.forecaster.config.response_column in event.columns:
                self._finish(event)
        elif isinstance(event, (Released, LeaseExpired)) and event.task == self.task:
            with self._lock:  # the samples are ready again
                for i in event.indices:
                    self._s.running.pop(i, None)

    def _open(self, event: Put) -> None:
        """New prompts; a new partition opens a step, which is planned."""
        self.forecaster.observe(event)  # first: a new partition refits the prior
        pred = self.forecaster.predicted_buckets(np.zeros(len(event.indices)))
        with self._lock:
            s = self._s
            new_step = event.partition != self._partition
            if new_step:
                self._partition = event.partition
                self._step_id += 1
                s.steps[self._step_id] = _Step(np.zeros_like(pred))
                s.planned = {}
                self._maybe_score(self._step_id - 1)
            step = s.steps[self._step_id]
            step.prediction += pred
            step.total += len(event.indices)
            for i, tok in zip(event.indices, event.tokens, strict=True):
                s.prompt.setdefault(i, int(tok))
                s.step_of[i] = self._step_id
            if new_step and self.planner is not None and self.workers > 1:
                self._replan(self.planner, event.indices)

    def _finish(self, event: Put) -> None:
        self.forecaster.observe(event)
        with self._lock:
            produced = [0] * self.workers
            done = [0] * self.workers
            for i, tok in zip(event.indices, event.tokens, strict=True):
                self._s.prompt.pop(i, None)
                self._s.planned.pop(i, None)
                self._record(i, int(tok))
                w = self._s.running.pop(i, -1)
                if w >= 0:
                    produced[w] += int(tok)
                    done[w] += 1
            for w, k in enumerate(done):
                if k:  # tokens per second per sequence of the batch the worker claimed
                    rate = produced[w] / k / max(event.t - self._s.claimed_at[w], 1e-3)
                    old = self._s.rates[w]
                    self._s.rates[w] = rate if not old else 0.5 * old + 0.5 * rate

    def _record(self, i: int, length: int) -> None:
        self._s.finished += 1
        sid = self._s.step_of.pop(i, None)
        if sid is not None:
            self._s.steps[sid].lengths.append(length)
            self._maybe_score(sid)

    def _maybe_score(self, sid: int) -> None:
        """Once a step is no longer current and all its prompts responded, score its forecast."""
        step = self._s.steps.get(sid)
        if step is None or sid == self._step_id or len(step.lengths) < step.total:
            return
        del self._s.steps[sid]
        nb = len(step.prediction)
        bins = np.minimum(np.asarray(step.lengths) // self.forecaster.config.bucket, nb - 1)
        actual = np.bincount(bins.astype(np.int64), minlength=nb).astype(np.float64)
        self._s.errors.append(bucket_relative_error(step.prediction, actual))

    # -- snapshots and decisions (caller holds the lock) ---------------------------------------
    def _snapshot(self, waiting: I64, where: I64) -> ClusterSnapshot:
        """Running requests where they run; ``waiting`` on ``where``; busy workers full."""
        s = self._s
        w = self.workers
        run = np.fromiter(s.running, np.int64, len(s.running))
        run_on = np.fromiter(s.running.values(), np.int64, len(s.running))
        rid = np.concatenate([run, waiting])
        rep = np.concatenate([run_on, where])
        prompt = np.array([s.prompt.get(int(i), 1) for i in rid], dtype=np.int64)
        running = np.arange(len(rid)) < len(run)
        n_run = np.bincount(run_on, minlength=w)
        return ClusterSnapshot(
            t=time.time(),
            step=0,
            total=len(rid) + s.finished,
            finished=s.finished,
            modes=(self.mode,),
            node_mode=np.zeros(w, dtype=np.int64),
            node_gpus=np.full(w, self.mode.gpus, dtype=np.int64),
            replicas=ReplicaView(
                node=np.arange(w),
                mode=np.zeros(w, dtype=np.int64),
                running=n_run,
                waiting=np.bincount(where, minlength=w),
                kv_used=np.bincount(run_on, weights=prompt[running], minlength=w),
                kv_capacity=np.full(w, self.kv_capacity),
                bs_max=np.where(n_run > 0, n_run, self.bs_max),  # a batch in flight is fixed
                token_rate=np.asarray(s.rates) * np.maximum(n_run, 1),
            ),
            requests=RequestView(
                rid=rid,
                replica=rep,
                prompt=prompt,
                generated=np.zeros(len(rid), dtype=np.int64),
                running=running,
            ),
        )

    def _replan(self, cfg: PlannerConfig, fresh: tuple[int, ...]) -> None:
        """Plan the step's first prompts across the workers (spread evenly to start)."""
        waiting = np.asarray(fresh, dtype=np.int64)
        snap = self._snapshot(waiting, np.arange(len(waiting)) % self.workers)
        g = np.zeros(len(snap.requests))
        decision = plan(snap, self.forecaster.estimates(g, g[snap.requests.running]), cfg)
        self._plans += 1
        if decision.apply:
            self._applied += 1
            n_run = len(self._s.running)
            targets = decision.target_node[n_run:].tolist()
            self._s.planned.update(zip(waiting.tolist(), targets, strict=True))

    def _select(self, view: CandidateView, n: int) -> I64:
        worker = self._threads.get(threading.get_ident())
        if worker is None:
            return np.arange(min(n, len(view)), dtype=np.int64)
        with self._lock:
            s = self._s
            idx = view.indices
            for i, tok in zip(idx.tolist(), view.tokens.tolist(), strict=True):
                s.prompt.setdefault(i, int(tok))  # ready before its event reached us
            busy = np.zeros(self.workers, dtype=bool)
            busy[list(s.running.values())] = True
            if busy.sum() >= self.workers - 1:  # no other idle worker: nothing to decide
                take = np.arange(min(n, len(idx)), dtype=np.int64)
            else:
                take = self._balanced_take(idx, worker, busy, n)
            if len(take):
                for i in idx[take].tolist():
                    s.running[i] = worker
                self._claimed[worker] += len(take)
                self._claims += 1
                s.claimed_at[worker] = time.time()
            return take

    def _balanced_take(self, idx: I64, worker: int, busy: NDArray[np.bool_], n: int) -> I64:
        """Positions ``worker`` takes once the balancer spread the ready prompts (module doc)."""
        where = np.array([self._s.planned.get(i, worker) for i in idx.tolist()], dtype=np.int64)
        where[busy[where]] = worker
        decision = rebalance(self._snapshot(idx, where), self.balancer, self._memory)
        self._memory = decision.memory
        self._ticks += 1
        pos = {int(i): k for k, i in enumerate(idx.tolist())}
        moved = [m for m in decision.migrations if not m.running and m.rid in pos]
        for m in moved:
            where[pos[m.rid]] = m.dst
        self._migrations += len(moved)
        self._rebalances += bool(moved)
        return np.flatnonzero(where == worker)[:n].astype(np.int64)

    def statistics(self) -> SchedulerStatistics:
        with self._lock:
            errs = self._s.errors
            return SchedulerStatistics(
                claimed=tuple(self._claimed),
                claims=self._claims,
                plans=self._plans,
                plans_applied=self._applied,
                balancer_ticks=self._ticks,
                rebalances=self._rebalances,
                migrations=self._migrations,
                steps_scored=len(errs),
                forecast_bucket_error=float(np.mean(errs)) if errs else float("nan"),
            )


@final
class _ScheduledSampler(Sampler):
    """The rollout stage's sampler: the scheduler decides how many prompts a worker takes."""

    def __init__(self, scheduler: RolloutScheduler) -> None:
        self._scheduler = scheduler

    def select(self, view: CandidateView, n: int) -> np.ndarray:
        return self._scheduler._select(view, n)

    def __repr__(self) -> str:
        return f"ScheduledSampler(task={self._scheduler.task!r})"

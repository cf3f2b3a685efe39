"""The generating processes of ``--placement disaggregated`` (``flowrl.recipes.grpo_placement``).

* The *rollout process* runs the prompt source and the rollout workers
  (:func:`~flowrl.recipes.grpo_stages.rollout_pipeline`) on the rollout cores.
* The *idle-core rollout process* (``--rollout-on-trainer-cores``) runs one more rollout
  worker (:func:`~flowrl.recipes.grpo_stages.idle_rollout_pipeline`) on the trainer's cores
  at the lowest CPU priority, ``SCHED_IDLE``: the kernel runs it only while nothing else
  wants those cores, so it generates while the trainer waits for data and gives way to it
  at once. One torch thread: an OpenMP team whose members can be preempted at any moment
  waits for the slowest.

Both claim from the hub's ``Rollout`` task and read the trainer's weights from the same
shared-memory channel, so the hub's leases keep each sample generated once, and the
staleness bound holds for both as for any rollout worker: prompts enter the hub only
within the window (the source's admission control), and a worker loads the newest
version before each micro-batch and between decoding steps. The idle-core process's
claims are leased for :func:`idle_lease_s` (a quarter of ``--stall-timeout``, at most 30
s): if it dies, or the machine's other work starves it that long, its samples go back to
the hub (the other workers resume them from their stored prefixes, ``--append-every``)
before the trainer would call the run stalled, and a result that comes back after its
lease is dropped (the hub refuses it).

Each process reports once on a pipe: its stages' sample counts, or its error.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

import flowrl
from flowrl import WeightSubscriber
from flowrl._weights.sync import load_named
from flowrl.errors import StageError, Timeout
from flowrl.recipes.grpo_config import GRPOConfig
from flowrl.recipes.grpo_rollout import RolloutBackend
from flowrl.recipes.grpo_stages import idle_rollout_pipeline, rollout_pipeline
from flowrl.recipes.grpo_task import make_task, max_new_tokens
from flowrl.recipes.grpo_trainer import build_model

__all__ = [
    "RolloutJob",
    "RolloutProcess",
    "SubscribedWeights",
    "idle_lease_s",
    "lowest_priority",
    "pin",
    "rollout_main",
]

_FIRST_VERSION_S = 600.0  # the trainer's warm-up comes first
_POLL_S = 0.05
_IDLE_LEASE_MAX_S = 30.0


def pin(cpus: tuple[int, ...], threads: int) -> None:
    """Run this process on ``cpus`` with ``threads`` torch threads (0: one per core)."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads or len(cpus))


def lowest_priority() -> None:
    """Run this thread, and the threads it starts, only on otherwise idle cores
    (``SCHED_IDLE``; an unprivileged process may lower itself to it)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def idle_lease_s(cfg: GRPOConfig) -> float:
    """Seconds an idle-core rollout claim may take before its samples go back (module
    docstring): well inside the trainer's patience (``--stall-timeout``)."""
    return min(_IDLE_LEASE_MAX_S, cfg.stall_timeout / 4)


class SubscribedWeights:
    """A rollout process's weight source: the trainer's versions, read from the
    shared-memory channel (the interface of :class:`~flowrl.WeightStore` that the
    samplers use). Rollout workers share it, so calls are serialised."""

    def __init__(self, subscriber: WeightSubscriber) -> None:
        self._subscriber = subscriber
        self._lock = threading.Lock()

    def pull(self, model: torch.nn.Module, have: int) -> int:
        with self._lock:
            snapshot = self._subscriber.poll(have)
            if snapshot is None:
                return have
            with snapshot:
                load_named(model, snapshot.tensors())
                return snapshot.version

    def newer(self, have: int) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        with self._lock:
            snapshot = self._subscriber.poll(have)
            if snapshot is None:
                return None
            with snapshot:
                return snapshot.version, [(n, t.clone()) for n, t in snapshot.tensors()]

    def wait_first(self, timeout: float) -> None:
        """Return once a version is published; :class:`Timeout` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.newer(-1) is None:
            if time.monotonic() > deadline:
                raise Timeout(f"the trainer published no weights in {timeout:g}s")
            time.sleep(_POLL_S)


class RolloutJob(msgspec.Struct, frozen=True, kw_only=True):
    """What one generating process does: on ``cores`` with ``threads`` torch threads
    (0: one per core), from ``start_step``'s problems. ``idle``: the idle-core process
    (no source, lowest priority, claims leased ``lease_s``); else the rollout process,
    whose source makes ``samples`` samples."""

    cores: tuple[int, ...]
    threads: int
    start_step: int
    samples: int = 0
    idle: bool = False
    lease_s: float | None = None


class _Done(msgspec.Struct, frozen=True, tag=True):
    stage_samples: dict[str, int]


class _Failed(msgspec.Struct, frozen=True, tag=True):
    stage: str
    message: str
    traceback: str


_REPORT = msgspec.json.Decoder(_Done | _Failed)


class RolloutProcess:
    """A generating process as the trainer sees it: started at once (spawned: no state of
    the trainer's is inherited), reporting once, stopped by :meth:`close`."""

    def __init__(
        self, cfg: GRPOConfig, address: str, channel: str, job: RolloutJob, *, name: str
    ) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=rollout_main,
            args=(msgspec.json.encode(cfg), address, channel, msgspec.json.encode(job), child),
            name=name,
        )
        try:
            self._process.start()
        finally:
            child.close()
        self._report: _Done | _Failed | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def failure(self) -> StageError | None:
        """Its failure, or its death without a report, as an error; None while it runs
        or once it is done."""
        report = self._receive(0)
        if isinstance(report, _Failed):
            return StageError(
                f"the {self.name} process failed: {report.message}\n{report.traceback}",
                stage=report.stage,
            )
        if report is None and not self._process.is_alive():
            return StageError(
                f"the {self.name} process died (exit code {self._process.exitcode}) "
                "without a report",
                stage="Rollout",
            )
        return None

    @property
    def died(self) -> bool:
        """Whether it ended without a report (killed, or crashed in the interpreter)."""
        return self._receive(0) is None and not self._process.is_alive()

    def wait(self, timeout: float) -> dict[str, int] | None:
        """Its stages' sample counts once it is done, waiting up to ``timeout`` s; None if
        it did not finish (see :meth:`failure`)."""
        report = self._receive(timeout)
        return report.stage_samples if isinstance(report, _Done) else None

    def _receive(self, timeout: float) -> _Done | _Failed | None:
        if self._report is None and self._conn.poll(timeout):
            with contextlib.suppress(EOFError):  # it died: nothing to read
                self._report = _REPORT.decode(self._conn.recv_bytes())
        return self._report

    def close(self) -> None:
        """Ask it to stop (if running) and wait; kill it if it does not stop in 30 s."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()


def rollout_main(
    cfg_json: bytes, address: str, channel: str, job_json: bytes, conn: Connection
) -> None:
    """A generating process: run ``job`` into the hub at ``address`` with the weights of
    ``channel``; report how it went on ``conn`` (a stop message there ends it early)."""
    report: _Done | _Failed
    try:
        job = msgspec.json.decode(job_json, type=RolloutJob)
        if job.idle:  # first: the threads started from here on inherit it
            lowest_priority()
        pin(job.cores, job.threads)
        cfg = msgspec.json.decode(cfg_json, type=GRPOConfig)
        report = _generate(cfg, address, channel, job, conn)
    except BaseException as exc:
        stage = getattr(exc, "stage", "") or "Rollout"
        report = _Failed(stage, f"{type(exc).__name__}: {exc}", traceback.format_exc())
    with contextlib.suppress(OSError):  # the trainer is gone
        conn.send_bytes(msgspec.json.encode(report))


def _generate(
    cfg: GRPOConfig, address: str, channel: str, job: RolloutJob, conn: Connection
) -> _Done:
    torch.manual_seed(cfg.seed)
    with contextlib.ExitStack() as stack:
        hub = flowrl.connect(address)
        stack.callback(hub.close)
        subscriber = WeightSubscriber(channel)
        stack.callback(subscriber.close)
        weights = SubscribedWeights(subscriber)
        first = job.start_step * cfg.prompts_per_step * cfg.group_size
        backend = RolloutBackend(
            cfg, weights, build_model(cfg), max_new_tokens(cfg), first_sample=first
        )
        stack.callback(backend.close)
        if job.idle:
            pipe = idle_rollout_pipeline(cfg, backend, lease_timeout=job.lease_s)
        else:
            task = make_task(cfg, cfg.seed)
            pipe = rollout_pipeline(cfg, task, backend, None, start_step=job.start_step)
        weights.wait_first(_FIRST_VERSION_S)
        run = pipe.start(hub, max_samples=None if job.idle else job.samples)
        while not run.done():
            if conn.poll(_POLL_S):  # the trainer is done, or failed
                run.stop()
                break
        result = run.result(timeout=60)
        return _Done({n: s.samples for n, s in result.stages.items()})

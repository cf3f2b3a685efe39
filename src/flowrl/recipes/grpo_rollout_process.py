"""The rollout process of ``--placement disaggregated`` (``flowrl.recipes.grpo_placement``).

It runs the prompt source and the rollout workers
(:func:`~flowrl.recipes.grpo_stages.rollout_pipeline`) on the rollout cores, reading the
trainer's weights from the shared-memory channel, and talks to the trainer on a pipe:
``ready`` once it is connected and its model and rollout engines are built (only the
first version is missing), then one report, its stages' sample counts or its error.
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
from flowrl.recipes.grpo_stages import rollout_pipeline
from flowrl.recipes.grpo_task import make_task, max_new_tokens
from flowrl.recipes.grpo_trainer import build_model

__all__ = ["RolloutJob", "RolloutProcess", "SubscribedWeights", "pin", "rollout_main"]

_FIRST_VERSION_S = 600.0  # the trainer's warm-up comes first
_POLL_S = 0.05


def pin(cpus: tuple[int, ...], threads: int) -> None:
    """Run this process on ``cpus`` with ``threads`` torch threads (0: one per core)."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads or len(cpus))


class SubscribedWeights:
    """The rollout process's weight source: the trainer's versions, read from the
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
    """What the rollout process does: generate ``samples`` samples from ``start_step``'s
    problems on ``cores`` with ``threads`` torch threads (0: one per core)."""

    cores: tuple[int, ...]
    threads: int
    start_step: int
    samples: int


class _Ready(msgspec.Struct, frozen=True, tag=True):
    pass


class _Done(msgspec.Struct, frozen=True, tag=True):
    stage_samples: dict[str, int]


class _Failed(msgspec.Struct, frozen=True, tag=True):
    stage: str
    message: str
    traceback: str


_MESSAGE = msgspec.json.Decoder(_Ready | _Done | _Failed)


class RolloutProcess:
    """The rollout process as the trainer sees it: started at once (spawned: none of the
    trainer's state is inherited), ready once, reporting once, stopped by :meth:`close`."""

    def __init__(self, cfg: GRPOConfig, address: str, channel: str, job: RolloutJob) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=rollout_main,
            args=(msgspec.json.encode(cfg), address, channel, msgspec.json.encode(job), child),
            name="flowrl-rollout",
        )
        try:
            self._process.start()
        finally:
            child.close()
        self._ready = False
        self._report: _Done | _Failed | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def failure(self) -> StageError | None:
        """Its failure, or its death without a report, as an error; None while it runs
        or once it is done."""
        while self._receive(0):  # everything it sent (a report may follow "ready")
            pass
        if isinstance(self._report, _Failed):
            return StageError(
                f"the rollout process failed: {self._report.message}\n{self._report.traceback}",
                stage=self._report.stage,
            )
        if self._report is None and not self._process.is_alive():
            return StageError(
                f"the rollout process died (exit code {self._process.exitcode}) without a report",
                stage="Rollout",
            )
        return None

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for it to be ready (or to have reported); whether it is."""
        deadline = time.monotonic() + timeout
        while not self._ready and self._report is None and self._process.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(min(left, _POLL_S))
        return self._ready

    def wait(self, timeout: float) -> dict[str, int] | None:
        """Its stages' sample counts once it is done, waiting up to ``timeout`` s; None if
        it did not finish (see :meth:`failure`)."""
        deadline = time.monotonic() + timeout
        while self._report is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._receive(left):
                break
        return self._report.stage_samples if isinstance(self._report, _Done) else None

    def _receive(self, timeout: float) -> bool:
        """Read one message if one comes within ``timeout`` s; whether one did."""
        if self._report is not None or not self._conn.poll(timeout):
            return False
        try:
            message = _MESSAGE.decode(self._conn.recv_bytes())
        except EOFError:  # it died: nothing more will come
            return False
        if isinstance(message, _Ready):
            self._ready = True
        else:
            self._report = message
        return True

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
    """The rollout process: run ``job`` into the hub at ``address`` with the weights of
    ``channel``; tell ``conn`` when it is ready and how it went (a stop message there ends
    it early)."""
    report: _Done | _Failed
    try:
        job = msgspec.json.decode(job_json, type=RolloutJob)
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
        backend.prepare(cfg.rollout_workers)  # (a vLLM engine starts in seconds: not in step 1)
        task = make_task(cfg, cfg.seed)
        pipe = rollout_pipeline(cfg, task, backend, None, start_step=job.start_step)
        conn.send_bytes(msgspec.json.encode(_Ready()))
        weights.wait_first(_FIRST_VERSION_S)
        run = pipe.start(hub, max_samples=job.samples)
        while not run.done():
            if conn.poll(_POLL_S):  # the trainer is done, or failed
                run.stop()
                break
        result = run.result(timeout=60)
        return _Done({n: s.samples for n, s in result.stages.items()})

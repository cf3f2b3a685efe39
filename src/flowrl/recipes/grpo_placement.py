"""Where the job's stages run (``--placement``) and on which CPU cores.

* ``colocated`` (the default): one process; every stage is a thread of it, through an
  embedded hub, each with one torch thread (several stages compute at once).
* ``disaggregated``: two processes, as generation and training run on separate GPUs of a
  cluster. The *rollout process* runs the prompt source and the rollout workers
  (:func:`~flowrl.recipes.grpo_stages.rollout_pipeline`); this one, the *trainer process*,
  runs reward, log-probs and advantages (:func:`~flowrl.recipes.grpo_stages.trainer_pipeline`)
  and the optimizer step. They share a multi-process hub (:func:`flowrl.launch_hub`: its
  controller and storage unit are small server processes of their own), and the trainer
  publishes each version through the shared-memory weight channel
  (:class:`flowrl.WeightPublisher`), which the rollout workers poll between micro-batches
  and decoding steps. The rollout process takes the first half of this process's CPU
  cores (``os.sched_setaffinity``), the trainer the rest, each with as many torch threads
  as cores.

  At ``--max-staleness 0`` generation and training cannot overlap (step k + 1's prompts
  wait for version k + 1), so split cores would leave half of them idle: each process then
  gets every core, as a synchronous trainer time-shares its GPUs between generation and
  training, and the trainer's stages take whole steps, so no two phases ever compute at
  once. That is the fair synchronous baseline of ``benchmarks/real_stream.py``.

The scheduling layer (``--schedule``) steers the rollout workers only in the colocated
placement: its sampler is a Python object that runs on an in-process hub, so the rollout
process's workers claim in arrival order.

The rollout process starts before the warm-up (its imports overlap it) and waits for the
first published version. Its failure is raised in the trainer (:meth:`Disaggregated.check`,
called while the trainer waits for a batch); the trainer stopping stops it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import torch

import flowrl
from flowrl import WeightPublisher, WeightSubscriber
from flowrl._weights.sync import load_named
from flowrl.errors import ConfigError, StageError, Timeout
from flowrl.recipes.grpo_config import GRPOConfig, flag
from flowrl.recipes.grpo_rollout import RolloutBackend
from flowrl.recipes.grpo_stages import ROLLOUT_COLUMNS, rollout_pipeline
from flowrl.recipes.grpo_task import make_task, max_new_tokens
from flowrl.recipes.grpo_trainer import build_model

__all__ = ["Cores", "Disaggregated", "SubscribedWeights", "plan_cores", "rollout_main"]

_FIRST_VERSION_S = 600.0  # the trainer's warm-up comes first
_POLL_S = 0.05


@dataclass(frozen=True)
class Cores:
    """The CPU cores each side runs on, and its torch threads (0: one per core)."""

    rollout: tuple[int, ...]
    trainer: tuple[int, ...]
    threads: int = 0


def plan_cores(cfg: GRPOConfig) -> Cores | None:
    """The disaggregated placement's cores (module docstring); None when colocated. Refuses
    a machine (or affinity mask) with fewer than two cores before anything starts."""
    if cfg.placement == "colocated":
        return None
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2:
        raise ConfigError(
            f"{flag('placement')} disaggregated: expected at least 2 CPU cores (one for "
            f"rollout, one for the trainer), got {len(cpus)} ({cpus}); use "
            f"{flag('placement')} colocated"
        )
    if cfg.max_staleness == 0:
        return Cores(cpus, cpus, cfg.torch_threads)
    half = len(cpus) // 2
    return Cores(cpus[:half], cpus[half:], cfg.torch_threads)


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


class _Done(msgspec.Struct, frozen=True, tag=True):
    stage_samples: dict[str, int]


class _Failed(msgspec.Struct, frozen=True, tag=True):
    stage: str
    message: str
    traceback: str


_REPORT = msgspec.json.Decoder(_Done | _Failed)


class Disaggregated:
    """The trainer's handle on a disaggregated run: the hub, the weight channel and the
    rollout process, started before the warm-up (module docstring). The trainer's own
    pipeline registers on :attr:`hub` before the first version is published."""

    def __init__(self, cfg: GRPOConfig, cores: Cores, *, start_step: int) -> None:
        self.cores = cores
        channel = f"flowrl-grpo-{os.getpid()}-{secrets.token_hex(3)}"
        self._publisher = WeightPublisher(channel)
        try:
            self.hub = flowrl.launch_hub(
                ROLLOUT_COLUMNS, config=flowrl.HubConfig(capacity=cfg.hub_capacity)
            )
        except BaseException:
            self._publisher.close()
            raise
        try:
            samples = (cfg.steps - start_step) * cfg.prompts_per_step * cfg.group_size
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._process = ctx.Process(
                target=rollout_main,
                args=(msgspec.json.encode(cfg), self.hub.address, channel, cores),
                kwargs={"start_step": start_step, "samples": samples, "conn": child},
                name="flowrl-rollout",
            )
            self._process.start()
            child.close()
        except BaseException:
            self.hub.close()
            self._publisher.close()
            raise
        self._report: _Done | _Failed | None = None

    @property
    def pid(self) -> int | None:
        """The rollout process's id."""
        return self._process.pid

    def start(self) -> None:
        """The warm-up is over: the trainer takes its own cores."""
        pin(self.cores.trainer, self.cores.threads)

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Hand a new version to the rollout process (before ``hub.publish_version``)."""
        self._publisher.publish(weights, version)

    def check(self) -> None:
        """Raise the rollout process's failure, or its death, if it failed or died."""
        report = self._receive(0)
        if isinstance(report, _Failed):
            raise StageError(
                f"the rollout process failed: {report.message}\n{report.traceback}",
                stage=report.stage,
            )
        if report is None and not self._process.is_alive():
            raise StageError(
                f"the rollout process died (exit code {self._process.exitcode}) without a report",
                stage="Rollout",
            )

    def finish(self, timeout: float = 60.0) -> dict[str, int]:
        """Wait for the rollout process's report after the last step: its stages' sample
        counts."""
        report = self._receive(timeout)
        self.check()
        if not isinstance(report, _Done):
            raise Timeout(f"the rollout process did not finish within {timeout:g}s")
        return report.stage_samples

    def close(self) -> None:
        """Stop the rollout process (if running), then the weight channel and the hub."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()
        self._publisher.close()
        self.hub.close()

    def _receive(self, timeout: float) -> _Done | _Failed | None:
        if self._report is None and self._conn.poll(timeout):
            with contextlib.suppress(EOFError):
                self._report = _REPORT.decode(self._conn.recv_bytes())
        return self._report


def rollout_main(
    cfg_json: bytes,
    address: str,
    channel: str,
    cores: Cores,
    *,
    start_step: int,
    samples: int,
    conn: Connection,
) -> None:
    """The rollout process: generate ``samples`` samples (from ``start_step``'s problems)
    into the hub at ``address`` with the weights of ``channel``, on ``cores.rollout``; report how
    it went on ``conn`` (a stop message there ends it early)."""
    report: _Done | _Failed
    try:
        report = _generate(cfg_json, address, channel, cores, start_step, samples, conn)
    except BaseException as exc:
        stage = getattr(exc, "stage", "") or "Rollout"
        report = _Failed(stage, f"{type(exc).__name__}: {exc}", traceback.format_exc())
    with contextlib.suppress(OSError):  # the trainer is gone
        conn.send_bytes(msgspec.json.encode(report))


def _generate(
    cfg_json: bytes,
    address: str,
    channel: str,
    cores: Cores,
    start_step: int,
    samples: int,
    conn: Connection,
) -> _Done:
    pin(cores.rollout, cores.threads)
    cfg = msgspec.json.decode(cfg_json, type=GRPOConfig)
    torch.manual_seed(cfg.seed)
    max_new = max_new_tokens(cfg)
    with contextlib.ExitStack() as stack:
        hub = flowrl.connect(address)
        stack.callback(hub.close)
        subscriber = WeightSubscriber(channel)
        stack.callback(subscriber.close)
        weights = SubscribedWeights(subscriber)
        first = start_step * cfg.prompts_per_step * cfg.group_size
        backend = RolloutBackend(cfg, weights, build_model(cfg), max_new, first_sample=first)
        stack.callback(backend.close)
        task = make_task(cfg, cfg.seed)
        pipe = rollout_pipeline(cfg, task, backend, None, start_step=start_step)
        weights.wait_first(_FIRST_VERSION_S)
        run = pipe.start(hub, max_samples=samples)
        while not run.done():
            if conn.poll(_POLL_S):  # the trainer is done, or failed
                run.stop()
                break
        result = run.result(timeout=60)
        return _Done({n: s.samples for n, s in result.stages.items()})

"""Where the job's stages run (``--placement``) and on which CPU cores.

* ``colocated`` (the default): one process; every stage is a thread of it, through an
  embedded hub, each with one torch thread (several stages compute at once).
* ``disaggregated``: separate processes, as generation and training run on separate GPUs
  of a cluster. The *rollout process* runs the prompt source and the rollout workers
  (:func:`~flowrl.recipes.grpo_stages.rollout_pipeline`); this one, the *trainer process*,
  runs reward, log-probs and advantages (:func:`~flowrl.recipes.grpo_stages.trainer_pipeline`)
  and the optimizer step. They share a multi-process hub (:func:`flowrl.launch_hub`: its
  controller and storage unit are small server processes of their own), and the trainer
  publishes each version through the shared-memory weight channel
  (:class:`flowrl.WeightPublisher`), which the rollout workers poll between micro-batches
  and decoding steps. The rollout process takes the first half of this process's CPU
  cores (``os.sched_setaffinity``), the trainer the rest, each with as many torch threads
  as cores.

  With ``--rollout-on-trainer-cores`` (on by default) an *idle-core rollout process* runs
  one more rollout worker on the trainer's cores at the lowest CPU priority
  (``SCHED_IDLE``): it generates while the trainer waits for data, which it does whenever
  generation is the slower side, and yields the cores the moment the trainer has work.
  It obeys the same leases and staleness bound as the other workers, and the run
  outlives it: if it dies, its claims go back to the hub within :func:`idle_lease_s`
  (``flowrl.recipes.grpo_rollout_process``).

  At ``--max-staleness 0`` generation and training cannot overlap (step k + 1's prompts
  wait for version k + 1), so split cores would leave half of them idle: each process then
  gets every core, as a synchronous trainer time-shares its GPUs between generation and
  training, and the trainer's stages take whole steps, so no two phases ever compute at
  once. That is the fair synchronous baseline of ``benchmarks/real_stream.py``; the
  idle-core process runs there too (on every core), so generation has the idle cores in
  both modes.

The scheduling layer (``--schedule``) steers the rollout workers only in the colocated
placement: its sampler is a Python object that runs on an in-process hub, so the rollout
processes' workers claim in arrival order.

The generating processes start before the warm-up (their imports overlap it) and wait for
the first published version. A failure of either, or the rollout process's death, is
raised in the trainer (:meth:`Disaggregated.check`, called while the trainer waits for a
batch); the trainer stopping stops them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import flowrl
from flowrl import WeightPublisher
from flowrl.errors import ConfigError, Timeout
from flowrl.recipes.grpo_config import GRPOConfig, flag
from flowrl.recipes.grpo_rollout_process import (
    RolloutJob,
    RolloutProcess,
    idle_lease_s,
    pin,
)
from flowrl.recipes.grpo_stages import ROLLOUT_COLUMNS
from flowrl.recipes.progress import log

__all__ = ["Cores", "Disaggregated", "plan_cores"]


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


class Disaggregated:
    """The trainer's handle on a disaggregated run: the hub, the weight channel and the
    generating processes, started before the warm-up (module docstring). The trainer's
    own pipeline registers on :attr:`hub` before the first version is published."""

    def __init__(self, cfg: GRPOConfig, cores: Cores, *, start_step: int) -> None:
        self.cores = cores
        channel = f"flowrl-grpo-{os.getpid()}-{secrets.token_hex(3)}"
        self._publisher = WeightPublisher(channel)
        self._processes: list[RolloutProcess] = []
        try:
            self.hub = flowrl.launch_hub(
                ROLLOUT_COLUMNS, config=flowrl.HubConfig(capacity=cfg.hub_capacity)
            )
        except BaseException:
            self._publisher.close()
            raise
        try:
            samples = (cfg.steps - start_step) * cfg.prompts_per_step * cfg.group_size
            job = RolloutJob(
                cores=cores.rollout, threads=cores.threads, start_step=start_step, samples=samples
            )
            address = self.hub.address
            self.rollout = RolloutProcess(cfg, address, channel, job, name="rollout")
            self._processes.append(self.rollout)
            self.idle: RolloutProcess | None = None
            if cfg.rollout_on_trainer_cores:
                job = RolloutJob(
                    cores=cores.trainer,
                    threads=1,
                    start_step=start_step,
                    idle=True,
                    lease_s=idle_lease_s(cfg),
                )
                self.idle = RolloutProcess(cfg, address, channel, job, name="idle-core rollout")
                self._processes.append(self.idle)
        except BaseException:
            self.close()
            raise
        self._idle_died = False
        self.idle_samples: int | None = None  # set by finish

    @property
    def pid(self) -> int | None:
        """The rollout process's id."""
        return self.rollout.pid

    def start(self) -> None:
        """The warm-up is over: the trainer takes its own cores."""
        pin(self.cores.trainer, self.cores.threads)

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Hand a new version to the generating processes (before ``hub.publish_version``)."""
        self._publisher.publish(weights, version)

    def check(self) -> None:
        """Raise a generating process's failure, or the rollout process's death. The
        idle-core process's death is logged once: the run goes on without it (its claims
        come back to the hub when their leases end)."""
        error = self.rollout.failure()
        if error is not None:
            raise error
        if self.idle is None or self._idle_died:
            return
        error = self.idle.failure()
        if error is not None and not self.idle.died:
            raise error  # it failed, and said why: the rollout process runs the same code
        if error is not None:
            self._idle_died = True
            log.warning("%s; the run goes on without it", error)

    def finish(self, timeout: float = 60.0) -> dict[str, int]:
        """Wait for the generating processes' reports after the last step: their stages'
        sample counts (``Rollout``: both processes'); the idle-core process's share is
        :attr:`idle_samples` (None: it died)."""
        counts = self.rollout.wait(timeout)
        self.check()
        if counts is None:
            raise Timeout(f"the rollout process did not finish within {timeout:g}s")
        if self.idle is not None:
            idle = self.idle.wait(timeout)
            self.check()
            if idle is None and not self.idle.died:
                raise Timeout(f"the idle-core rollout process did not finish within {timeout:g}s")
            self.idle_samples = None if idle is None else idle.get("Rollout", 0)
            counts["Rollout"] += self.idle_samples or 0
        return counts

    def idle_summary(self) -> dict[str, Any] | None:
        """For the job's summary (None without the idle-core process): the samples it
        generated (None if it died), whether it died, and the ``Rollout`` samples whose
        lease ran out (a dead or starved worker's, handed out again)."""
        if self.idle is None:
            return None
        expired = self.hub.statistics().counters.tasks.get("Rollout")
        return {
            "samples": self.idle_samples,
            "died": self.idle.died,
            "rollout_leases_expired": 0 if expired is None else expired.expired,
        }

    def close(self) -> None:
        """Stop the generating processes (if running), then the weight channel and the hub."""
        for process in self._processes:
            process.close()
        self._publisher.close()
        self.hub.close()

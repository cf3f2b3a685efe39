"""Where the job's stages run (``--placement``) and on which CPU cores.

* ``colocated`` (the default): one process; every stage is a thread of it, through an
  embedded hub, each with one torch thread (several stages compute at once).
* ``disaggregated``: two processes, as generation and training run on separate GPUs of a
  cluster. The *rollout process* (``flowrl.recipes.grpo_rollout_process``) runs the
  prompt source and the rollout workers
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

The rollout process starts before the warm-up (its imports overlap it). The trainer
starts the RL loop once it is ready (:meth:`Disaggregated.wait_ready`: connected, its
model built; a resumed run has no warm-up to hide that behind), and it waits for the
first published version. Its failure is raised in the trainer
(:meth:`Disaggregated.check`, called while the trainer waits for a batch); the trainer
stopping stops it.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

import flowrl
from flowrl import WeightPublisher
from flowrl.errors import ConfigError, Timeout
from flowrl.recipes.grpo_config import GRPOConfig, flag
from flowrl.recipes.grpo_rollout_process import RolloutJob, RolloutProcess, pin
from flowrl.recipes.grpo_stages import ROLLOUT_COLUMNS

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
            job = RolloutJob(
                cores=cores.rollout, threads=cores.threads, start_step=start_step, samples=samples
            )
            self._rollout = RolloutProcess(cfg, self.hub.address, channel, job)
        except BaseException:
            self.hub.close()
            self._publisher.close()
            raise

    @property
    def pid(self) -> int | None:
        """The rollout process's id."""
        return self._rollout.pid

    def wait_ready(self, timeout: float) -> float:
        """Wait until the rollout process is ready to generate (it only lacks the first
        version); returns the seconds waited. Raises its failure, or :class:`Timeout`."""
        t0 = time.perf_counter()
        ready = self._rollout.wait_ready(timeout)
        self.check()
        if not ready:
            raise Timeout(f"the rollout process was not ready within {timeout:g}s")
        return time.perf_counter() - t0

    def start(self) -> None:
        """The warm-up is over: the trainer takes its own cores."""
        pin(self.cores.trainer, self.cores.threads)

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Hand a new version to the rollout process (before ``hub.publish_version``)."""
        self._publisher.publish(weights, version)

    def check(self) -> None:
        """Raise the rollout process's failure, or its death, if it failed or died."""
        error = self._rollout.failure()
        if error is not None:
            raise error

    def finish(self, timeout: float = 60.0) -> dict[str, int]:
        """Wait for the rollout process's report after the last step: its stages' sample
        counts."""
        counts = self._rollout.wait(timeout)
        self.check()
        if counts is None:
            raise Timeout(f"the rollout process did not finish within {timeout:g}s")
        return counts

    def close(self) -> None:
        """Stop the rollout process (if running), then the weight channel and the hub."""
        self._rollout.close()
        self._publisher.close()
        self.hub.close()

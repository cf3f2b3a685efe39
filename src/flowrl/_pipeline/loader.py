"""Loader: iterate a hub task's micro-batches in a trainer, like a ``torch`` DataLoader.

Each ``next()`` claims ``batch_size`` samples whose columns are ready and returns their
:class:`~flowrl.Batch`; at the end of the stream iteration stops. A batch you received
counts as trained when you ask for the next one (``ack="next"``, the default), call
:meth:`Loader.ack`, or take a checkpoint with :meth:`Loader.state_dict`.

Exactly-once across a restart. The hub redelivers whatever was never acked (a released or
expired lease), so the question is only which batches a checkpoint covers:

* ``state_dict()`` covers every batch handed out so far. It lists their indices as
  ``pending`` and acks them only at the next ``next()``/``ack()``/``close()`` — after your
  checkpoint was written. A crash before that ack makes the hub redeliver them; a loader
  restored with ``load_state_dict`` recognises them and acks them without yielding them.
* batches trained after the last checkpoint are lost with the crash. With
  ``ack="checkpoint"`` they stay leased (un-acked) until the next ``state_dict()``, so the
  hub redelivers them after a crash: nothing skipped, nothing repeated. Leases must then
  outlive a checkpoint interval (``lease_timeout=``). With ``ack="next"`` they were acked
  on ``next()``: checkpoint every step for exactly-once.

``state_dict()["samples"]`` counts samples handed out up to the checkpoint; after a resume
it continues from there, so a run's total is checkable.

``prefetch=k`` claims and reads up to ``k`` micro-batches ahead in a thread, which also
sends the acks (``flowrl._pipeline.prefetch``): ``next()`` returns at once while the
stream keeps up, instead of waiting a claim, a read and an ack per micro-batch. What it
claimed and did not hand out goes back to the hub on ``close()`` (or expires with a dead
process), so the guarantees above are unchanged.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, final

import msgspec
import numpy as np

from flowrl._client.base import HubClient
from flowrl._client.batch import Batch
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import (
    BalancedSampler,
    FifoSampler,
    GroupSampler,
    Sampler,
    StalenessSampler,
)
from flowrl._pipeline.constants import POLL_S
from flowrl._pipeline.prefetch import Prefetcher, Stopped
from flowrl.errors import ConfigError, EndOfStream, LeaseError, StageError, Timeout
from flowrl.tracking import Tracker

__all__ = ["Loader", "LoaderStats"]

_STATE_KEYS = ("task", "dp_rank", "dp_size", "batches", "samples", "tokens", "pending")


@final
class LoaderStats(msgspec.Struct, frozen=True, kw_only=True):
    """Batches, samples and tokens handed out; ``unacked``: samples leased but not acked;
    ``wait_s``: seconds ``next()`` spent waiting for a claim (the trainer's idle time)."""

    batches: int
    samples: int
    tokens: int
    unacked: int
    wait_s: float = 0.0


@final
class Loader:
    """Micro-batches of ``task`` for data-parallel rank ``dp_rank`` of ``dp_size``.

    ``columns``: what the trainer reads (the task is registered with them: create the
    loader before samples are produced). ``balance``: claim one token-balanced global
    batch for all ranks at once (``BalancedSampler``); otherwise each rank claims on its
    own (disjoint, not balanced). ``groups``: GRPO group size — batches hold whole groups
    only (with ``balance``, whole groups per global batch). ``max_staleness``: skip samples
    more than this many versions old. ``timeout``: seconds one ``next()`` may wait
    (:class:`~flowrl.errors.Timeout`). ``ack``: ``"next"`` or ``"checkpoint"`` (module
    docstring). ``tracker``: a :class:`~flowrl.tracking.Tracker` (e.g. a ``Tracking``)
    that gets each batch's ``loader/samples``, ``loader/tokens``, ``loader/wait_s`` and
    the oldest and newest policy version in it (``loader/version_min``, ``_max``), at
    step = batches handed out.
    """

    def __init__(
        self,
        hub: HubClient,
        *,
        task: str,
        columns: Sequence[str],
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        balance: bool = False,
        groups: int | None = None,
        max_staleness: int | None = None,
        timeout: float | None = None,
        ack: Literal["next", "checkpoint"] = "next",
        lease_timeout: float | None = None,
        tracker: Tracker | None = None,
        prefetch: int = 0,
    ) -> None:
        _check_options(task, batch_size, dp_rank, dp_size, groups, timeout, ack, lease_timeout)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(
                f"Loader prefetch must be an int >= 0 (micro-batches claimed ahead), "
                f"got {prefetch!r}"
            )
        if tracker is not None and not isinstance(tracker, Tracker):
            raise ConfigError(
                f"Loader(tracker={tracker!r}): expected a flowrl.tracking.Tracker "
                "(e.g. Tracking('console,tensorboard', run_dir=...))"
            )
        self.tracker = tracker
        self.hub = hub
        self.task = task
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.timeout = timeout
        self.ack_mode = ack
        self.lease_timeout = lease_timeout
        self.sampler = _sampler(groups, max_staleness, dp_size if balance else None)
        self.columns = tuple(columns)
        hub.register_task(task, self.columns)
        self._current: BatchMeta | None = None  # handed out last, not acked
        self._held: list[BatchMeta] = []  # ack="checkpoint": trained, waiting for a checkpoint
        self._committing: list[BatchMeta] = []  # covered by a state_dict, acked next
        self._skip: set[int] = set()  # covered by a loaded checkpoint: ack on sight
        self._batches = self._samples = self._tokens = 0
        self._wait_s = 0.0
        self._error: BaseException | None = None
        self._ended = False
        # ack="checkpoint": our own held leases keep the task's stream open, so the end is
        # detected from closed columns (StreamEnded events) plus the task's counters.
        # Unique per loader: the hub ends the stream for a claimer even while it still holds
        # leases itself (ack="checkpoint"), but never ignores another loader's leases.
        self._consumer = f"{task}/rank{dp_rank}/{uuid.uuid4().hex[:8]}"
        self._prefetch = (
            Prefetcher(hub, self._claim_ahead, prefetch, self._ack) if prefetch else None
        )

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Batch:
        self._settle()
        if self._ended:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            meta, batch = self._next_batch()
        except StopIteration:
            self._ended = True
            if self._prefetch is not None:  # the last batch's ack, sent before the end shows
                self._prefetch.wait_acked()
            raise
        finally:
            waited = time.perf_counter() - t0
            self._wait_s += waited
        self._current = meta
        self._batches += 1
        self._samples += len(meta)
        self._tokens += int(meta.tokens.sum())
        if self.tracker is not None:
            self.tracker.log(_batch_metrics(meta, waited), self._batches)
        return batch

    def _next_batch(self) -> tuple[BatchMeta, Batch]:
        if self._prefetch is not None:
            return self._prefetch.take()
        meta = None
        while meta is None:
            meta = self._drop_skipped(self._claim()[0])
        try:
            return meta, self.hub.get(meta)
        except BaseException:
            self.hub.release(meta)
            raise

    def _claim_ahead(self, room: int) -> list[BatchMeta]:
        """The prefetch thread's claim of up to ``room`` batches (those a checkpoint
        covers are skipped)."""
        metas: list[BatchMeta] = []
        while not metas:
            claimed = self._claim(self._stopping, room)
            metas = [m for m in map(self._drop_skipped, claimed) if m is not None]
        return metas

    def _stopping(self) -> bool:
        return self._prefetch is not None and self._prefetch.stopping

    def _claim(self, stop: Callable[[], bool] | None = None, batches: int = 1) -> list[BatchMeta]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            if stop is not None and stop():
                raise Stopped
            if self._error is not None:
                raise StageError(
                    f"Loader for task {self.task!r}: the pipeline feeding it failed: {self._error}",
                    stage=getattr(self._error, "stage", ""),
                    indices=getattr(self._error, "indices", ()),
                ) from self._error
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self.hub.claim_batches(
                    self.task,
                    self.batch_size,
                    batches,
                    sampler=self.sampler,
                    timeout=POLL_S if left is None else min(POLL_S, max(left, 1e-3)),
                    # (a rank of a balanced global batch; unbalanced, ranks just claim)
                    dp_rank=self.dp_rank if isinstance(self.sampler, BalancedSampler) else 0,
                    lease_timeout=self.lease_timeout,
                    consumer=self._consumer,
                )
            except EndOfStream:
                raise StopIteration from None
            except Timeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise Timeout(
                        f"Loader for task {self.task!r} (rank {self.dp_rank}) waited "
                        f"{self.timeout}s for {self.batch_size} ready samples; are the "
                        "producers running, and is the stream ended when they are done?"
                    ) from None

    def _drop_skipped(self, meta: BatchMeta) -> BatchMeta | None:
        """Ack samples a restored checkpoint already covers; return the rest (or None)."""
        if not self._skip:
            return meta
        hit = np.isin(meta.indices, np.fromiter(self._skip, dtype=np.int64))
        if not hit.any():
            return meta
        self.hub.ack(meta, meta.indices[hit])
        self._skip.difference_update(meta.indices[hit].tolist())
        if hit.all():
            return None
        return meta.subset(np.flatnonzero(~hit))

    def _abort(self, error: BaseException) -> None:
        """Called by a failing ``PipelineRun``: make the next claim raise ``error``."""
        self._error = error

    # -- acking and checkpoints -------------------------------------------------------------
    def _settle(self) -> None:
        """The previous batch was trained: ack it (or hold it until the next checkpoint);
        with prefetch, the prefetch thread sends the acks."""
        ack = self._ack if self._prefetch is None else self._prefetch.ack
        if self._current is not None:
            if self.ack_mode == "next":
                ack(self._current)
            else:
                self._held.append(self._current)
            self._current = None
        for meta in self._committing:
            ack(meta)
        self._committing.clear()

    def _ack(self, meta: BatchMeta) -> None:
        try:
            self.hub.ack(meta)
        except LeaseError as exc:
            exc.add_note(
                f"Loader for task {self.task!r}: a batch stayed un-acked past its lease, so the "
                "hub delivered its samples again; raise lease_timeout= (with ack='checkpoint', "
                "above the time between checkpoints)"
            )
            raise

    def ack(self) -> None:
        """Mark every batch handed out so far as consumed, now."""
        for meta in [*self._committing, *self._held, *([self._current] if self._current else [])]:
            self._ack(meta)
        self._committing.clear()
        self._held.clear()
        self._current = None

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint covering every batch handed out so far (save it with your model)."""
        if self._prefetch is not None:  # acks of batches before it are out (not pending)
            self._prefetch.wait_acked()
        self._committing.extend(self._held)
        if self._current is not None:
            self._committing.append(self._current)
        self._held.clear()
        self._current = None
        pending = sorted(i for m in self._committing for i in m.indices.tolist())
        return {
            "task": self.task,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "batches": self._batches,
            "samples": self._samples,
            "tokens": self._tokens,
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output; call before iterating."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            raise ConfigError(
                f"load_state_dict expects what Loader.state_dict() returned (keys "
                f"{list(_STATE_KEYS)}), got {state!r:.200}"
            )
        mine = (self.task, self.dp_rank, self.dp_size)
        theirs = (state["task"], state["dp_rank"], state["dp_size"])
        if mine != theirs:
            raise ConfigError(
                f"this checkpoint is for task/dp_rank/dp_size {theirs}, this loader is {mine}; "
                "restore each rank's loader from its own state_dict"
            )
        if self._batches or self._current is not None:
            raise ConfigError("load_state_dict must be called before iterating the loader")
        self._batches = int(state["batches"])
        self._samples = int(state["samples"])
        self._tokens = int(state["tokens"])
        self._skip = {int(i) for i in state["pending"]}

    def statistics(self) -> LoaderStats:
        unacked = [*self._committing, *self._held, *([self._current] if self._current else [])]
        return LoaderStats(
            batches=self._batches,
            samples=self._samples,
            tokens=self._tokens,
            unacked=sum(len(m) for m in unacked),
            wait_s=self._wait_s,
        )

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Ack what was trained and checkpointed; give back what a checkpoint does not cover.

        With ``ack="next"`` the last batch handed out counts as trained and is acked; with
        ``ack="checkpoint"`` batches after the last ``state_dict()`` return to the hub.
        """
        if self._prefetch is not None:  # (its un-handed batches go back; its acks out)
            self._prefetch.close()
        if self.ack_mode == "next":
            self.ack()
        else:
            for meta in self._committing:
                self._ack(meta)
            self._committing.clear()
            self._release_all()

    def _release_all(self) -> None:
        if self._prefetch is not None:
            with contextlib.suppress(LeaseError):  # (an ack it failed: released below)
                self._prefetch.close()
        for meta in [*self._committing, *self._held, *([self._current] if self._current else [])]:
            with contextlib.suppress(LeaseError):  # expired: its samples are back already
                self.hub.release(meta)
        self._committing.clear()
        self._held.clear()
        self._current = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the step that raised did not train: give everything un-acked back
            self._release_all()


def _sampler(groups: int | None, max_staleness: int | None, dp_size: int | None) -> Sampler:
    sampler: Sampler = GroupSampler(groups) if groups is not None else FifoSampler()
    if max_staleness is not None:
        sampler = StalenessSampler(max_staleness, sampler)
    if dp_size is not None:
        sampler = BalancedSampler(dp_size, sampler)
    return sampler


def _check_options(
    task: object,
    batch_size: object,
    dp_rank: object,
    dp_size: object,
    groups: object,
    timeout: object,
    ack: object,
    lease_timeout: object,
) -> None:
    def positive_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if not isinstance(task, str) or not task:
        raise ConfigError(f"Loader task must be a non-empty str, got {task!r}")
    if not positive_int(batch_size):
        raise ConfigError(f"Loader batch_size must be a positive int, got {batch_size!r}")
    if not positive_int(dp_size):
        raise ConfigError(f"Loader dp_size must be a positive int, got {dp_size!r}")
    if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < dp_size:  # type: ignore[operator]
        raise ConfigError(
            f"Loader dp_rank must be an int in [0, dp_size={dp_size}), got {dp_rank!r}"
        )
    if groups is not None and (not positive_int(groups) or batch_size % groups):  # type: ignore[operator]
        raise ConfigError(
            f"Loader groups (the GRPO group size) must be a positive int dividing "
            f"batch_size={batch_size}, got {groups!r}; batches hold whole groups only"
        )
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise ConfigError(f"Loader timeout must be >= 0 seconds or None, got {timeout!r}")
    if ack not in ("next", "checkpoint"):
        raise ConfigError(f"Loader ack must be 'next' or 'checkpoint', got {ack!r}")
    if lease_timeout is not None and (
        not isinstance(lease_timeout, int | float) or not lease_timeout > 0
    ):
        raise ConfigError(f"Loader lease_timeout must be > 0 seconds, got {lease_timeout!r}")


def _batch_metrics(meta: BatchMeta, waited: float) -> dict[str, float]:
    metrics = {
        "loader/samples": len(meta),
        "loader/tokens": int(meta.tokens.sum()),
        "loader/wait_s": waited,
    }
    if len(meta):
        metrics["loader/version_min"] = int(meta.versions.min())
        metrics["loader/version_max"] = int(meta.versions.max())
    return metrics

"""One stage worker's loop, the same under every executor.

A consuming worker claims a micro-batch for its stage (its hub task), reads it, calls the
stage, puts the outputs on the same samples and acks. When its claim raises
``EndOfStream`` the stage is done (every sample it could ever see was acked), so the
worker ends the stream of the stage's outputs: downstream stages can then finish too.

A source worker asks the admission controller (bounded staleness) and the sample quota
before each call, puts what the stage returns as new samples, and gives back what it did
not use.

Blocking hub calls wait in slices of ``POLL_S`` seconds so that a stop request (another
worker failed, a timeout, ``PipelineRun.stop``) is seen promptly. Anything raised while a
batch is leased releases the lease first (the samples return to the hub, nothing is
lost), then surfaces as :class:`~flowrl.errors.StageError` chained to the cause.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
import numpy as np

from flowrl._client.base import HubClient
from flowrl._client.future import PutFuture
from flowrl._client.inproc import Hub
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import BalancedSampler
from flowrl._pipeline.constants import POLL_S
from flowrl._pipeline.prefetch import Prefetcher, Stopped
from flowrl._pipeline.stage import Rows, StageContext, StageSpec
from flowrl.errors import (
    EndOfStream,
    LeaseError,
    SchemaError,
    StageError,
    Timeout,
    UnknownIndexError,
)

__all__ = ["Quota", "Stop", "WorkerReport", "run_worker"]

log = logging.getLogger("flowrl.pipeline")


class Stop(Protocol):
    def is_set(self) -> bool: ...


class Quota(Protocol):
    """Samples the sources may still create (``max_samples``)."""

    def take(self, n: int) -> bool: ...

    def refund(self, n: int) -> None: ...


class Admission(Protocol):
    def admit(self, n: int, *, timeout: float | None = None) -> None: ...

    def refund(self, n: int) -> None: ...


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """What one worker did; ``ended``: it stopped because its stream ended (not stopped)."""

    stage: str
    worker: int
    batches: int
    samples: int
    busy_s: float
    ended: bool
    expired: int = 0  # batches whose lease expired while the stage ran: result dropped


class _Counters:
    __slots__ = ("batches", "busy_s", "expired", "samples")

    def __init__(self) -> None:
        self.batches = self.samples = self.expired = 0
        self.busy_s = 0.0


def run_worker(
    spec: StageSpec,
    worker: int,
    hub: HubClient,
    stop: Stop,
    *,
    admission: Admission | None = None,
    quota: Quota | None = None,
) -> WorkerReport:
    """Run worker ``worker`` of ``spec`` until its stream ends or ``stop`` is set."""
    counters = _Counters()
    fn = _instantiate(spec, worker, hub)
    if spec.is_source:
        ended = _produce(spec, fn, hub, stop, admission, quota, counters)
    else:
        ended = _consume(spec, worker, fn, hub, stop, counters)
    return WorkerReport(
        stage=spec.name,
        worker=worker,
        batches=counters.batches,
        samples=counters.samples,
        busy_s=counters.busy_s,
        ended=ended,
        expired=counters.expired,
    )


def _instantiate(spec: StageSpec, worker: int, hub: HubClient) -> Callable[..., Any]:
    if not spec.is_class:
        fn: Callable[..., Any] = spec.fn
    else:
        try:
            fn = spec.fn()
            setup = getattr(fn, "setup", None)
            if setup is not None:
                ctx = StageContext(stage=spec.name, worker=worker, workers=spec.workers, hub=hub)
                setup(ctx) if spec.setup_takes_context else setup()
        except Exception as exc:
            raise _stage_error(spec, exc, (), "in setup") from exc
    if spec.is_generator:
        gen = fn()
        return lambda: next(gen)
    return fn


# -- consuming stages ------------------------------------------------------------------------
def _consume(
    spec: StageSpec,
    worker: int,
    fn: Callable[[Any], Any],
    hub: HubClient,
    stop: Stop,
    counters: _Counters,
) -> bool:
    balanced = isinstance(spec.sampler, BalancedSampler)
    # One consumer id per worker incarnation: a worker started in place of a dead one must
    # not pass for the holder of its predecessor's leases (end of stream does not wait for
    # the claimer's own leases, and those will only expire).
    consumer = f"{spec.name}/{worker}/{uuid.uuid4().hex[:8]}"

    def claim(stopping: Callable[[], bool] = stop.is_set, batches: int = 1) -> list[BatchMeta]:
        """The next batch (up to ``batches``); StopIteration at the end of the stream."""
        while True:
            if stopping():
                raise Stopped
            try:
                return hub.claim_batches(
                    spec.name,
                    spec.batch_size,
                    batches,
                    sampler=spec.sampler,
                    min_n=spec.min_batch,
                    timeout=POLL_S,
                    dp_rank=worker if balanced else 0,
                    lease_timeout=spec.lease_timeout,
                    consumer=consumer,
                )
            except Timeout:
                continue
            except EndOfStream:
                raise StopIteration from None
            except Exception as exc:
                raise _stage_error(spec, exc, (), "while claiming") from exc

    rounds = _Rounds(spec, hub, counters, claim, pipelined=not isinstance(hub, Hub))
    try:
        while not stop.is_set():
            try:
                meta, batch = rounds.next()
            except StopIteration:
                rounds.finish()
                if spec.outputs:
                    hub.end_stream(spec.outputs)
                return True
            except Stopped:
                break
            try:
                _process(spec, fn, hub, stop, meta, batch, counters, rounds)
            except Exception as exc:
                _release(hub, meta)
                raise _stage_error(spec, exc, tuple(meta.indices.tolist()), "on samples") from exc
    finally:
        rounds.close()
    return False


class _Rounds:
    """A consuming worker's rounds. Pipelined (over processes): a thread claims and reads
    the next batches while the stage computes this one (``Prefetcher``, the stage's
    ``prefetch`` ahead, claimed in one request), and a round's output goes out with
    ``put_async`` (written and acked in one step, as ``put``), answered while the next
    rounds compute; at most ``prefetch`` outputs are in flight, answered in order. A
    worker that dies loses nothing: the claims read ahead and the outputs not committed
    leave leases that expire.
    """

    def __init__(
        self,
        spec: StageSpec,
        hub: HubClient,
        counters: _Counters,
        claim: Callable[..., list[BatchMeta]],
        *,
        pipelined: bool,
    ) -> None:
        self._spec, self._hub, self._counters, self._claim = spec, hub, counters, claim
        depth = spec.prefetch if pipelined else 1
        self._ahead = Prefetcher(hub, self._claim_ahead, depth, hub.ack) if pipelined else None
        self._in_flight = depth
        self._sent: collections.deque[tuple[PutFuture, BatchMeta]] = collections.deque()

    def _claim_ahead(self, room: int) -> list[BatchMeta]:
        return self._claim(self._stopping, room)

    def _stopping(self) -> bool:
        return self._ahead is not None and self._ahead.stopping

    def next(self) -> tuple[BatchMeta, Any]:
        """The next batch and its data; StopIteration at the end of the stream."""
        if self._ahead is not None:
            try:
                return self._ahead.take()
            except (StopIteration, Stopped, StageError):
                raise
            except Exception as exc:  # its read failed (the batch went back)
                raise _stage_error(self._spec, exc, (), "reading a batch") from exc
        meta = self._claim()[0]
        try:
            return meta, self._hub.get(meta)
        except Exception as exc:
            _release(self._hub, meta)
            indices = tuple(meta.indices.tolist())
            raise _stage_error(self._spec, exc, indices, "on samples") from exc

    def put(self, meta: BatchMeta, rows: Rows, kept: BatchMeta) -> None:
        """Write a round's outputs to ``kept`` and ack ``meta`` with them."""
        while len(self._sent) >= self._in_flight:
            self._settle_oldest()
        sent = self._hub.put_async(
            rows.data,
            indices=kept,
            groups=rows.groups,
            version=rows.version,
            tokens=rows.tokens,
            producer=self._spec.name,
            ack=meta,
        )
        self._sent.append((sent, meta))
        if self._ahead is None:  # one round at a time: its answer now
            self.settle()

    def settle(self) -> None:
        """Wait for the outputs in flight."""
        while self._sent:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        """Wait for the oldest output in flight; count it, or count it expired (dropped)."""
        sent, meta = self._sent.popleft()
        try:
            sent.result()
        except (LeaseError, UnknownIndexError):
            _expired(self._spec, self._counters)
            return
        self._counted(meta)

    def _counted(self, meta: BatchMeta) -> None:
        self._counters.batches += 1
        self._counters.samples += len(meta)

    def finish(self) -> None:
        """The stream ended: the last output must land before the outputs' stream ends."""
        self.settle()

    def close(self) -> None:
        """Give back the batch read ahead; let the output in flight land."""
        if self._ahead is not None:
            self._ahead.close()
        with contextlib.suppress(Exception):  # (a failure already surfaces)
            self.settle()


def _process(
    spec: StageSpec,
    fn: Callable[[Any], Any],
    hub: HubClient,
    stop: Stop,
    meta: BatchMeta,
    batch: Any,
    counters: _Counters,
    rounds: _Rounds,
) -> None:
    t0 = time.perf_counter()
    out = fn(batch)
    counters.busy_s += time.perf_counter() - t0
    if stop.is_set():  # the run is failing or stopping: give the samples back
        _release(hub, meta)
        return
    rows = _as_rows(spec, out)
    keep = None if rows.keep is None else _keep_mask(spec, rows.keep, len(meta))
    kept = meta  # (a handle: the put goes straight to its samples' units)
    if keep is not None and not keep.all():
        hub.drop(meta, meta.indices[~keep])  # discarded for every later stage: evicted
        kept = meta.subset(np.flatnonzero(keep))
    try:
        if spec.outputs and len(kept):
            # Written and acked in one step: a worker that dies never leaves its outputs
            # written but its claim unacked (the samples would be processed again).
            rounds.put(meta, rows, kept)
            return
        if len(kept):
            hub.ack(meta, None if keep is None else kept.indices)
    except (LeaseError, UnknownIndexError):
        _expired(spec, counters)
        return
    counters.batches += 1
    counters.samples += len(meta)


def _expired(spec: StageSpec, counters: _Counters) -> None:
    """The lease ran out while the stage computed: the samples went back to the hub and
    another worker has them (and may have finished them: a storage unit that reused their
    slots refuses the write as stale). Nothing of this batch was written; the result is
    dropped. (Samples under a live lease are never evicted.)"""
    log.warning(
        "stage %r: a batch's lease expired while it ran; its samples were handed out "
        "again and this result is dropped (raise the stage's lease_timeout)",
        spec.name,
    )
    counters.expired += 1


def _keep_mask(spec: StageSpec, keep: Any, n: int) -> np.ndarray:
    mask = np.asarray(keep.detach().cpu().numpy() if hasattr(keep, "detach") else keep)
    if mask.dtype != np.bool_ or mask.shape != (n,):
        raise SchemaError(
            f"{spec.where} returned Rows(keep=...) of {mask.dtype} with shape {mask.shape}; "
            f"keep must be a bool mask of shape ({n},), one entry per sample of the batch"
        )
    return mask


def _release(hub: HubClient, meta: BatchMeta) -> None:
    with contextlib.suppress(LeaseError):  # expired: the samples are back in the hub already
        hub.release(meta)


# -- source stages ---------------------------------------------------------------------------
def _produce(
    spec: StageSpec,
    fn: Callable[[], Any],
    hub: HubClient,
    stop: Stop,
    admission: Admission | None,
    quota: Quota | None,
    counters: _Counters,
) -> bool:
    size = spec.batch_size
    while not stop.is_set():
        if quota is not None and not quota.take(size):
            return True
        if admission is not None and not _admit(admission, size, stop):
            _refund(quota, None, size)
            return False
        try:
            made = _produce_one(spec, fn, hub, stop, counters)
        except Exception as exc:
            _refund(quota, admission, size)
            raise _stage_error(spec, exc, (), "while producing") from exc
        _refund(quota, admission, size - max(made, 0))
        if made < 0:
            return not stop.is_set()
    return False


def _produce_one(
    spec: StageSpec, fn: Callable[[], Any], hub: HubClient, stop: Stop, counters: _Counters
) -> int:
    """Call the source once and put what it made; returns the sample count, -1 when done."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except StopIteration:
        return -1
    finally:
        counters.busy_s += time.perf_counter() - t0
    if out is None:
        return -1
    rows = _as_rows(spec, out)
    while True:
        try:
            indices = hub.put(
                rows.data,
                groups=rows.groups,
                partition=rows.partition,
                version=rows.version,
                tokens=rows.tokens,
                producer=spec.name,
                timeout=POLL_S,
            )
            break
        except Timeout:  # the hub is full: wait for consumers, unless stopping
            if stop.is_set():
                return -1
        except EndOfStream:  # someone ended the stream: nothing more may be created
            return -1
    if indices.size > spec.batch_size:
        raise SchemaError(
            f"{spec.where} returned {indices.size} samples in one call, more than its "
            f"batch_size={spec.batch_size}; raise batch_size or return fewer per call"
        )
    counters.batches += 1
    counters.samples += int(indices.size)
    return int(indices.size)


def _admit(admission: Admission, n: int, stop: Stop) -> bool:
    while not stop.is_set():
        try:
            admission.admit(n, timeout=POLL_S)
            return True
        except Timeout:
            continue
    return False


def _refund(quota: Quota | None, admission: Admission | None, n: int) -> None:
    if n <= 0:
        return
    if quota is not None:
        quota.refund(n)
    if admission is not None:
        admission.refund(n)


# -- results and errors ----------------------------------------------------------------------
def _as_rows(spec: StageSpec, out: Any) -> Rows:
    """Check what a stage returned against its outputs (a sink returns None)."""
    if out is None and not spec.outputs:
        return Rows({})
    if out is None:
        raise SchemaError(
            f"{spec.where} returned None but declares outputs {list(spec.outputs)}; "
            "return a dict with those columns"
        )
    if isinstance(out, Rows):
        rows = out
    elif isinstance(out, Mapping):
        rows = Rows(out)
    else:
        raise SchemaError(
            f"{spec.where} returned {type(out).__name__}; return a dict of its output "
            f"columns {list(spec.outputs)} (or flowrl.Rows)"
        )
    got = set(rows.data)
    if got != set(spec.outputs):
        missing = sorted(set(spec.outputs) - got)
        extra = sorted(got - set(spec.outputs))
        raise SchemaError(
            f"{spec.where} returned columns {sorted(got)} but declares outputs "
            f"{list(spec.outputs)} (missing {missing}, undeclared {extra}); return exactly "
            "its outputs or change outputs=[...]"
        )
    if spec.is_source and rows.keep is not None:
        raise SchemaError(f"{spec.where}: Rows(keep=...) applies to consuming stages only")
    if not spec.is_source and rows.partition:
        raise SchemaError(
            f"{spec.where}: Rows(partition=...) applies to new samples, i.e. source stages"
        )
    return rows


def _stage_error(
    spec: StageSpec, exc: BaseException, indices: tuple[int, ...], when: str
) -> StageError:
    shown = ""
    if indices:
        head = ", ".join(map(str, indices[:8]))
        shown = f" [{head}{', ...' if len(indices) > 8 else ''}]"
    return StageError(
        f"{spec.where} raised {type(exc).__name__} {when}{shown}: {exc}",
        stage=spec.name,
        indices=indices,
    )

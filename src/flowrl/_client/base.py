"""The client API, identical for every placement, over a control port and a data port.

A put validates and encodes every column first (so bad input changes nothing), reserves
indices, writes the bytes to the storage unit, then commits metadata to the controller:
the commit is the moment samples become visible, so a writer that fails or dies before it
leaves no half-written sample behind.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, final

import msgspec
import numpy as np
import pyarrow as pa

from flowrl._client.batch import Batch, LazyColumn, _to_python, arrow_of
from flowrl._client.batcher import PutBatcher
from flowrl._client.future import PutFuture
from flowrl._client.ports import ControlPort, DataPort, Reservation
from flowrl._config import HubStats
from flowrl._controller.eventlog import Subscription
from flowrl._controller.meta import BatchMeta
from flowrl._controller.samplers import FifoSampler, Sampler
from flowrl._protocol.commands import (
    Ack,
    Cell,
    CheckUpdate,
    Claim,
    Commit,
    EndStream,
    LeaseRef,
    MetaOf,
    PublishVersion,
    RegisterTask,
    Release,
    UnregisterTask,
)
from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded, numeric_array
from flowrl._schema.ragged import RaggedArray
from flowrl._schema.schema import Schema
from flowrl._schema.small import all_equal, bounds, one_if_equal
from flowrl._store.partial import VERSIONS
from flowrl._validate import check_seconds, int_in
from flowrl.errors import (
    ConfigError,
    DuplicatePut,
    LeaseError,
    SchemaError,
    TransportError,
    UnknownIndexError,
)
from flowrl.events import EVENT_TYPES, Event
from flowrl.hooks import Observer

__all__ = ["HubClient", "Partial"]

_FIFO = FifoSampler()
#: The indices of a new put's commit until they are reserved.
_UNRESERVED = np.empty(0, dtype=np.int64)


@final
class Partial(NamedTuple):
    """Prefixes of in-progress values (``hub.partial``): tokens and each token's version."""

    values: RaggedArray
    versions: RaggedArray


class HubClient:
    """Put samples, claim micro-batches, read them, ack them. See docs/concepts.md.

    One concrete client for every placement: commands go through a
    :class:`~flowrl._client.ports.ControlPort`, bytes through a
    :class:`~flowrl._client.ports.DataPort` (in-process or zmq). ``Hub`` and ``RemoteHub``
    build the ports and tear them down.
    """

    schema: Schema
    _control: ControlPort
    _data: DataPort
    _closed = False

    # -- columns and tasks ------------------------------------------------------------------
    @property
    def columns(self) -> tuple[Column, ...]:
        return self.schema.columns()

    def declare(self, *columns: Column) -> None:
        """Declare columns (idempotent; redeclaring with another type raises)."""
        for col in columns:
            if not isinstance(col, Column):
                raise ConfigError(f"declare() expects flowrl.Column, got {type(col).__name__}")
        self._control.declare(columns)

    def register_task(
        self, task: str, columns: Sequence[str], *, partition: str | None = None
    ) -> None:
        """Register a consuming task and the columns a sample needs before it can claim it.

        Register every task before producing: a sample is evicted once all tasks registered
        at that time have acked it. ``partition``: the task reads only the samples put with
        that ``partition`` (the others neither reach it nor wait for its ack).
        """
        if not isinstance(task, str) or not task:
            raise ConfigError(f"register_task() task must be a non-empty str, got {task!r}")
        if isinstance(columns, str) or not isinstance(columns, Sequence):
            raise ConfigError(f"register_task columns must be a list of names, got {columns!r}")
        if partition is not None and not isinstance(partition, str):
            raise ConfigError(
                f"register_task({task!r}) partition must be a str or None, got {partition!r}"
            )
        cols = self.schema.check_names(columns, f"register_task({task!r})")
        self._control.register_task(RegisterTask(task=task, columns=cols, partition=partition))

    def unregister_task(self, task: str) -> None:
        """Forget a task: it is no longer fed, and samples only it had not acked yet are
        evicted. Raises :class:`~flowrl.errors.UnknownTaskError` for a task not registered
        and :class:`~flowrl.errors.LeaseError` while it holds leases (ack or release them
        first), changing nothing."""
        if not isinstance(task, str) or not task:
            raise ConfigError(f"unregister_task() task must be a non-empty str, got {task!r}")
        self._control.unregister_task(UnregisterTask(task=task))

    # -- producers --------------------------------------------------------------------------
    def put(
        self,
        data: Mapping[str, Any],
        *,
        indices: BatchMeta | np.ndarray | Sequence[int] | None = None,
        partition: str = "",
        groups: Any = None,
        version: Any = None,
        tokens: Any = None,
        producer: str = "",
        seq: int | None = None,
        timeout: float | None = None,
        ack: BatchMeta | None = None,
    ) -> np.ndarray:
        """Write columns; returns the sample indices.

        Without ``indices`` it creates new samples (blocking while the hub is full, up to
        ``timeout`` seconds). With ``indices`` (an array or the ``BatchMeta`` of a claim)
        it adds or overwrites columns of existing samples.

        ``version``: the policy version that produced the data, one int or one per sample
        (a batch mixing resumed and fresh rollouts); new samples default to the hub's
        current version, and an update without it keeps the samples' versions.

        ``ack``: the claim these samples came from; they are acked in the same step as the
        columns become visible, so a worker that dies never leaves them written but not
        consumed (they would be delivered, and processed, again). One round trip fewer.

        ``producer`` names who puts (events carry it). With ``seq`` as well, the put is
        idempotent: ``seq`` numbers it among that producer's puts (0, 1, 2, ... in the
        order they are made), and a put re-sent with a ``(producer, seq)`` the hub already
        holds lands once: it returns the first put's indices and changes nothing. A
        producer that restarts under the same name can re-send every put it never saw
        answered (docs/durability.md, "Idempotent producers").
        """
        return self._put(
            data, indices, partition, groups, version, tokens, producer, seq, timeout, ack, True
        ).result()

    def put_async(
        self,
        data: Mapping[str, Any],
        *,
        indices: BatchMeta | np.ndarray | Sequence[int] | None = None,
        partition: str = "",
        groups: Any = None,
        version: Any = None,
        tokens: Any = None,
        producer: str = "",
        seq: int | None = None,
        timeout: float | None = None,
        ack: BatchMeta | None = None,
    ) -> PutFuture:
        """Like :meth:`put`, but returns once the request is sent, with a
        :class:`PutFuture`; a producer of single samples keeps the hub busy instead of
        waiting a round trip per put.

        The data is validated before the call returns (bad input raises here and changes
        nothing). A put that the hub refuses later raises from its future's ``result()``,
        from :meth:`flush`, or else from this thread's next ``put_async``: a failure is never
        silently dropped. At most ``max_puts_in_flight`` puts of a thread are unanswered; the
        next waits for the oldest. In-process, and for puts that declare columns or span
        several storage units, the put completes before the call returns.
        """
        self._data.raise_failed_put()
        return self._put(
            data, indices, partition, groups, version, tokens, producer, seq, timeout, ack, False
        )

    def put_batcher(
        self, max_puts: int = 8, max_bytes: int = 16 << 20, timeout: float | None = None
    ) -> PutBatcher:
        """A :class:`~flowrl.PutBatcher` for this thread: its puts of new samples are
        validated at once and sent together, ``max_puts`` puts (or ``max_bytes``) to a
        ``put_async``, so each crosses the hub's fixed cost of a put once, not ``max_puts``
        times. Held puts are sent when it is full, on ``flush()`` and on ``close()`` (use it
        in a ``with`` block). ``timeout``: how long a send waits for room in a full hub."""
        batcher = PutBatcher(self, max_puts, max_bytes, timeout)
        batchers = self.__dict__.setdefault("_batchers", weakref.WeakSet())
        batchers.add(batcher)  # (close() sends what they hold)
        return batcher

    def _send_held_puts(self) -> None:
        """Send what the batchers of this client hold (it is closing)."""
        for batcher in list(self.__dict__.get("_batchers", ())):
            batcher._abandon("whose hub closed")

    def _put_async_encoded(
        self,
        encoded: dict[str, Encoded],
        n: int,
        partition: str,
        groups: np.ndarray | None,
        versions: int | np.ndarray | None,
        tokens: np.ndarray | None,
        producer: str,
        timeout: float | None,
    ) -> PutFuture:
        """``put_async`` of new samples already validated and encoded (a batcher's)."""
        self._data.raise_failed_put()
        self._control.raise_policy_error()
        return self._put_encoded(
            encoded,
            (),
            n,
            partition=partition,
            groups=groups,
            versions=versions,
            tokens=tokens,
            producer=producer,
            timeout=timeout,
            wait=False,
        )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every :meth:`put_async` of this thread is answered; raises the first
        failure that no future reported (:class:`~flowrl.errors.Timeout` after ``timeout``
        seconds, the puts still pending)."""
        timeout = check_seconds(timeout, "flush() timeout", allow_zero=True)
        self._data.flush(timeout)

    def put_nowait(self, data: Mapping[str, Any], **kwargs: Any) -> np.ndarray:
        """Like :meth:`put`, but raises :class:`~flowrl.errors.HubFull` instead of waiting."""
        kwargs["timeout"] = 0.0
        return self.put(data, **kwargs)

    def _put(
        self,
        data: Mapping[str, Any],
        indices: Any,
        partition: str,
        groups: Any,
        version: Any,
        tokens: Any,
        producer: str,
        seq: Any,
        timeout: float | None,
        ack: BatchMeta | None,
        wait: bool,
    ) -> PutFuture:
        self._control.raise_policy_error()
        where = f"put() from {producer!r}" if producer else "put()"
        if not isinstance(partition, str):
            raise ConfigError(f"partition must be a str, got {partition!r} in {where}")
        if not isinstance(producer, str):
            raise ConfigError(f"producer must be a str, got {producer!r} in put()")
        if seq is not None:
            seq = _sequence_number(seq, producer, where)
        if timeout is not None:
            timeout = check_seconds(timeout, "put() timeout", allow_zero=True)
        if isinstance(indices, BatchMeta):
            self._check_handle(indices, where)
        target = _as_indices(indices, where) if indices is not None else None
        acked = None if ack is None else _ackable(ack, target, where)
        n_expected = None if target is None else int(target.size)
        owned = not self._data.copies_puts  # (a port that copies copies a put_async's too)
        encoded, new_columns, n, groups_arr, tokens_arr, versions = self._encode_put(
            data, n_expected, groups, version, tokens, where, owned
        )
        return self._put_encoded(
            encoded,
            new_columns,
            n,
            indices=indices,
            target=target,
            partition=partition,
            groups=groups_arr,
            versions=versions,
            tokens=tokens_arr,
            producer=producer,
            seq=seq,
            timeout=timeout,
            acked=acked,
            wait=wait,
        )

    def _encode_put(
        self,
        data: Mapping[str, Any],
        n_expected: int | None,
        groups: Any,
        version: Any,
        tokens: Any,
        where: str,
        owned: bool,
    ) -> tuple[
        dict[str, Encoded],
        list[Column],
        int,
        np.ndarray | None,
        np.ndarray | None,
        int | np.ndarray | None,
    ]:
        """A put's columns encoded (``Schema.encode_all``), the columns it would declare,
        its sample count, and its groups, tokens and versions per sample (or None)."""
        encoded, new_columns, n = self.schema.encode_all(data, n_expected, where, owned)
        groups_arr = None if groups is None else _per_sample(groups, n, "groups", where)
        tokens_arr = None if tokens is None else _per_sample(tokens, n, "tokens", where)
        versions = None if version is None else _versions(version, n, where)
        return encoded, new_columns, n, groups_arr, tokens_arr, versions

    def _put_encoded(
        self,
        encoded: dict[str, Encoded],
        new_columns: Sequence[Column],
        n: int,
        *,
        indices: Any = None,
        target: np.ndarray | None = None,
        partition: str,
        groups: np.ndarray | None,
        versions: int | np.ndarray | None,
        tokens: np.ndarray | None,
        producer: str,
        seq: int | None = None,
        timeout: float | None,
        acked: LeaseRef | None = None,
        wait: bool,
    ) -> PutFuture:
        """A validated put (its columns encoded, its options checked): stored and
        committed (``PutBatcher`` sends the puts it gathered here)."""
        # A put to existing samples stages its bytes on their units under ``put_id``:
        # visible only once the commit succeeds (new samples are invisible until then).
        commit = Commit(
            indices=_UNRESERVED if target is None else target,
            cells={k: Cell(e.nbytes, e.lengths) for k, e in encoded.items()},
            new=target is None,
            partition=partition,
            groups=groups,
            version=versions if isinstance(versions, int) else None,
            versions=versions if isinstance(versions, np.ndarray) else None,
            tokens=tokens,
            producer=producer,
            ack=acked,
            put_id=0 if target is None else _new_put_id(),
            seq=seq,
        )
        try:
            return self._send_put(indices, target, encoded, new_columns, n, commit, timeout, wait)
        except DuplicatePut as dup:  # a re-sent idempotent put: answered as the first was
            return PutFuture.completed(np.array(dup.indices, dtype=np.int64))

    def _send_put(
        self,
        indices: Any,
        target: np.ndarray | None,
        encoded: dict[str, Encoded],
        new_columns: Sequence[Column],
        n: int,
        commit: Commit,
        timeout: float | None,
        wait: bool,
    ) -> PutFuture:
        """Store a validated put's bytes and commit it (``commit``: its commit, less the
        indices of a new put, reserved here)."""
        types: Mapping[str, Column] = self.schema.by_name
        if new_columns:  # (not declared until the put succeeds)
            types = {**types, **{c.name: c for c in new_columns}}
        if target is None:
            return self._put_new(n, encoded, types, new_columns, commit, timeout, wait)
        # (a re-sent idempotent put's claim was acked by its first landing: the commit
        # checks the lease after the duplicate, so that put's answer comes back)
        acked = commit.ack if commit.seq is None else None
        units = self._units_for_update(indices, target, tuple(encoded), acked)
        parts = _split_by_unit(units)
        try:
            if len(parts) == 1:
                fut = self._store(parts[0][0], target, encoded, types, new_columns, commit, wait)
                return fut or PutFuture.completed(target)
            for unit, pos in parts:
                part = {k: e if pos is None else e.take(pos) for k, e in encoded.items()}
                self._data.write(unit, _part(target, pos), part, types, commit.put_id)
            if new_columns:
                self._control.declare(tuple(new_columns))
            self._control.commit(commit)
        except BaseException:
            self._data.forget_staged(commit.put_id, [unit for unit, _ in parts])
            raise
        return PutFuture.completed(target)

    def _units_for_update(
        self,
        indices: Any,
        target: np.ndarray,
        columns: tuple[str, ...],
        ack: LeaseRef | None,
    ) -> np.ndarray:
        """The storage units of the samples a put to existing samples writes, once the
        controller checked the put (``indices`` as the caller gave them; ``ack``: the
        claim it acks, whose lease is checked first)."""
        if self._control.trusts_handles and isinstance(indices, BatchMeta):
            # A handle (a claim's, above all: a stage's output) names its samples' units:
            # a write to one unit goes there at once, the unit refuses samples it does not
            # hold (evicted) and stages the bytes, and the commit checks what check_update
            # would have (a put refused there changes nothing: the unit forgets the bytes).
            units = indices.units
            if units.size and all_equal(units):
                return units
        return self._control.check_update(CheckUpdate(indices=target, columns=columns, ack=ack))

    def _put_new(
        self,
        n: int,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        new_columns: Sequence[Column],
        commit: Commit,
        timeout: float | None,
        wait: bool,
    ) -> PutFuture:
        """Reserve ``n`` indices, store the bytes there and commit them (``commit``: the
        put's, less its indices)."""
        put = (encoded, types, new_columns, commit, timeout, wait)
        reservation = self._control.reserve(n, timeout, streaming=not wait)
        try:
            return self._put_reserved(reservation, *put)
        except UnknownIndexError:
            # Pooled indices the controller no longer holds for us (it restarted from its
            # journal, or the stream ended): nothing was committed; reserve afresh, once.
            if not reservation.pooled:
                raise
            self._control.forget_pool()
            return self._put_reserved(self._control.reserve(n, timeout, not wait), *put)

    def _put_reserved(
        self,
        reservation: Reservation,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        new_columns: Sequence[Column],
        commit: Commit,
        timeout: float | None,
        wait: bool,
    ) -> PutFuture:
        idx, unit = reservation.indices, reservation.unit
        again = None
        if reservation.pooled and not wait:
            # Pooled indices may be gone when the put arrives (the stream ended, or the
            # controller restarted): then it is made again, as put() does.
            def again(data: dict[str, Encoded]) -> np.ndarray:
                try:
                    return self._put_new(idx.size, data, types, (), commit, timeout, True).indices
                except DuplicatePut as dup:  # the first try landed after all
                    return np.array(dup.indices, dtype=np.int64)

        try:
            commit = msgspec.structs.replace(commit, indices=idx)
            fut = self._store(unit, idx, encoded, types, new_columns, commit, wait, again)
        except TransportError:
            # No answer: the put may have been committed (a controller that died after
            # journaling it). Its bytes stay; a reservation never committed expires.
            raise
        except BaseException:
            self._data.discard(unit, idx, tuple(encoded))
            self._control.abort(idx)
            raise
        return fut or PutFuture.completed(idx)

    def _store(
        self,
        unit: int,
        indices: np.ndarray,
        encoded: dict[str, Encoded],
        types: Mapping[str, Column],
        new_columns: Sequence[Column],
        commit: Commit,
        wait: bool,
        again: Callable[[dict[str, Encoded]], np.ndarray] | None = None,
    ) -> PutFuture | None:
        """Store the bytes on one unit, then commit them (None: done; or the future of a
        put that is not waited for). Inferred columns are declared in between: only once the
        bytes are stored, so a failed put leaves the schema as it was."""
        if new_columns:
            self._data.write(unit, indices, encoded, types, commit.put_id)
            self._control.declare(tuple(new_columns))
            self._control.commit(commit)
            return None
        return self._data.write_commit(unit, indices, encoded, types, commit, wait, again)

    # -- consumers --------------------------------------------------------------------------
    def claim(
        self,
        task: str,
        n: int,
        *,
        sampler: Sampler | None = None,
        columns: Sequence[str] | None = None,
        min_n: int | None = None,
        timeout: float | None = None,
        dp_rank: int = 0,
        lease_timeout: float | None = None,
        consumer: str = "",
    ) -> BatchMeta:
        """Lease ``n`` samples whose columns are ready for ``task`` (wait up to ``timeout``).

        Returns fewer than ``n`` only when ``min_n`` allows it or at end of stream; raises
        :class:`~flowrl.errors.Timeout` when time runs out and
        :class:`~flowrl.errors.EndOfStream` once nothing more will become ready.
        """
        args = (sampler, columns, min_n, timeout, dp_rank, lease_timeout, consumer)
        return self._claim("claim()", task, n, 1, *args)[0]

    def claim_batches(
        self,
        task: str,
        n: int,
        batches: int,
        *,
        sampler: Sampler | None = None,
        columns: Sequence[str] | None = None,
        min_n: int | None = None,
        timeout: float | None = None,
        dp_rank: int = 0,
        lease_timeout: float | None = None,
        consumer: str = "",
    ) -> list[BatchMeta]:
        """Up to ``batches`` micro-batches of ``n`` for ``task`` in one round trip, each
        its own lease (ack or release each): the first as :meth:`claim` takes it
        (waiting up to ``timeout``), then as many more as are ready at once, as that many
        claims in a row with ``timeout=0`` would take them, up to the first that finds
        none. A consumer of small micro-batches that claims ahead pays one round trip for
        several (``Loader(prefetch=...)`` and a stage's ``prefetch`` use it).
        """
        args = (sampler, columns, min_n, timeout, dp_rank, lease_timeout, consumer)
        return self._claim("claim_batches()", task, n, batches, *args)

    def _claim(
        self,
        what: str,
        task: str,
        n: int,
        batches: int,
        sampler: Sampler | None,
        columns: Sequence[str] | None,
        min_n: int | None,
        timeout: float | None,
        dp_rank: int,
        lease_timeout: float | None,
        consumer: str,
    ) -> list[BatchMeta]:
        self._control.raise_policy_error()
        if not isinstance(task, str):
            raise ConfigError(f"{what} task must be a str, got {task!r}")
        n = int_in(n, 1, f"{what} n must be a positive int")
        batches = int_in(batches, 1, f"{what} batches must be a positive int")
        if min_n is not None:
            min_n = int_in(min_n, 1, f"{what} min_n must be an int in [1, n={n}]", high=n)
        timeout = check_seconds(timeout, f"{what} timeout", allow_zero=True)
        lease_timeout = check_seconds(lease_timeout, f"{what} lease_timeout", allow_zero=False)
        dp_rank = int_in(dp_rank, 0, f"{what} dp_rank must be an int >= 0")
        if not isinstance(consumer, str):
            raise ConfigError(f"{what} consumer must be a str, got {consumer!r}")
        if sampler is not None and not isinstance(sampler, Sampler):
            raise ConfigError(f"{what} sampler must be a flowrl Sampler, got {sampler!r}")
        cols = None if columns is None else self.schema.check_names(columns, f"claim({task!r})")
        cmd = Claim(
            task=task,
            n=n,
            columns=cols,
            min_n=min_n,
            timeout=timeout,
            dp_rank=dp_rank,
            lease_timeout=lease_timeout,
            consumer=consumer,
            more=batches - 1,
        )
        return self._control.claim(cmd, sampler or _FIFO)

    def claim_nowait(self, task: str, n: int, **kwargs: Any) -> BatchMeta:
        """Like :meth:`claim`, but raises :class:`~flowrl.errors.NothingReady` at once."""
        kwargs["timeout"] = 0.0
        return self.claim(task, n, **kwargs)

    def get(self, meta: BatchMeta, columns: Sequence[str] | None = None) -> Batch:
        """Read the columns of a claimed batch straight from the storage units."""
        return self._get([meta], columns, "get()")[0]

    def get_batches(
        self, metas: Sequence[BatchMeta], columns: Sequence[str] | None = None
    ) -> list[Batch]:
        """:meth:`get` of several batches (those of :meth:`claim_batches`, say): the batches
        a storage unit holds are read in one request, and every unit's request is sent
        before any answer is awaited."""
        if isinstance(metas, BatchMeta) or not isinstance(metas, Sequence):
            raise ConfigError(f"get_batches() expects a list of BatchMeta, got {metas!r}")
        return self._get(metas, columns, "get_batches()")

    def _get(
        self, metas: Sequence[BatchMeta], columns: Sequence[str] | None, what: str
    ) -> list[Batch]:
        wanted = None if columns is None else self.schema.check_names(columns, what)
        plans = []  # per batch: its columns and its parts by unit (None: empty)
        for meta in metas:
            self._check_handle(meta, what)
            cols = meta.columns if wanted is None else wanted
            plans.append((cols, list(_split_by_unit(meta.units)) if len(meta) else None))
        read = {cols for cols, parts in plans if parts is not None}
        if len(read) > 1:
            raise ConfigError(f"{what}: the batches have different columns; pass columns=")
        requests = [
            (unit, _part(meta.indices, pos))
            for meta, (_, parts) in zip(metas, plans, strict=True)
            for unit, pos in parts or ()
        ]
        results = self._data.read_many(requests, read.pop()) if requests else []
        batches, at = [], 0
        for meta, (cols, parts) in zip(metas, plans, strict=True):
            if parts is None:
                empty = {c: pa.array([], type=self.schema[c].arrow_type) for c in cols}
                batches.append(Batch(meta, empty, self.schema.by_name))
                continue
            arrays = _in_request_order(parts, results[at : at + len(parts)])
            at += len(parts)
            batches.append(Batch(meta, arrays, self.schema.by_name))
        return batches

    # -- partial rollouts -------------------------------------------------------------------
    def append(
        self,
        indices: BatchMeta | np.ndarray | Sequence[int],
        column: str | Mapping[str, Any],
        values: Any = None,
        *,
        version: int,
    ) -> Any:
        """Append tokens to the in-progress ragged ``column`` of samples (partial rollouts).

        ``values`` holds one 1-D sequence per sample: the tokens generated since the last
        append, by policy ``version``. The samples' storage units keep the prefix (on disk
        too when the hub is journaled); a worker resuming a preempted request reads it with
        :meth:`partial`. A later ``put`` of the column completes it. Returns the prefix
        length of each sample.

        ``column`` may instead map several ragged columns to their values (e.g. the tokens
        and their log-probs): they are appended together, one request per storage unit,
        each unit taking all of them or none. Returns ``{column: prefix lengths}`` then.
        """
        meta, cols, encoded, version = self._append_args(
            indices, column, values, version, "append()"
        )
        lengths = {c.name: np.empty(len(meta), dtype=np.int64) for c in cols}
        for unit, pos, parts in self._append_parts(meta, cols, encoded):
            got = self._data.append(unit, _part(meta.indices, pos), parts, version)
            for c, n in zip(cols, got, strict=True):
                lengths[c.name][slice(None) if pos is None else pos] = n
        return lengths if isinstance(column, Mapping) else lengths[cols[0].name]

    def append_async(
        self,
        indices: BatchMeta | np.ndarray | Sequence[int],
        column: str | Mapping[str, Any],
        values: Any = None,
        *,
        version: int,
    ) -> PutFuture:
        """Like :meth:`append`, but returns once the request is sent, with a
        :class:`PutFuture` of the samples' indices (a generator appending every few decoding
        steps does not wait a round trip each time).

        Checked as :meth:`append` checks it before the call returns; a refusal raises from
        the future's ``result()``, :meth:`flush` or this thread's next ``put_async`` or
        ``append_async``. This thread's appends to a sample land in the order they are
        made; wait for them (``result()``) before completing the column with a ``put``
        from another thread. In-process, and for samples on several storage units, the
        append completes before the call returns.
        """
        self._data.raise_failed_put()
        meta, cols, encoded, version = self._append_args(
            indices, column, values, version, "append_async()"
        )
        parts = list(self._append_parts(meta, cols, encoded))
        if len(parts) == 1:
            unit, pos, arrays = parts[0]
            return self._data.append_async(unit, _part(meta.indices, pos), arrays, version)
        for unit, pos, arrays in parts:
            self._data.append(unit, _part(meta.indices, pos), arrays, version)
        return PutFuture.completed(meta.indices)

    def _append_args(
        self, indices: Any, column: Any, values: Any, version: Any, where: str
    ) -> tuple[BatchMeta, list[Column], dict[str, Encoded], int]:
        """An append's samples, ragged columns, encoded values and version, checked."""
        self._control.raise_policy_error()
        if isinstance(column, Mapping):
            if values is not None:
                raise ConfigError(
                    f"{where} takes a mapping of columns to values, or a column and its "
                    "values, not both"
                )
            data = column
        elif isinstance(column, str):
            data = {column: values}
        else:
            raise ConfigError(
                f"{where} column must be a column name or a mapping of column names to "
                f"values, got {column!r}"
            )
        if not data:
            raise ConfigError(f"{where} got no column to append to")
        cols = [self._ragged(name, where) for name in data]
        version = _check_version(version, where)
        meta = self._locate(indices, where)
        encoded, _, _ = self.schema.encode_all(data, len(meta), where)
        return meta, cols, encoded, version

    @staticmethod
    def _append_parts(
        meta: BatchMeta, cols: list[Column], encoded: dict[str, Encoded]
    ) -> Iterator[tuple[int, np.ndarray | None, list[tuple[Column, pa.Array]]]]:
        """Per storage unit of ``meta``: the unit, the positions of its samples (None: all)
        and each column's values there."""
        for unit, pos in _split_by_unit(meta.units):
            yield (
                unit,
                pos,
                [
                    (
                        c,
                        encoded[c.name].array
                        if pos is None
                        else encoded[c.name].array.take(numeric_array(pos)),
                    )
                    for c in cols
                ],
            )

    def partial(self, indices: BatchMeta | np.ndarray | Sequence[int], column: str) -> Partial:
        """What :meth:`append` stored so far for each sample (empty when nothing)."""
        col = self._ragged(column, "partial()")
        meta = self._locate(indices, "partial()")
        if len(meta) == 0:
            empty = RaggedArray(np.empty(0, dtype=col.np_dtype), np.zeros(1, dtype=np.int64))
            return Partial(empty, RaggedArray(np.empty(0, np.int64), np.zeros(1, np.int64)))
        parts = list(_split_by_unit(meta.units))
        results = [
            dict(
                zip(
                    (column, "versions"),
                    self._data.read_partial(unit, _part(meta.indices, pos), col),
                    strict=True,
                )
            )
            for unit, pos in parts
        ]
        arrays = _in_request_order(parts, results)
        return Partial(_to_python(col, arrays[column]), _to_python(VERSIONS, arrays["versions"]))

    def _ragged(self, column: str, where: str) -> Column:
        if not isinstance(column, str):
            raise ConfigError(f"{where} column must be a column name, got {column!r}")
        col = self.schema[column]
        if col.kind != "ragged":
            raise SchemaError(
                f"{where} extends ragged columns only; column {column!r} holds {col.describe()}"
            )
        return col

    def _locate(self, indices: Any, where: str) -> BatchMeta:
        if isinstance(indices, BatchMeta):
            self._check_handle(indices, where)
            return indices
        return self._control.meta(MetaOf(indices=_as_indices(indices, where), columns=()))

    def meta(self, indices: np.ndarray | Sequence[int], columns: Sequence[str]) -> BatchMeta:
        """An unleased handle to read given samples with :meth:`get` (cannot be acked)."""
        idx = _as_indices(indices, "meta()")
        cols = self.schema.check_names(columns, "meta()")
        return self._control.meta(MetaOf(indices=idx, columns=cols))

    def ack(self, meta: BatchMeta, indices: np.ndarray | Sequence[int] | None = None) -> None:
        """Mark a claim (or some of its samples) consumed: never delivered to the task again."""
        self._check_lease(meta, "ack")
        idx = None if indices is None else _as_indices(indices, "ack()")
        self._control.ack(Ack(task=meta.task, lease=meta.lease, indices=idx))

    def drop(self, meta: BatchMeta, indices: np.ndarray | Sequence[int] | None = None) -> None:
        """Ack samples and discard them for every other task (a filter): they get evicted.

        Tasks that already leased a dropped sample still finish it; the sample is evicted
        once they ack.
        """
        self._check_lease(meta, "drop")
        idx = None if indices is None else _as_indices(indices, "drop()")
        self._control.ack(Ack(task=meta.task, lease=meta.lease, indices=idx, drop=True))

    def release(self, meta: BatchMeta) -> None:
        """Give a claim back unprocessed: its samples become claimable again, first in line."""
        self._check_lease(meta, "release")
        self._control.release(Release(task=meta.task, lease=meta.lease))

    def _check_handle(self, meta: Any, where: str) -> None:
        """A BatchMeta whose storage units exist and match its samples (a handle built or
        changed by hand could name others)."""
        if not isinstance(meta, BatchMeta):
            raise ConfigError(f"{where} expects the BatchMeta a claim returned, got {meta!r}")
        units, n_units = meta.units, self._data.n_units
        if units.shape != meta.indices.shape or units.dtype.kind not in "iu":
            raise ConfigError(
                f"{where}: a BatchMeta holds one int storage unit per sample; this one has "
                f"units {units.dtype} of shape {units.shape} for {meta.indices.size} samples"
            )
        low, high = bounds(units) if units.size else (0, 0)
        if low < 0 or high >= n_units:
            bad = low if low < 0 else high
            raise UnknownIndexError(
                f"{where}: storage unit {bad} does not exist (this hub has {n_units}); "
                "is the BatchMeta from another hub?"
            )

    def _check_lease(self, meta: Any, what: str) -> None:
        if not isinstance(meta, BatchMeta):
            raise ConfigError(f"{what}() expects the BatchMeta a claim returned, got {meta!r}")
        if meta.lease == 0:
            raise LeaseError(f"{what}(): this BatchMeta came from meta(), not from a claim")

    # -- versions, stream end, events -------------------------------------------------------
    def publish_version(self, version: int) -> None:
        """Announce a new policy version (a ``VersionPublished`` event); never decreasing."""
        version = _check_version(version, "publish_version()")
        self._control.publish_version(PublishVersion(version=version))

    @property
    def version(self) -> int:
        """The latest published policy version."""
        return self._control.version()

    def end_stream(self, columns: Sequence[str] = ()) -> None:
        """No new samples will be put; ``columns`` will not be written again either."""
        cols = self.schema.check_names(columns, "end_stream()")
        self._control.end_stream(EndStream(columns=cols))

    def subscribe(
        self,
        observer: Observer | Callable[[Event], Any],
        *,
        strict: bool = False,
        events: Sequence[type] | None = None,
    ) -> Subscription:
        """Receive every event from now on (observers fail soft; ``strict`` policies fail
        hard). ``events``: only these kinds (e.g. ``[flowrl.events.VersionPublished]``);
        over processes, events no subscriber of this client wants are not even decoded."""
        if not callable(observer):
            raise ConfigError(f"subscribe() expects an Observer or a callable, got {observer!r}")
        if not isinstance(strict, bool):
            raise ConfigError(f"subscribe() strict must be a bool, got {strict!r}")
        kinds = None if events is None else _event_kinds(events)
        return self._control.events().subscribe(observer, strict=strict, kinds=kinds)

    def flush_events(self, timeout: float | None = 5.0) -> bool:
        """Wait until subscribers have received every event so far."""
        timeout = check_seconds(timeout, "flush_events() timeout", allow_zero=True)
        return self._control.flush_events(timeout)

    def statistics(self) -> HubStats:
        stats = self._control.statistics()
        return msgspec.structs.replace(stats, units=self._data.statistics())

    def close(self) -> None:
        """Close the client (in-process: the hub); calls on it are refused afterwards."""
        if not self._closed:
            self._send_held_puts()
            self._closed = True
            self._control.close()
            self._data.close()

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_put_id() -> int:
    """A put's id, unique among the puts staged at one time (63 random bits, never 0)."""
    return random.getrandbits(63) | 1


def _ackable(meta: Any, target: np.ndarray | None, where: str) -> LeaseRef:
    """(task, lease) of the claim a put acks; its samples must be the put's (they are
    when the put names the claim itself: ``indices=meta``, no lookup needed)."""
    if not isinstance(meta, BatchMeta) or meta.lease == 0:
        raise ConfigError(f"{where}: ack= expects the BatchMeta a claim returned, got {meta!r}")
    if target is None:
        raise ConfigError(f"{where}: ack= needs indices= (new samples were never claimed)")
    if target is not meta.indices and not np.isin(target, meta.indices).all():
        raise LeaseError(f"{where}: ack= names a claim that does not hold every sample put")
    return LeaseRef(meta.task, meta.lease)


def _check_version(version: Any, where: str) -> int:
    """A policy version as an int (a Python or numpy integer in [0, 2**63))."""
    return int_in(version, 0, f"a policy version must be an int in [0, 2**63) in {where}")


def _sequence_number(seq: Any, producer: str, where: str) -> int | None:
    """A put's ``seq``: None, or an int >= 0 (numpy's too) of a named producer."""
    if seq is None:
        return None
    if not isinstance(seq, int | np.integer) or isinstance(seq, bool) or seq < 0:
        raise ConfigError(
            f"{where}: seq expects an int >= 0 (the put's number among its producer's puts) "
            f"or None, got {seq!r}"
        )
    if not producer:
        raise ConfigError(
            f"put(seq={seq}) needs producer=, a name the producer keeps across restarts "
            "(e.g. 'rollout-3'): sequence numbers count the puts of one producer"
        )
    return int(seq)


def _as_indices(indices: Any, where: str) -> np.ndarray:
    if isinstance(indices, BatchMeta):
        return indices.indices
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise SchemaError(
            f"{where} expects sample indices as a 1-D integer array or a BatchMeta, got "
            f"{arr.dtype} of shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def _versions(version: Any, n: int, where: str) -> int | np.ndarray | None:
    """A put's policy version: None (the hub's current one), one int, or one per sample
    (kept as one int when they are all the same)."""
    if version is None:
        return None
    if not isinstance(version, list | tuple | np.ndarray) and not hasattr(version, "detach"):
        return _check_version(version, where)  # one int (anything else is refused here)
    per_sample = _per_sample(version, n, "version", where)
    assert per_sample is not None
    return one_if_equal(per_sample)


def _per_sample(value: Any, n: int, name: str, where: str) -> np.ndarray | None:
    """One int64 per sample (``tokens`` and ``version`` must be >= 0); a single int is
    broadcast."""
    if value is None:
        return None
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        value = [int(value)] * n
    try:
        arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
    except ValueError:  # ragged nesting numpy cannot shape
        arr = np.empty(0, dtype=object)
    low = 0 if name in ("tokens", "version") else -(2**63)
    if arr.dtype == object and not all(type(x) is int for x in arr.ravel()):
        arr = np.empty(0, dtype=object)  # None, str or other objects: not ints
    if (
        arr.shape != (n,)
        or arr.dtype.kind not in "iuO"
        or (arr.size and not low <= int(arr.min()) <= int(arr.max()) < 2**63)
    ):
        raise SchemaError(
            f"{name} in {where} must be an int or {n} ints (one per sample) in "
            f"[{low}, 2**63), got {arr.dtype} of shape {arr.shape}"
        )
    return arr.astype(np.int64)


def _event_kinds(events: Any) -> frozenset[type]:
    """The event classes of ``subscribe(events=...)``, checked."""
    if isinstance(events, str | type) or not isinstance(events, Sequence) or not events:
        raise ConfigError(
            f"subscribe() events must be a non-empty list of event classes, got {events!r}"
        )
    for kind in events:
        if kind not in EVENT_TYPES:
            names = ", ".join(cls.__name__ for cls in EVENT_TYPES)
            raise ConfigError(f"subscribe() events: {kind!r} is not an event class ({names})")
    return frozenset(events)


def _in_request_order(
    parts: list[tuple[int, np.ndarray | None]],
    results: Sequence[Mapping[str, pa.Array | LazyColumn]],
) -> Mapping[str, pa.Array | LazyColumn]:
    """Merge per-unit reads (``parts`` from :func:`_split_by_unit`) back into request order."""
    if len(parts) == 1:
        return results[0]
    order = np.concatenate([pos for _, pos in parts if pos is not None])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return {
        c: pa.concat_arrays([arrow_of(r[c]) for r in results]).take(numeric_array(inverse))
        for c in results[0]
    }


def _part(values: np.ndarray, pos: np.ndarray | None) -> np.ndarray:
    """The entries of one storage unit's part (``pos`` from :func:`_split_by_unit`)."""
    return values if pos is None else values[pos]


def _split_by_unit(units: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
    """(unit, positions) per storage unit; positions None when one unit holds everything."""
    first = int(units[0])
    if all_equal(units):
        return [(first, None)]
    return [(int(u), np.flatnonzero(units == u)) for u in np.unique(units)]

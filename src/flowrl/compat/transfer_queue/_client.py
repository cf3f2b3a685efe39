"""TransferQueueClient: TransferQueue's client API over a flowrl hub.

How TransferQueue's concepts map onto the hub's:

* a *field* is a column (declared from the first TensorDict that carries it, see _tensors);
* a *partition* is the samples' hub ``partition``; every sample also has the column
  ``_tq_in``, so that a task can read all of a partition's samples whatever their fields;
* a *task* consuming *fields* of a partition is a hub task named ``tq:<task>:<partition>:
  <fields>``, scoped to the partition, that needs those fields; ``get_meta`` claims and
  acks at once (TransferQueue marks samples consumed when it hands out their metadata);
* samples live until cleared (as in TransferQueue): task ``_tq_clear`` reads every sample
  and consumes only those cleared. ``clear_samples`` / ``kv_clear`` write its column
  ``_tq_clear`` on the samples, claim them for it and drop them, which evicts them for
  every task; ``clear_partition`` registers ``_tq_all:<partition>`` (scoped, needs
  ``_tq_in``), drops all it can claim, then unregisters every task scoped to the
  partition: the hub holds nothing of a cleared partition, however many there were;
* *keys*, *tags* (``custom_meta``) and the column declarations live in the key directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, final

import numpy as np

from flowrl._client.base import HubClient
from flowrl._client.inproc import Hub
from flowrl._controller.meta import BatchMeta as HubMeta
from flowrl._schema.columns import Column
from flowrl._schema.ragged import RaggedArray
from flowrl.compat.transfer_queue._directory import KeyDirectory, RemoteDirectory
from flowrl.compat.transfer_queue._meta import BatchMeta, KVBatchMeta, field_schema_of
from flowrl.compat.transfer_queue._sampling import SamplerRunner
from flowrl.compat.transfer_queue._tensors import (
    check_field_name,
    check_tags,
    field_columns,
    import_tensordict,
    read_fields,
    single_sample,
)
from flowrl.errors import (
    ConfigError,
    HubFull,
    LeaseError,
    NothingReady,
    SchemaError,
    Timeout,
    UnknownColumnError,
    UnknownTaskError,
)

__all__ = ["DEFAULT_PUT_TIMEOUT", "TransferQueueClient"]

_ALL = "_tq_all:"
_CLEAR = "_tq_clear"
_IN = "_tq_in"
_IN_COLUMN = Column.scalar(_IN, "bool")
_CLEAR_COLUMN = Column.scalar(_CLEAR, "bool")
_CLAIM_ALL = 1 << 20  # samples one clear_partition claim takes at most
_RETRY_S = 0.01
#: Seconds a put of new samples waits for room in a full hub, unless told otherwise.
DEFAULT_PUT_TIMEOUT = 60.0


@final
class TransferQueueClient:
    """TransferQueue's ``TransferQueueClient`` (``tq.get_client()``) on a flowrl hub.

    ``fetch_timeout``: seconds ``get_meta`` waits for ``batch_size`` ready samples before it
    raises ``TimeoutError`` (TransferQueue's ``TQ_CONTROLLER_GET_METADATA_TIMEOUT``); with
    ``polling_mode`` it returns an empty ``BatchMeta`` at once instead. ``put_timeout``:
    seconds a put of new samples waits for room in a full hub before it raises
    :class:`~flowrl.errors.Timeout` (each writing call takes its own ``timeout`` too).
    """

    def __init__(
        self,
        hub: HubClient,
        directory: KeyDirectory | RemoteDirectory,
        *,
        polling_mode: bool = False,
        fetch_timeout: float = 1.0,
        put_timeout: float = DEFAULT_PUT_TIMEOUT,
        sampling: SamplerRunner | RemoteDirectory | None = None,
    ) -> None:
        if not isinstance(hub, HubClient):
            raise ConfigError(f"TransferQueueClient needs a flowrl hub client, got {hub!r}")
        self.hub = hub
        self.directory = directory
        self.polling_mode = polling_mode
        self.fetch_timeout = fetch_timeout
        self.put_timeout = put_timeout
        self.sampling = sampling  # the hub's sampler, if tq.init was given one
        self._tasks: set[str] = set()  # hub tasks this client registered
        # Over a transport, get_meta's ack goes out from a worker thread, overlapping the
        # caller's get_data; a failed ack is raised by this client's next call.
        self._acks: ThreadPoolExecutor | None = None
        self._acked: list[Future[None]] = []

    # -- low-level API: put / get_meta / get_data --------------------------------------------
    def put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        *,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Write a TensorDict: new samples into ``partition_id``, or fields of ``metadata``'s.

        New samples wait up to ``timeout`` seconds (default ``put_timeout``) for room.
        """
        seconds = self._timeout(timeout, "put()")
        n, columns, values = field_columns(data, "put()", self._schema_for(data))
        names = [c.name for c in columns]
        if metadata is None:
            partition = _check_partition(partition_id, "put()")
            indices = self._insert(partition, n, columns, values, seconds, "put()")
            return BatchMeta._of(
                _handle(indices, names), [partition] * n, self._schema_of(names), produced=True
            )
        if not isinstance(metadata, BatchMeta):
            raise ConfigError(f"put() metadata must be a BatchMeta, got {metadata!r}")
        if n != len(metadata):
            raise SchemaError(
                f"put(): the TensorDict has {n} samples but metadata names {len(metadata)}"
            )
        if metadata._custom is not None:
            check_tags(metadata._custom, "put() metadata.custom_meta")
        self._update(np.asarray(metadata.global_indexes, dtype=np.int64), columns, values)
        if metadata._custom is not None:  # fetched or changed here: store it
            self.set_custom_meta(metadata)
        written = metadata.copy()
        written.field_schema.update(self._schema_of(names))
        written.production_status[:] = 1
        return written

    def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Take ``batch_size`` samples of ``partition_id`` whose ``data_fields`` are ready and
        that ``task_name`` has not consumed; they count as consumed from here on.

        Waits up to ``timeout`` seconds (default ``fetch_timeout``; then ``TimeoutError``,
        flowrl's :class:`~flowrl.errors.Timeout`), or returns an empty
        ``BatchMeta`` at once in polling mode. ``sampling_config`` goes to the hub's sampler
        (``controller.sampler`` of ``tq.init``); the default one takes the oldest samples.
        """
        fields = _check_fields(data_fields, "get_meta()")
        partition = _check_partition(partition_id, "get_meta()")
        if mode != "fetch":
            raise ConfigError(
                f"get_meta(mode={mode!r}) is not supported by flowrl's TransferQueue client: "
                "'fetch' only (insert with put(data, partition_id=...))"
            )
        if not isinstance(task_name, str) or not task_name:
            raise ConfigError(f"get_meta() needs a task_name (a non-empty str), got {task_name!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"get_meta() batch_size must be a positive int, got {batch_size!r}")
        if sampling_config is not None and not isinstance(sampling_config, Mapping):
            raise ConfigError(f"get_meta() sampling_config must be a dict, got {sampling_config!r}")
        wait = self.fetch_timeout if timeout is None else self._timeout(timeout, "get_meta()")
        task = f"tq:{task_name}:{partition}:{','.join(sorted(fields))}"
        deadline = time.monotonic() + (0.0 if self.polling_mode else wait)
        wanted = (task, task_name, partition, batch_size, dict(sampling_config or {}))
        try:
            try:
                claimed = self._take(wanted, fields, deadline)
            except UnknownTaskError:  # another client's clear_partition unregistered it
                self._tasks.discard(task)
                claimed = self._take(wanted, fields, deadline)
        except (NothingReady, Timeout) as e:
            if self.polling_mode:
                return BatchMeta.empty()
            raise Timeout(
                f"get_meta(): fewer than {batch_size} samples of partition {partition!r} have "
                f"fields {fields} ready for task {task_name!r} after {wait} s "
                "(get_meta's timeout, TransferQueueClient.fetch_timeout by default)"
            ) from e
        if claimed is None:
            return BatchMeta.empty()
        return BatchMeta._of(
            claimed,
            [partition] * len(claimed),
            self._schema_of(fields),
            produced=True,
            fetch_custom=self._custom_meta,
        )

    def _take(
        self, wanted: tuple[str, str, str, int, dict[str, Any]], fields: list[str], deadline: float
    ) -> HubMeta | None:
        """get_meta's samples, consumed by the hub task (``wanted``: the hub task, the task
        name, the partition, the batch size and the sampling config); None: the sampler
        handed out nothing in polling mode."""
        task, partition, batch_size = wanted[0], wanted[2], wanted[3]
        self._ensure_consumer(task, fields, partition, deadline)
        if self.sampling is not None:
            return self._sampled(self.sampling, wanted, fields, deadline)
        claimed = self.hub.claim(task, batch_size, timeout=self._left(deadline))
        self._ack(claimed)
        return claimed

    def _sampled(
        self,
        sampling: SamplerRunner | RemoteDirectory,
        wanted: tuple[str, str, str, int, dict[str, Any]],
        fields: list[str],
        deadline: float,
    ) -> HubMeta | None:
        """get_meta through the hub's sampler (tq.init's controller.sampler): a handle of
        what it hands out, once it hands out something; None in polling mode."""
        task_name = wanted[1]
        while True:
            taken = sampling.sample(*wanted)
            if taken or self.polling_mode:
                break
            if time.monotonic() >= deadline:
                raise Timeout(f"the sampler handed out nothing for task {task_name!r}")
            time.sleep(_RETRY_S)
        if not taken:
            return None
        return self.hub.meta(np.asarray(taken, dtype=np.int64), fields)

    def get_data(self, metadata: BatchMeta) -> Any:
        """The fields of ``metadata``'s samples as a TensorDict (TransferQueue's layout)."""
        td = import_tensordict()
        if not isinstance(metadata, BatchMeta):
            raise ConfigError(f"get_data() expects a BatchMeta, got {metadata!r}")
        if len(metadata) == 0 or not metadata.field_names:
            return td.TensorDict({}, batch_size=[0])
        fields = metadata.field_names
        self._know_columns(fields)
        handle = metadata._handle
        if handle is None or (handle.lease == 0 and (handle.units < 0).any()):
            # built by hand, or from a put: locate the samples
            handle = self.hub.meta(np.asarray(metadata.global_indexes, dtype=np.int64), fields)
        batch = self.hub.get(handle, columns=fields)
        return read_fields(batch, fields, self.hub.schema.by_name)

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store ``metadata``'s per-sample ``custom_meta`` (merged into what samples have)."""
        if not isinstance(metadata, BatchMeta):
            raise ConfigError(f"set_custom_meta() expects a BatchMeta, got {metadata!r}")
        custom = check_tags(metadata.custom_meta, "set_custom_meta()")
        for partition in sorted(set(metadata.partition_ids)):
            pos = [i for i, p in enumerate(metadata.partition_ids) if p == partition]
            indices = [metadata.global_indexes[i] for i in pos]
            self.directory.update(partition, indices, [custom[i] for i in pos], [])

    # -- clearing and status -----------------------------------------------------------------
    def clear_partition(self, partition_id: str) -> None:
        """Evict every sample of the partition, forget its keys and the hub tasks that
        read it (a task whose claim another process has not acked yet stays)."""
        partition = _check_partition(partition_id, "clear_partition()")
        self._raise_failed_ack(wait=True)  # this client's claims settled: no lease left
        task = _ALL + partition
        if self._know_columns([_IN], required=False):
            self.hub.register_task(task, [_IN], partition=partition)
            while True:
                try:
                    meta = self.hub.claim(task, _CLAIM_ALL, min_n=1, timeout=0.0)
                except NothingReady:
                    break
                self.hub.drop(meta)
            self._unregister_partition(partition)
        self.directory.remove_partition(partition)
        if self.sampling is not None:
            self.sampling.clear_cache(partition)

    def _unregister_partition(self, partition: str) -> None:
        """Unregister the hub tasks of this client's kind that read only ``partition``."""
        for name, stats in self.hub.statistics().tasks.items():
            if stats.partition == partition and (
                name.startswith("tq:") or name == _ALL + partition
            ):
                self._tasks.discard(name)
                # (LeaseError: another process's get_meta has not acked yet;
                # UnknownTaskError: another clear_partition came first)
                with contextlib.suppress(LeaseError, UnknownTaskError):
                    self.hub.unregister_task(name)

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Evict ``metadata``'s samples (for every task) and forget their keys."""
        if not isinstance(metadata, BatchMeta):
            raise ConfigError(f"clear_samples() expects a BatchMeta, got {metadata!r}")
        self._drop(np.asarray(metadata.global_indexes, dtype=np.int64))
        self.directory.forget(metadata.global_indexes)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """Whether ``task_name`` consumed every sample of the partition that is ready for it.

        Samples whose fields are not all produced yet do not count (TransferQueue counts
        them as not consumed).
        """
        partition = _check_partition(partition_id, "check_consumption_status()")
        self._raise_failed_ack(wait=True)  # this client's acks count
        stats = self.hub.statistics()
        prefix = f"tq:{task_name}:{partition}:"
        mine = [
            s
            for name, s in stats.tasks.items()
            # (the rest is the fields, which hold no ':': task 'a' is not task 'a:b')
            if s.partition == partition
            and name.startswith(prefix)
            and ":" not in name[len(prefix) :]
        ]
        if not stats.partitions.get(partition) or not mine:
            return False
        return all(s.ready == 0 and s.leased == 0 for s in mine)

    def get_partition_list(self) -> list[str]:
        """Partitions that have held samples and were not cleared since."""
        listed = set(self.directory.listing(None))
        listed.update(self.hub.statistics().partitions)
        return sorted(listed)

    # -- KV API --------------------------------------------------------------------------------
    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: Any = None,
        tags: Sequence[dict[str, Any]] | None = None,
        *,
        timeout: float | None = None,
    ) -> KVBatchMeta:
        """Write fields and/or tags of samples named by keys (new keys create samples, which
        wait up to ``timeout`` seconds, default ``put_timeout``, for room in a full hub)."""
        seconds = self._timeout(timeout, "kv_batch_put()")
        keys = _check_keys(keys, "kv_batch_put()")
        partition = _check_partition(partition_id, "kv_batch_put()")
        if fields is None and tags is None:
            raise ConfigError("kv_batch_put() needs fields, tags or both, got neither")
        if tags is not None and (
            not isinstance(tags, Sequence)
            or len(tags) != len(keys)
            or not all(isinstance(t, dict) for t in tags)
        ):
            raise ConfigError(
                f"kv_batch_put() tags must be a list of {len(keys)} dicts (one per key), got "
                f"{tags!r:.200}"
            )
        if tags is not None:
            tags = check_tags(tags, "kv_batch_put()")
        columns: list[Column] = []
        values: dict[str, Any] = {}
        if fields is not None:
            n, columns, values = field_columns(fields, "kv_batch_put()", self._schema_for(fields))
            if n != len(keys):
                raise SchemaError(
                    f"kv_batch_put(): {len(keys)} keys but the fields TensorDict has batch size {n}"
                )
        known = np.asarray(self.directory.lookup(partition, keys), dtype=np.int64)
        indices = known.copy()
        new = np.flatnonzero(known < 0)
        old = np.flatnonzero(known >= 0)
        if new.size:  # first: a full hub times out before any key changed
            created = self._insert(
                partition,
                new.size,
                columns,
                _take(values, new, len(keys)),
                seconds,
                "kv_batch_put()",
            )
            new_keys = [keys[i] for i in new]
            bound = np.asarray(self.directory.bind(partition, new_keys, created.tolist()))
            lost = np.flatnonzero(bound != created)  # named by another writer meanwhile
            if lost.size:
                if columns:
                    self._update(bound[lost], columns, _take(values, new[lost], len(keys)))
                self._drop(created[lost])
            indices[new] = bound
        if old.size and columns:
            self._update(known[old], columns, _take(values, old, len(keys)))
        merged, common = self.directory.update(
            partition, indices.tolist(), tags, [c.name for c in columns]
        )
        return KVBatchMeta(keys=keys, tags=merged, partition_id=partition, fields=common)

    def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: Any = None,
        tag: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> KVBatchMeta:
        """One key's fields (a TensorDict of batch 1, or a dict of one sample's values)."""
        if not isinstance(key, str):
            raise ConfigError(f"kv_put() key must be a str, got {key!r}")
        if isinstance(fields, Mapping) and not _is_tensordict(fields):
            fields = single_sample(fields, "kv_put()")
        if tag is not None and not isinstance(tag, dict):
            raise ConfigError(f"kv_put() tag must be a dict, got {tag!r}")
        tags = None if tag is None else [tag]
        return self.kv_batch_put([key], partition_id, fields, tags, timeout=timeout)

    def kv_batch_get(
        self,
        keys: Sequence[str] | str,
        partition_id: str,
        select_fields: Sequence[str] | str | None = None,
    ) -> Any:
        """The fields of the keys' samples as a TensorDict (by default, those all of them have;
        ``select_fields`` never put into the hub are left out, as TransferQueue does)."""
        keys = _check_keys([keys] if isinstance(keys, str) else keys, "kv_batch_get()")
        partition = _check_partition(partition_id, "kv_batch_get()")
        indices = self._indices_of(keys, partition, "kv_batch_get()")
        if select_fields is None:
            fields = self.directory.describe(indices.tolist())[1]
        else:
            names = [select_fields] if isinstance(select_fields, str) else select_fields
            asked = _check_fields(names, "kv_batch_get()")
            # as TransferQueue: a field never put into this hub is left out, not an error
            # (verl's V1 trainer asks for ref_log_prob and values with no reference or critic)
            self._know_columns(asked, required=False)
            fields = [f for f in asked if f in self.hub.schema.by_name]
            if not fields:
                raise UnknownColumnError(
                    f"kv_batch_get(): none of the fields {asked} was ever put into this "
                    f"TransferQueue (flowrl hub); keys asked for in partition {partition!r}"
                )
        if not fields:
            raise ConfigError(
                f"kv_batch_get(): the keys of partition {partition!r} have no field in common "
                "to read; pass select_fields"
            )
        self._know_columns(fields)
        try:
            handle = self.hub.meta(indices, fields)
        except SchemaError as e:
            raise ConfigError(f"kv_batch_get(): some fields are not ready on every key: {e}") from e
        meta = BatchMeta._of(
            handle, [partition] * len(keys), {f: {} for f in fields}, produced=True
        )
        return self.get_data(meta)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """``{partition: {key: tag}}`` of one partition, or of all when ``partition_id`` is None."""
        if partition_id is not None:
            _check_partition(partition_id, "kv_list()")
        return self.directory.listing(partition_id)

    def kv_clear(self, keys: Sequence[str] | str, partition_id: str) -> None:
        """Forget keys and evict their samples (unknown keys are ignored)."""
        keys = _check_keys([keys] if isinstance(keys, str) else keys, "kv_clear()")
        partition = _check_partition(partition_id, "kv_clear()")
        gone = self.directory.remove(partition, keys)
        if gone:
            self._drop(np.asarray(gone, dtype=np.int64))

    def close(self) -> None:
        """Wait for acks in flight; close this client's connections (the hub itself is
        closed by ``tq.close()``)."""
        try:
            self._raise_failed_ack(wait=True)
        finally:
            if self._acks is not None:
                self._acks.shutdown()
            if isinstance(self.directory, RemoteDirectory):
                self.directory.close()

    # -- internals -------------------------------------------------------------------------
    def _ack(self, claimed: HubMeta) -> None:
        """Consume a claim now (in-process) or from the ack thread (other placements)."""
        self._raise_failed_ack()
        if isinstance(self.hub, Hub):
            self.hub.ack(claimed)
            return
        if self._acks is None:
            self._acks = ThreadPoolExecutor(1, thread_name_prefix="flowrl-tq-ack")
        self._acked.append(self._acks.submit(self.hub.ack, claimed))

    def _raise_failed_ack(self, wait: bool = False) -> None:
        pending = []
        for done in self._acked:
            if wait or done.done():
                done.result()  # raises the ack's error
            else:
                pending.append(done)
        self._acked = pending

    def _insert(
        self,
        partition: str,
        n: int,
        columns: list[Column],
        values: dict[str, Any],
        timeout: float,
        where: str,
    ) -> np.ndarray:
        self._declare([*columns, _IN_COLUMN, _CLEAR_COLUMN])
        self._register(_CLEAR, [_CLEAR])  # keeps every sample until it is cleared
        data = {**values, _IN: np.ones(n, dtype=bool)}
        try:
            return self.hub.put(data, partition=partition, timeout=timeout)
        except (Timeout, HubFull) as e:  # HubFull: timeout 0
            raise Timeout(
                f"{where}: no room for {n} new samples in partition {partition!r} within "
                f"{timeout} s: the hub holds {self.hub.statistics().capacity} samples at most "
                "(backend.SimpleStorage.total_storage_size); clear consumed samples "
                "(kv_clear, clear_partition) or pass a longer timeout"
            ) from e

    def _timeout(self, timeout: float | None, where: str) -> float:
        """``timeout`` checked (None: this client's ``put_timeout``)."""
        if timeout is None:
            return self.put_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise ConfigError(f"{where} timeout must be a number of seconds >= 0, got {timeout!r}")
        if not math.isfinite(timeout):
            raise ConfigError(f"{where} timeout must be finite, got {timeout!r}")
        return float(timeout)

    def _update(self, indices: np.ndarray, columns: list[Column], values: dict[str, Any]) -> None:
        if columns:
            self._declare(columns)
            self.hub.put(values, indices=indices)

    def _drop(self, indices: np.ndarray) -> None:
        """Evict samples for every task: mark them, claim them for _tq_clear, drop them."""
        if indices.size == 0:
            return
        self._declare([_CLEAR_COLUMN])
        self._register(_CLEAR, [_CLEAR])
        self.hub.put({_CLEAR: np.ones(indices.size, dtype=bool)}, indices=indices)
        self.hub.drop(self.hub.claim(_CLEAR, int(indices.size), timeout=60.0))

    def _declare(self, columns: list[Column]) -> None:
        known = self.hub.schema.by_name
        new = [c for c in columns if known.get(c.name) != c]
        if new:
            self._know_columns([c.name for c in new], required=False)
            self.hub.declare(*new)  # raises SchemaError for a field of another type
            self.directory.declare(new)

    def _know_columns(self, names: Sequence[str], *, required: bool = True) -> bool:
        """Declare here the columns other processes declared; False if one is unknown."""
        missing = [n for n in names if n not in self.hub.schema.by_name]
        if missing:
            found = self.directory.columns(missing)
            if found:
                self.hub.declare(*found)
            if len(found) < len(missing):
                if required:
                    absent = sorted(set(missing) - {c.name for c in found})
                    raise UnknownColumnError(
                        f"fields {absent} were never put into this TransferQueue (flowrl hub)"
                    )
                return False
        return True

    def _schema_for(self, data: Any) -> Mapping[str, Column]:
        """The hub's columns, with those of ``data``'s fields that other processes declared."""
        if _is_tensordict(data):
            self._know_columns([k for k in data.keys() if isinstance(k, str)], required=False)  # noqa: SIM118 (iterating a TensorDict gives rows)
        return self.hub.schema.by_name

    def _register(self, task: str, columns: list[str], partition: str | None = None) -> None:
        if task not in self._tasks:
            self.hub.register_task(task, columns, partition=partition)
            self._tasks.add(task)

    def _ensure_consumer(
        self, task: str, fields: list[str], partition: str, deadline: float
    ) -> None:
        """Register the consumer task once its fields are known (waits for a producer)."""
        columns = sorted(fields)  # one order for every client
        while not self._know_columns(columns, required=False):
            if time.monotonic() >= deadline:
                raise Timeout(f"fields {fields} of partition {partition!r} were never put")
            time.sleep(_RETRY_S)
        self._register(task, columns, partition)

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _schema_of(self, fields: Sequence[str]) -> dict[str, Any]:
        return field_schema_of(self.hub.schema.by_name, fields)

    def _custom_meta(self, indices: list[int]) -> list[dict[str, Any]]:
        return self.directory.describe(indices)[0]

    def _indices_of(self, keys: list[str], partition: str, where: str) -> np.ndarray:
        indices = np.asarray(self.directory.lookup(partition, keys), dtype=np.int64)
        if (indices < 0).any():
            unknown = [k for k, i in zip(keys, indices, strict=True) if i < 0]
            raise ConfigError(
                f"{where}: keys {unknown[:8]} are not in partition {partition!r} "
                f"({len(unknown)} unknown); kv_list() shows the keys it has"
            )
        return indices

    # -- async variants (TransferQueue's async_* methods) --------------------------------------
    async def async_put(self, data: Any, metadata: BatchMeta | None = None,
                        partition_id: str | None = None) -> BatchMeta:  # fmt: skip
        return await asyncio.to_thread(self.put, data, metadata, partition_id)

    async def async_get_meta(self, *args: Any, **kwargs: Any) -> BatchMeta:
        return await asyncio.to_thread(functools.partial(self.get_meta, *args, **kwargs))

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        return await asyncio.to_thread(self.get_data, metadata)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.set_custom_meta, metadata)

    async def async_clear_partition(self, partition_id: str) -> None:
        await asyncio.to_thread(self.clear_partition, partition_id)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        await asyncio.to_thread(self.clear_samples, metadata)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(self.kv_list, partition_id)


def _handle(indices: np.ndarray, fields: Sequence[str]) -> HubMeta:
    """An unleased handle of samples just put (units unknown: get_data locates them)."""
    zeros = np.zeros(indices.size, dtype=np.int64)
    return HubMeta(
        task="",
        lease=0,
        columns=tuple(fields),
        indices=indices,
        units=np.full(indices.size, -1, dtype=np.int16),
        tokens=zeros,
        versions=zeros,
        groups=zeros,
        nbytes=0,
        deadline=float("inf"),
    )


def _take(values: dict[str, Any], positions: np.ndarray, n: int) -> dict[str, Any]:
    """The values of some samples of a put (all of them: the values as they are)."""
    if positions.size == n:
        return values
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, RaggedArray):
            out[name] = RaggedArray.from_list([value[int(i)] for i in positions], value.dtype)
        elif isinstance(value, np.ndarray):
            out[name] = value[positions]
        else:
            out[name] = [value[int(i)] for i in positions]
    return out


def _is_tensordict(value: Any) -> bool:
    return isinstance(value, import_tensordict().TensorDictBase)


def _check_partition(partition: Any, where: str) -> str:
    if not isinstance(partition, str):
        raise ConfigError(f"{where} partition_id must be a str, got {partition!r}")
    return partition


def _check_keys(keys: Any, where: str) -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not keys:
        raise ConfigError(f"{where} keys must be a non-empty list of str, got {keys!r:.200}")
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{where} keys must all be str, got {keys!r:.200}")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{where} keys must be distinct, got duplicates in {keys!r:.200}")
    return keys


def _check_fields(fields: Any, where: str) -> list[str]:
    if isinstance(fields, str) or not isinstance(fields, Sequence) or not fields:
        raise ConfigError(f"{where} expects a non-empty list of field names, got {fields!r}")
    for name in fields:
        check_field_name(name, where)
    if len(set(fields)) != len(fields):
        raise ConfigError(f"{where}: duplicate field names in {list(fields)}")
    return list(fields)

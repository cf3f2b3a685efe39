"""TransferQueue's ``StreamingDataset`` / ``StreamingDataLoader`` on the compat client.

The dataset fetches ``batch_size`` samples with ``get_meta`` + ``get_data`` and yields
``(TensorDict, BatchMeta)`` micro-batches of ``micro_batch_size``. Streaming by default (it
waits for data forever); with ``should_check_consumption_status`` it stops once the task
consumed every ready sample of the partition. ``dp_rank`` goes to the hub's sampler in
``sampling_config`` (with ``batch_index``): with ``RankAwareSampler`` (``tq.init``'s
``controller.sampler``) every rank of one data-parallel group gets the same batches; with
the default sampler every loader draws disjoint samples of the one task.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from flowrl.compat.transfer_queue._api import ADDRESS_ENV, get_client, init
from flowrl.compat.transfer_queue._client import TransferQueueClient
from flowrl.compat.transfer_queue._meta import BatchMeta
from flowrl.errors import ConfigError

__all__ = ["StreamingDataLoader", "StreamingDataset", "chunk_batch_fn", "default_fetch_batch_fn"]

_EMPTY_SLEEP_S = 0.05


def _torch_data() -> Any:
    import torch.utils.data

    return torch.utils.data


def default_fetch_batch_fn(
    tq_client: TransferQueueClient,
    data_fields: list[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[Any, BatchMeta | None]:
    """One batch: ``(TensorDict, BatchMeta)``, or ``(None, ...)`` when none is ready."""
    try:
        meta = tq_client.get_meta(
            data_fields=data_fields,
            batch_size=batch_size,
            partition_id=partition_id,
            task_name=task_name,
            sampling_config={**sampling_config, "batch_index": batch_index},
        )
    except TimeoutError:  # not enough ready within fetch_timeout: the dataset tries again
        return None, None
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: Any, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[Any]:
    """Split a batch and its metadata into micro-batches of ``micro_batch_size``."""
    import torch

    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    total = int(td.batch_size[0])
    splits = -(-total // micro_batch_size)
    metas = batch_meta.chunk(splits)
    out = []
    for i in range(splits):
        start, end = i * micro_batch_size, min(total, (i + 1) * micro_batch_size)
        part = td.__class__({}, batch_size=[end - start])
        for key, value in td.items():
            if isinstance(value, torch.Tensor) and value.is_nested:
                part[key] = torch.nested.as_nested_tensor(
                    list(value.unbind(0)[start:end]), layout=value.layout
                )
            else:
                part[key] = td.get(key)[start:end]
        out.append((part, metas[i]))
    return out


class StreamingDataset(_torch_data().IterableDataset):  # type: ignore[misc]
    """Micro-batches of one task's samples of a partition, as TransferQueue's dataset yields.

    ``config`` (what ``tq.init`` returned, or None) is used to join the hub from a
    DataLoader worker process; the other arguments are TransferQueue's.
    """

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., Any] | None = None,
        process_batch_fn: Callable[..., Any] | None = None,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"StreamingDataset {name} must be a positive int, got {value!r}")
        if not data_fields:
            raise ConfigError(f"StreamingDataset data_fields must name fields, got {data_fields!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ConfigError(f"StreamingDataset dp_rank must be an int >= 0, got {dp_rank!r}")
        super().__init__()
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = list(data_fields)
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn: Callable[..., Any] = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn: Callable[..., Any] = process_batch_fn or chunk_batch_fn
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0

    def _client(self) -> TransferQueueClient:
        if _torch_data().get_worker_info() is not None and ADDRESS_ENV not in os.environ:
            raise ConfigError(
                "StreamingDataLoader(num_workers>0) needs a hub its worker processes can "
                "join: tq.init({'flowrl': {'placement': 'zmq'}}) before building it (an "
                "in-process hub lives in the parent process only)"
            )
        init(self.config)  # joins the hub in a DataLoader worker; a no-op where it runs
        return get_client()

    def __iter__(self) -> Iterator[tuple[Any, BatchMeta]]:
        client = self._client()
        while (
            not self.should_check_consumption_status
            or self.batch_index < len(self.buffer)
            or not client.check_consumption_status(self.task_name, self.partition_id)
        ):
            if self.batch_index < len(self.buffer):
                td, meta = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(td, meta, micro_batch_size=self.micro_batch_size)
                continue
            fetched, fetched_meta = self.fetch_batch_fn(
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config=self.sampling_config,
                batch_index=self.batch_index,
            )
            if fetched is None:
                time.sleep(_EMPTY_SLEEP_S)
            else:
                self.buffer.append((fetched, fetched_meta))

    def reset(self) -> None:
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to another partition (e.g. the next step's) and start afresh."""
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id


class StreamingDataLoader(_torch_data().DataLoader):  # type: ignore[misc]
    """A torch DataLoader over a :class:`StreamingDataset` (batching is the dataset's)."""

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[..., Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[..., Any] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise ConfigError(f"StreamingDataLoader needs a StreamingDataset, got {dataset!r}")
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def reset(self) -> None:
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[tuple[Any, BatchMeta]]:
        return self.dataset.buffer


def _identity(data: Any) -> Any:
    return data

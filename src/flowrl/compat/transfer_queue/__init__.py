"""TransferQueue's 0.1.x user API on a flowrl hub: ``import flowrl.compat.transfer_queue as tq``.

Code written for TransferQueue (``import transfer_queue as tq``) runs against flowrl by
changing that import: ``tq.init()``, the KV API (``kv_put``, ``kv_batch_put``,
``kv_batch_get``, ``kv_list``, ``kv_clear`` and their ``async_`` twins), the client of
``tq.get_client()`` (``put``, ``get_meta``, ``get_data``, ...) and ``StreamingDataset`` /
``StreamingDataLoader``, the records of ``transfer_queue.metadata`` (``BatchMeta``,
``KVBatchMeta``) and the samplers of ``transfer_queue.sampler`` (``controller.sampler`` of
``tq.init``). No Ray start-up (unless the ``ray`` placement is asked for) and
no pickle on the wire. What differs is listed in docs/transfer_queue.md.
"""

from flowrl.compat.transfer_queue._api import (
    ADDRESS_ENV,
    async_kv_batch_get,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    init,
    kv_batch_get,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
)
from flowrl.compat.transfer_queue._client import TransferQueueClient
from flowrl.compat.transfer_queue._dataloader import StreamingDataLoader, StreamingDataset
from flowrl.compat.transfer_queue._meta import BatchMeta, KVBatchMeta
from flowrl.compat.transfer_queue.sampler import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SequentialSampler,
)

__all__ = [
    "ADDRESS_ENV",
    "BaseSampler",
    "BatchMeta",
    "GRPOGroupNSampler",
    "KVBatchMeta",
    "RankAwareSampler",
    "SequentialSampler",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "init",
    "kv_batch_get",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
]

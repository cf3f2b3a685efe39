"""TransferQueue's ``transfer_queue.metadata``: the records ``get_meta``, ``put`` and the KV
calls return, which a program may also build itself (``BatchMeta(global_indexes,
partition_ids, field_schema=...)`` read with ``get_data``)."""

from flowrl.compat.transfer_queue._meta import BatchMeta, KVBatchMeta

__all__ = ["BatchMeta", "KVBatchMeta"]

"""Clients that speak other data systems' APIs, backed by a flowrl hub.

``flowrl.compat.transfer_queue``: the TransferQueue 0.1.x user API (``import
flowrl.compat.transfer_queue as tq``); see docs/transfer_queue.md. Imported on demand: it
needs the ``compat`` extra (tensordict).
"""

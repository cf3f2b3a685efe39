"""The default process group the multi-rank update engines join or create."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

__all__ = ["free_port", "init_default_group"]


def free_port() -> int:
    """A TCP port free on loopback now (a test's or launcher's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_default_group(backend: str) -> None:
    """Create the default process group: from torchrun's ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else a one-process group over an
    in-process store (no port to pick, so none another process can take first)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed requires it
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

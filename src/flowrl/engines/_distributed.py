"""The default process group the multi-rank update engines join or create."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "set_single_process_env"]


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_single_process_env() -> None:
    """With none of torchrun's ``RANK`` / ``WORLD_SIZE`` set, the environment of a
    one-process group on loopback (a free port); otherwise leave it as it is."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )

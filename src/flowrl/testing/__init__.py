"""Utilities for testing code built on flowrl, and for testing a hub itself.

``run_soak`` drives a multi-process hub with many concurrent clients for a bounded time
and accounts for every sample exactly: see :class:`SoakConfig` and :class:`SoakReport`
(``benchmarks/soak_clients.py`` runs it from the command line).

``abandon`` lets go of an embedded hub as a crash would, to test recovery in one process.
"""

from flowrl._client.inproc import Hub
from flowrl.testing._soak import SOAK_COLUMNS, SOAK_TASKS, SoakConfig, SoakReport, account, run_soak

__all__ = [
    "SOAK_COLUMNS",
    "SOAK_TASKS",
    "SoakConfig",
    "SoakReport",
    "abandon",
    "account",
    "run_soak",
]


def abandon(hub: Hub) -> None:
    """Let go of a journaled embedded hub as its process would by dying (SIGKILL).

    Nothing is flushed or finalised beyond what every call already wrote; the journal's
    and the units' folders are released (the OS does that for a dead process), so a new
    ``flowrl.Hub`` on the same config recovers from them. The abandoned hub refuses every
    call with :class:`~flowrl.errors.HubClosed`.
    """
    if not isinstance(hub, Hub):
        raise TypeError(f"abandon() takes an embedded flowrl.Hub, got {type(hub).__name__}")
    hub._abandon()

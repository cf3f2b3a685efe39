"""What the exporters (``serve_metrics``, the live page) read, and a check they share.

Both poll ``hub.statistics()``, which carries the hub's counters (per task, per column,
the staleness histogram, the newest samples' readiness: ``flowrl._controller.counters``),
and follow no event: watching a hub costs it one statistics call per look.
"""

from __future__ import annotations

from typing import Any, Protocol

from flowrl._config import HubStats
from flowrl.errors import ConfigError

__all__ = ["HubLike", "LoaderLike", "check_port"]


class HubLike(Protocol):
    """What the exporters need of a hub: an embedded ``Hub`` or a ``RemoteHub``."""

    def statistics(self) -> HubStats: ...


class LoaderLike(Protocol):
    """What the exporters read of a ``Loader``."""

    task: str

    def statistics(self) -> Any: ...


def check_port(port: Any, where: str) -> int:
    """A TCP port to listen on (0: any free one), or a ConfigError naming ``where``."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"{where}(port={port!r}): expected an int in [0, 65535]")
    return port

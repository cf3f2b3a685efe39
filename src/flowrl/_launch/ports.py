"""TCP ports for a hub's servers: drawn at random at launch, checked free where they bind."""

from __future__ import annotations

import errno
import random
import socket

__all__ = ["PORTS", "Ports", "is_free"]

#: The servers' TCP ports are drawn from here, at launch: below Linux's ephemeral range
#: (32768-60999), from which outgoing connections take theirs, and above Ray's worker
#: ports (10002-19999), so the port of a dead server stays free for its restart.
PORTS = range(20000, 32768)


class Ports:
    """Draws distinct ports at random from ``PORTS`` for each node's IP address."""

    def __init__(self, ips: dict[str, str]) -> None:
        self.ips = ips
        self.used: dict[str, set[int]] = {}
        self.rng = random.SystemRandom()

    def draw(self, node: str) -> str:
        ip = self.ips[node]
        used = self.used.setdefault(ip, set())
        port = self.rng.choice(PORTS)
        while port in used:
            port = self.rng.choice(PORTS)
        used.add(port)
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def is_free(address: str) -> bool:
    """Whether ``tcp://ip:port`` can be bound (as zmq binds it: with SO_REUSEADDR, so the
    connections of a dead server in TIME_WAIT do not keep its port)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True

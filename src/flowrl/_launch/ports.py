"""TCP ports for a hub's servers: drawn at random at launch, checked free where they bind."""

from __future__ import annotations

import errno
import random
import socket

__all__ = ["PORTS", "Ports", "is_free", "is_listening"]

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


def is_listening(address: str) -> bool:
    """Whether a socket of this machine listens on the port of ``tcp://ip:port``, from
    the kernel's tables (a probe by binding could take the port from a server binding it
    at that moment, and a probe by connecting would count as a stranger)."""
    port = int(address.rpartition(":")[2])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl, local address (hex ip:port), remote, state, ...
            if fields[3] == _LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                return True
    return False


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column

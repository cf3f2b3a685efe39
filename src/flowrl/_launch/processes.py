"""Start a multi-process hub on this machine (controller + storage units) and connect to it."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from flowrl._client.tasks import checked_tasks
from flowrl._config import HubConfig
from flowrl._controller.journal import lock_journal
from flowrl._launch.specs import ControllerSpec, ServerSpec, UnitSpec
from flowrl._schema.columns import Column
from flowrl._store.shm import SHM_PREFIX, shm_folder
from flowrl._transport import wire
from flowrl._transport.remote import RPC_TIMEOUT_S, RemoteHub
from flowrl._validate import check_seconds
from flowrl.errors import ConfigError, TransportError

__all__ = ["as_restarted", "connect", "launch_hub"]

log = logging.getLogger("flowrl.launch")


def launch_hub(
    columns: Iterable[Column] = (),
    *,
    tasks: Mapping[str, Sequence[str]] | None = None,
    config: HubConfig | None = None,
    startup_timeout: float = 30.0,
) -> RemoteHub:
    """Start the controller and ``config.n_units`` storage units as processes.

    They listen on ipc sockets in a private temporary folder (nothing leaves the machine).
    Returns a client; its ``address`` lets other processes ``flowrl.connect`` to the same
    hub. Closing that client shuts the servers down.
    """
    cols, config = checked_args(columns, config)
    checked = checked_tasks(tasks, cols, config)
    if check_seconds(startup_timeout, "launch_hub() startup_timeout", allow_zero=False) is None:
        raise ConfigError("launch_hub() startup_timeout must be a number of seconds > 0, got None")
    if config.journal is not None:
        # Refuse a journal another process holds here, naming it (the controller process
        # would fail on it just the same, but its error stays in that process).
        lock_journal(config.journal).release()
    folder = tempfile.mkdtemp(prefix="flowrl-")
    addr = f"ipc://{folder}/controller"
    units = [f"ipc://{folder}/unit{u}" for u in range(config.n_units)]
    controls = [f"ipc://{folder}/unit{u}-ctl" for u in range(config.n_units)]
    arenas = [shm_folder(_arena_name(folder, str(u))) for u in range(config.n_units)]
    specs: list[ControllerSpec | UnitSpec] = [
        UnitSpec(u, config.capacity, units[u], controls[u], config.journal, arenas[u])
        for u in range(config.n_units)
    ]
    specs.append(
        ControllerSpec(
            addr,
            f"ipc://{folder}/events",
            units,
            controls,
            cols,
            {t: list(c) for t, c in checked.items()},
            config,
        )
    )
    servers = _Servers(specs)
    deadline = time.monotonic() + startup_timeout
    while not os.path.exists(f"{folder}/controller"):
        exits = [(s, p.poll()) for s, p in zip(specs, servers.procs, strict=True)]
        dead = [(s, code) for s, code in exits if code is not None]
        if time.monotonic() > deadline or dead:
            _stop(servers, folder, units)
            why = (
                f"none listened within {startup_timeout}s"
                if not dead
                else ", ".join(f"{_name(s)} exited with code {code}" for s, code in dead)
            )
            raise TransportError(
                f"the hub's server processes failed to start ({why}); their errors are on "
                "this process's stderr"
            )
        time.sleep(0.002)
    try:
        client = RemoteHub(addr, rpc_timeout=startup_timeout)
    except Exception:
        _stop(servers, folder, units)
        raise
    client.rpc_timeout = RPC_TIMEOUT_S
    client._on_close.append(lambda: _stop(servers, folder, [addr, *units]))
    client.servers = servers
    servers.supervise(restart=config.journal is not None)
    return client


def connect(address: str, *, unit_nodes: Sequence[str] = (), node: str = "") -> RemoteHub:
    """A client of a hub that ``launch_hub`` or ``launch_ray_hub`` started (pass its
    ``.address``). ``unit_nodes`` (the hub's ``.unit_nodes``) and ``node`` (this process's
    Ray node id) make new samples go to a storage unit on this node: see ``RemoteHub``."""
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(f"connect() expects a zmq address like 'ipc://...', got {address!r}")
    return RemoteHub(address, unit_nodes=unit_nodes, node=node)


def checked_args(
    columns: Iterable[Column], config: HubConfig | None
) -> tuple[list[Column], HubConfig]:
    """The columns and config of a hub to launch, checked (a default config if None)."""
    config = HubConfig() if config is None else config
    if not isinstance(config, HubConfig):
        raise ConfigError(f"config must be a HubConfig, got {type(config).__name__}")
    cols = list(columns)
    for col in cols:
        if not isinstance(col, Column):
            raise ConfigError(f"columns must be flowrl.Column, got {type(col).__name__}")
    return cols, config


class _Servers:
    """The hub's server processes, restarted when one dies if the hub is journaled.

    A restarted controller recovers from the journal and keeps the leases of clients that
    are still alive; a restarted storage unit reloads its Arrow files. Clients reconnect
    by themselves (same ipc addresses); a request in flight when a server died fails with a
    typed error instead of vanishing. A dead storage unit's shared-memory arena is removed
    at once (a unit killed by SIGKILL could not), restarted or not.
    """

    def __init__(self, specs: list[ControllerSpec | UnitSpec]) -> None:
        self.specs = specs
        self.procs = [self._spawn(s) for s in specs]
        self.restarts = 0
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self._mourned: set[int] = set()  # dead servers not restarted, their arena removed

    @staticmethod
    def _spawn(spec: ControllerSpec | UnitSpec) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowrl._launch.serve",
                msgspec.json.encode(spec).decode(),
                str(os.getpid()),
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # servers log to stderr; never hold the caller's stdout
        )

    def supervise(self, *, restart: bool, interval: float = 0.05) -> None:
        self._watch = threading.Thread(
            target=self._watch_dead,
            args=(restart, interval),
            name="flowrl-supervisor",
            daemon=True,
        )
        self._watch.start()

    def _watch_dead(self, restart: bool, interval: float) -> None:
        while not self._stopping.wait(interval):
            for i, proc in enumerate(self.procs):
                if proc.poll() is None or i in self._mourned or self._stopping.is_set():
                    continue
                spec = self.specs[i]
                log.warning(
                    "hub server %s (%s) exited with %s; %s",
                    type(spec).__name__,
                    spec.address,
                    proc.returncode,
                    "restarting it" if restart else "it stays down (the hub has no journal)",
                )
                arena = getattr(spec, "shm_folder", None)
                if arena is not None:
                    shutil.rmtree(arena, ignore_errors=True)
                if restart:
                    self.procs[i] = self._spawn(as_restarted(spec))
                    self.restarts += 1
                else:
                    self._mourned.add(i)

    def stop_supervising(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.join(timeout=5)


def as_restarted(spec: ServerSpec) -> ServerSpec:
    """The spec a dead server is restarted with (by ``launch_hub``'s supervisor, or by Ray
    for ``launch_ray_hub``): a restarted controller recovers from the journal keeping the
    leases of the clients, which are still alive; a storage unit's spec does not change."""
    if isinstance(spec, ControllerSpec):
        return msgspec.structs.replace(spec, restarted=True)
    return spec


def _stop(servers: _Servers, folder: str, addresses: list[str]) -> None:
    """Ask every server to shut down (acknowledged requests), then reap; kill stragglers."""
    servers.stop_supervising()
    if not request_shutdown(addresses):
        for p in servers.procs:  # (this process is out of sockets: signal them instead)
            p.terminate()
    for p in servers.procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(folder, ignore_errors=True)
    for arena in glob.glob(SHM_PREFIX + _arena_name(folder, "*")):
        shutil.rmtree(arena, ignore_errors=True)  # a unit killed before it could


def _name(spec: ServerSpec) -> str:
    return "the controller" if isinstance(spec, ControllerSpec) else f"storage unit {spec.unit_id}"


def _arena_name(folder: str, unit: str) -> str:
    """The shared-memory arena of storage unit ``unit`` of the hub in ``folder``."""
    return f"{os.path.basename(folder).removeprefix('flowrl-')}-unit{unit}"


def request_shutdown(addresses: Sequence[str]) -> bool:
    """Ask the servers at ``addresses`` to leave their loops; wait (2 s at most, for all of
    them together) for their acknowledgements. A server that is gone already just does not
    answer. False if this process could not open a socket to ask them all."""
    import zmq

    zctx: zmq.Context = zmq.Context.instance()
    socks = []
    try:
        for addr in addresses:
            s = zctx.socket(zmq.DEALER)
            socks.append(s)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            s.send_multipart([b"shutdown", wire.encode(wire.Shutdown())])
    except zmq.ZMQError as exc:
        log.warning("could not ask the hub's servers to shut down: %s", exc)
        for s in socks:
            s.close()
        return False
    deadline = time.monotonic() + 2.0
    for s in socks:
        # the reply means the server left its loop
        s.poll(max(0, int((deadline - time.monotonic()) * 1000)))
        s.close()
    return True

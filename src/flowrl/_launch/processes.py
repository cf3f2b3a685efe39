"""Start a multi-process hub on this machine (controller + storage units) and connect to it."""

from __future__ import annotations

import contextlib
import functools
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
from flowrl._launch.ports import Ports, is_free, is_listening
from flowrl._launch.specs import ControllerSpec, ServerSpec, UnitSpec
from flowrl._schema.columns import Column
from flowrl._store.shm import SHM_PREFIX, shm_folder
from flowrl._transport import wire
from flowrl._transport.auth import (
    KEY_ENV,
    KEY_FILE_ENV,
    HubKey,
    client_options,
    is_local,
    require_key,
)
from flowrl._transport.remote import RPC_TIMEOUT_S, RemoteHub
from flowrl._validate import check_seconds
from flowrl.errors import ConfigError, TransportError

__all__ = ["as_restarted", "connect", "launch_hub", "request_shutdown", "start_hub"]

log = logging.getLogger("flowrl.launch")


def launch_hub(
    columns: Iterable[Column] = (),
    *,
    tasks: Mapping[str, Sequence[str]] | None = None,
    config: HubConfig | None = None,
    startup_timeout: float = 30.0,
    host: str | None = None,
) -> RemoteHub:
    """Start the controller and ``config.n_units`` storage units as processes.

    By default they listen on ipc sockets in a private temporary folder (mode 0700):
    nothing leaves the machine, and only this user's processes may connect. With
    ``host`` (an IP address of this machine, the one other machines reach it at) they
    listen on TCP ports of it instead, and admit only holders of the hub's key, made
    here: ``hub.key`` (see docs/durability.md, "Security").
    Returns a client; its ``address`` lets other processes ``flowrl.connect`` to the same
    hub. Closing that client shuts the servers down.
    """
    if host is not None and (not isinstance(host, str) or not host or "/" in host):
        raise ConfigError(f"launch_hub() host must be an IP address of this machine, got {host!r}")
    return start_hub(
        columns,
        tasks=tasks,
        config=config,
        startup_timeout=startup_timeout,
        host=host,
        key=None if host is None else HubKey.generate(),
    )


def start_hub(
    columns: Iterable[Column],
    *,
    tasks: Mapping[str, Sequence[str]] | None,
    config: HubConfig | None,
    startup_timeout: float,
    host: str | None,
    key: HubKey | None,
) -> RemoteHub:
    """``launch_hub``, its key given: ``host`` with no ``key`` starts TCP servers that
    take any peer, which only a benchmark measuring the key's cost asks for."""
    cols, config = checked_args(columns, config)
    checked = checked_tasks(tasks, cols, config)
    if check_seconds(startup_timeout, "launch_hub() startup_timeout", allow_zero=False) is None:
        raise ConfigError("launch_hub() startup_timeout must be a number of seconds > 0, got None")
    if config.journal is not None:
        # Refuse a journal another process holds here, naming it (the controller process
        # would fail on it just the same, but its error stays in that process).
        lock_journal(config.journal).release()
    folder = tempfile.mkdtemp(prefix="flowrl-")  # (mode 0700: the ipc sockets' gate)
    if host is None:
        endpoint = functools.partial("ipc://{}/{}".format, folder)
    else:
        ports = Ports({"": host})
        endpoint = functools.partial(_free_port, ports)
    addr = endpoint("controller")
    units = [endpoint(f"unit{u}") for u in range(config.n_units)]
    controls = [endpoint(f"unit{u}-ctl") for u in range(config.n_units)]
    arenas = [shm_folder(_arena_name(folder, str(u))) for u in range(config.n_units)]
    text = None if key is None else key.export()
    specs: list[ControllerSpec | UnitSpec] = [
        UnitSpec(u, config.capacity, units[u], controls[u], config.journal, arenas[u], text)
        for u in range(config.n_units)
    ]
    specs.append(
        ControllerSpec(
            addr,
            endpoint("events"),
            units,
            controls,
            cols,
            {t: list(c) for t, c in checked.items()},
            config,
            key=text,
        )
    )
    servers = _Servers(specs)
    stop = functools.partial(_stop, servers, folder, [addr], units, key)
    deadline = time.monotonic() + startup_timeout
    while not _listening(addr):
        exits = [(s, p.poll()) for s, p in zip(specs, servers.procs, strict=True)]
        dead = [(s, code) for s, code in exits if code is not None]
        if time.monotonic() > deadline or dead:
            stop()
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
        client = RemoteHub(addr, rpc_timeout=startup_timeout, key=key)
    except Exception:
        stop()
        raise
    client.rpc_timeout = RPC_TIMEOUT_S
    client._on_close.append(stop)
    client.servers = servers
    servers.supervise(restart=config.journal is not None)
    return client


def connect(
    address: str,
    *,
    unit_nodes: Sequence[str] = (),
    node: str = "",
    key: HubKey | str | None = None,
) -> RemoteHub:
    """A client of a hub that ``launch_hub`` or ``launch_ray_hub`` started (pass its
    ``.address``). ``unit_nodes`` (the hub's ``.unit_nodes``) and ``node`` (this process's
    Ray node id) make new samples go to a storage unit on this node: see ``RemoteHub``.

    A hub on TCP admits only holders of its key: ``key`` (the launcher's ``hub.key`` or
    its ``export()`` text), else the ``FLOWRL_HUB_KEY`` environment variable (the text), else
    ``FLOWRL_HUB_KEY_FILE`` (a 0600 file from ``hub.key.save``), else, in a process of the
    Ray cluster that launched it, the key the hub's controller actor holds."""
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(f"connect() expects a zmq address like 'ipc://...', got {address!r}")
    found = _key_for(address, key)
    require_key(address, found)
    return RemoteHub(address, unit_nodes=unit_nodes, node=node, key=found)


def _key_for(address: str, key: HubKey | str | None) -> HubKey | None:
    """The key to connect to ``address`` with (None: none found, or none needed)."""
    if is_local(address):
        return None
    if key is not None:
        return HubKey.parse(key, "connect() key")
    text = os.environ.get(KEY_ENV)
    if text:
        return HubKey.parse(text, KEY_ENV)
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        return HubKey.load(path)
    if "ray" in sys.modules:  # (a stage worker of a Ray-placed hub)
        from flowrl._launch.ray_hub import key_on_ray

        return key_on_ray(address)
    return None


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
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowrl._launch.serve", str(os.getpid())],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.PIPE,  # the spec (it may hold the key: never on the command line)
            stdout=subprocess.DEVNULL,  # servers log to stderr; never hold the caller's stdout
        )
        assert proc.stdin is not None  # (stdin=PIPE)
        # (BrokenPipeError: it died at once; the launcher or the supervisor reports its exit)
        with contextlib.suppress(BrokenPipeError), proc.stdin:
            proc.stdin.write(msgspec.json.encode(spec))
        return proc

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


def _stop(
    servers: _Servers, folder: str, controller: list[str], units: list[str], key: HubKey | None
) -> None:
    """Ask every server to shut down (acknowledged requests), then reap; kill stragglers."""
    servers.stop_supervising()
    if not request_shutdown(controller, key, units=units):
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


def _free_port(ports: Ports, name: str) -> str:
    """A TCP address on the hub's host whose port is free now (``name``: which server)."""
    for _ in range(100):
        address = ports.draw("")
        if is_free(address):
            return address
    raise TransportError(f"found no free TCP port for the hub's {name} on {ports.ips['']}")


def _listening(address: str) -> bool:
    """Whether the server at ``address`` (of this machine) has bound it."""
    if address.startswith("ipc://"):
        return os.path.exists(address.removeprefix("ipc://"))
    return is_listening(address)


def _name(spec: ServerSpec) -> str:
    return "the controller" if isinstance(spec, ControllerSpec) else f"storage unit {spec.unit_id}"


def _arena_name(folder: str, unit: str) -> str:
    """The shared-memory arena of storage unit ``unit`` of the hub in ``folder``."""
    return f"{os.path.basename(folder).removeprefix('flowrl-')}-unit{unit}"


def request_shutdown(
    addresses: Sequence[str], key: HubKey | None = None, *, units: Sequence[str] = ()
) -> bool:
    """Ask the servers at ``addresses`` (controllers) and ``units`` (storage units' data
    sockets) to leave their loops; wait (2 s at most, for all of them together) for their
    acknowledgements. A server that is gone already just does not answer. False if this
    process could not open a socket to ask them all."""
    import zmq

    zctx: zmq.Context = zmq.Context.instance()
    socks = []
    try:
        for addr, data in [*((a, False) for a in addresses), *((u, True) for u in units)]:
            s = zctx.socket(zmq.DEALER)
            socks.append(s)
            s.setsockopt(zmq.LINGER, 0)
            client_options(s, addr, key, data=data)
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

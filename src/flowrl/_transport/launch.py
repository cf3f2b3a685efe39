"""Start a multi-process hub on this machine (controller + storage units) and connect to it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

import msgspec

from flowrl._client.config import HubConfig
from flowrl._schema.columns import Column
from flowrl._transport import wire
from flowrl._transport.remote import RPC_TIMEOUT_S, RemoteHub
from flowrl._transport.specs import ControllerSpec, UnitSpec
from flowrl.errors import ConfigError, TransportError

__all__ = ["connect", "launch_hub"]


def launch_hub(
    columns: Iterable[Column] = (),
    *,
    tasks: dict[str, Sequence[str]] | None = None,
    config: HubConfig | None = None,
    startup_timeout: float = 30.0,
) -> RemoteHub:
    """Start the controller and ``config.n_units`` storage units as processes.

    They listen on ipc sockets in a private temporary folder (nothing leaves the machine).
    Returns a client; its ``address`` lets other processes ``flowrl.connect`` to the same
    hub. Closing that client shuts the servers down.
    """
    config = config or HubConfig()
    if not isinstance(config, HubConfig):
        raise ConfigError(f"config must be a HubConfig, got {type(config).__name__}")
    cols = list(columns)
    for col in cols:
        if not isinstance(col, Column):
            raise ConfigError(f"columns must be flowrl.Column, got {type(col).__name__}")
    folder = tempfile.mkdtemp(prefix="flowrl-")
    addr = f"ipc://{folder}/controller"
    units = [f"ipc://{folder}/unit{u}" for u in range(config.n_units)]
    controls = [f"ipc://{folder}/unit{u}-ctl" for u in range(config.n_units)]
    specs: list[ControllerSpec | UnitSpec] = [
        UnitSpec(u, config.capacity, units[u], controls[u]) for u in range(config.n_units)
    ]
    specs.append(
        ControllerSpec(
            addr,
            f"ipc://{folder}/events",
            units,
            controls,
            cols,
            {t: list(c) for t, c in (tasks or {}).items()},
            config,
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowrl._transport.serve",
                msgspec.json.encode(s).decode(),
                str(os.getpid()),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # servers log to stderr; never hold the caller's stdout
        )
        for s in specs
    ]
    deadline = time.monotonic() + startup_timeout
    while not os.path.exists(f"{folder}/controller"):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _stop(procs, folder, units)
            raise TransportError("the hub's server processes failed to start")
        time.sleep(0.002)
    try:
        client = RemoteHub(addr, rpc_timeout=startup_timeout)
    except Exception:
        _stop(procs, folder, units)
        raise
    client.rpc_timeout = RPC_TIMEOUT_S
    client._on_close.append(lambda: _stop(procs, folder, [addr, *units]))
    return client


def connect(address: str) -> RemoteHub:
    """A client of a hub that ``launch_hub`` started (pass its ``.address``)."""
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(f"connect() expects a zmq address like 'ipc://...', got {address!r}")
    return RemoteHub(address)


def _stop(procs: list[subprocess.Popen], folder: str, addresses: list[str]) -> None:
    """Ask every server to shut down (acknowledged requests), then reap; kill stragglers."""
    import zmq

    zctx: zmq.Context = zmq.Context.instance()
    socks = []
    for addr in addresses:
        s = zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        s.send_multipart([b"shutdown", wire.encode(wire.Shutdown())])
        socks.append(s)
    for s in socks:
        s.poll(2000)  # the reply means the server left its loop
        s.close()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(folder, ignore_errors=True)

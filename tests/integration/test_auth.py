"""Authenticated hub sockets (issue 26, item 4): a hub on TCP admits only holders of its
key. A peer without it (a plain zmq socket, as any process on the network could open)
changes nothing, not even with Declare or Shutdown, and is counted; a client with the
key works; an ipc hub's sockets live in a folder only its user may enter."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import flowrl
from flowrl import Column, HubConfig
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl._transport.auth import KEY_ENV, KEY_FILE_ENV, HubKey
from flowrl.errors import ConfigError

pytestmark = pytest.mark.integration

WAIT_S = 30.0  # how long a refusal may take to be counted before the test fails
COLUMNS = [Column.scalar("x", "int64")]


@pytest.fixture
def hub() -> Iterator[Any]:
    h = flowrl.launch_hub(
        COLUMNS,
        tasks={"train": ["x"]},
        config=HubConfig(capacity=256, n_units=1),
        host="127.0.0.1",
    )
    yield h
    h.close()


def wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def raw_socket(kind: int, address: str, **options: Any) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        setattr(sock, name, value)
    sock.connect(address)
    return sock


def test_a_peer_without_the_key_changes_nothing_and_is_counted(hub: Any) -> None:
    hub.put({"x": np.arange(3)})
    before = hub.statistics()
    assert before.refused_peers == 0 and before.units[0].refused_peers == 0
    declare = wire.encode(commands.Declare(columns=[Column.scalar("planted", "int64")]))
    shutdown = wire.encode(wire.Shutdown())
    socks = [
        raw_socket(zmq.DEALER, hub.address),
        raw_socket(zmq.DEALER, hub.unit_addresses[0]),
        raw_socket(zmq.PUSH, hub.unit_addresses[0] + "-ctl"),
        raw_socket(zmq.SUB, hub.events_address, subscribe=b""),
    ]
    try:
        socks[0].send_multipart([b"1" * 8, declare])
        socks[0].send_multipart([b"2" * 8, shutdown])
        socks[1].send_multipart([b"3" * 8, shutdown])
        socks[2].send(shutdown)
        assert wait_for(lambda: hub.statistics().refused_peers >= 2)  # its ROUTER and PUB
        assert wait_for(lambda: hub.statistics().units[0].refused_peers >= 2)  # data, control
        assert not socks[0].poll(100) and not socks[1].poll(100)  # nothing answered them
    finally:
        for sock in socks:
            sock.close()
    # The hub serves on, unchanged: nothing was declared, shut down or put.
    assert hub.statistics().live == before.live
    other = flowrl.connect(hub.address, key=hub.key)
    try:
        assert "planted" not in other.schema
        meta = other.claim("train", 3, timeout=10)
        assert other.get(meta)["x"].tolist() == [0, 1, 2]
        other.ack(meta)
    finally:
        other.close()


def test_a_peer_with_another_key_is_refused(hub: Any) -> None:
    """Knowing the server's public key is not enough: the ZAP handler admits only the
    hub's client key (and, on a unit's data socket, only the hub's token)."""
    key: HubKey = hub.key
    other = HubKey(key.server_secret, zmq.curve_keypair()[1])
    curve = raw_socket(
        zmq.DEALER,
        hub.address,
        curve_serverkey=key.server_public,
        curve_publickey=other.client_public,
        curve_secretkey=other.client_secret,
    )
    plain = raw_socket(
        zmq.DEALER,
        hub.unit_addresses[0],
        plain_username=b"flowrl",
        plain_password=other.token,
    )
    try:
        curve.send_multipart([b"1" * 8, wire.encode(wire.Shutdown())])
        plain.send_multipart([b"2" * 8, wire.encode(wire.Shutdown())])
        assert wait_for(lambda: hub.statistics().refused_peers >= 1)
        assert wait_for(lambda: hub.statistics().units[0].refused_peers >= 1)
        assert not curve.poll(100) and not plain.poll(100)
    finally:
        curve.close()
        plain.close()
    hub.put({"x": np.arange(2)})  # still serving
    assert hub.statistics().live == 2


def test_a_client_finds_the_key_in_its_argument_environment_or_file(
    hub: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="admits only holders of its key"):
        flowrl.connect(hub.address)
    monkeypatch.setenv(KEY_ENV, hub.key.export())
    with flowrl.connect(hub.address) as by_env:
        by_env.put({"x": np.arange(1)})
    monkeypatch.delenv(KEY_ENV)
    path = str(tmp_path / "hub.key")
    hub.key.save(path)
    monkeypatch.setenv(KEY_FILE_ENV, path)
    with flowrl.connect(hub.address) as by_file:
        by_file.put({"x": np.arange(1)})
    with flowrl.connect(hub.address, key=hub.key.export()) as by_text:
        assert by_text.statistics().live == 2
    assert hub.statistics().refused_peers == 0  # every one of them got in at once


def test_an_ipc_hub_listens_in_a_folder_only_its_user_may_enter() -> None:
    with flowrl.launch_hub(COLUMNS) as hub:
        folder = os.path.dirname(hub.address.removeprefix("ipc://"))
        info = os.stat(folder)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert all(a.startswith(f"ipc://{folder}/") for a in hub.unit_addresses)
        assert hub.key is None  # (the folder is the gate: no key, no cost)

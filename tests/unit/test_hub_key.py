"""The hub key and the private folders of ipc sockets (issue 26, item 4): a key prints no
secret and round-trips through its text and a 0600 file; a key file or a socket folder
that other users may touch is refused with a typed error; the TransferQueue key
directory on TCP admits only holders of the key, counting the peers it refuses."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from flowrl._transport.auth import HubKey, check_private, listen
from flowrl.compat.transfer_queue._directory import (
    _ENC,
    DirectoryServer,
    KeyDirectory,
    RemoteDirectory,
    _Call,
)
from flowrl.errors import ConfigError

WAIT_S = 30.0  # how long a refusal may take to be counted before the test fails


def wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_key_round_trips_through_its_text_and_never_prints_a_secret() -> None:
    key = HubKey.generate()
    assert HubKey.parse(key.export()) == key
    assert HubKey.parse(key.export()) != HubKey.generate()
    shown = repr(key) + str(key) + str([key])
    for secret in (key.server_secret, key.client_secret, key.token):
        assert secret.decode() not in shown
    assert key.token != key.client_secret  # (PLAIN shows the token, never the CURVE key)


@pytest.mark.parametrize("text", ["", "flowrl-hub-key-1:short", "x" * 97, 12, None])
def test_a_malformed_key_is_refused_with_a_typed_error(text: object) -> None:
    with pytest.raises(ConfigError, match="hub key"):
        HubKey.parse(text)


def test_a_saved_key_file_is_0600_created_once_and_loads_back(tmp_path: Path) -> None:
    key = HubKey.generate()
    path = str(tmp_path / "hub.key")
    key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert HubKey.load(path) == key
    with pytest.raises(ConfigError, match="exists already"):
        HubKey.generate().save(path)  # never overwrites (nor follows a planted link)
    assert HubKey.load(path) == key


def test_a_key_file_others_may_read_or_a_link_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hub.key"
    HubKey.generate().save(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=r"open to other users.*chmod 600"):
        HubKey.load(str(path))
    os.chmod(path, 0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="cannot read hub key file"):
        HubKey.load(str(link))


def test_ipc_sockets_bind_only_in_a_folder_only_this_user_may_enter(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)  # (whatever the umask)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        with pytest.raises(ConfigError, match=r"only this user may enter.*drwxr-xr-x"):
            listen(sock, f"ipc://{loose}/controller", None)
        assert not (loose / "controller").exists()  # nothing bound
        with pytest.raises(ConfigError, match="only this user may enter"):
            DirectoryServer(KeyDirectory(), f"ipc://{loose}/directory")
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        check_private(str(private))
        assert listen(sock, f"ipc://{private}/controller", None).startswith("ipc://")
    finally:
        sock.close(linger=0)


def test_the_key_directory_on_tcp_admits_only_holders_of_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flowrl")
    key = HubKey.generate()
    server = DirectoryServer(KeyDirectory(), "tcp://127.0.0.1:0", key=key)
    raw = zmq.Context.instance().socket(zmq.DEALER)  # no key: what any process could do
    raw.setsockopt(zmq.LINGER, 0)
    try:
        assert server.address.startswith("tcp://127.0.0.1:")
        raw.connect(server.address)
        raw.send(_ENC.encode(_Call("bind", ["p", ["k"], [0]])))
        assert wait_for(lambda: server.refused_peers >= 1)
        assert not raw.poll(200)  # no answer: the request never reached the server
        with pytest.raises(ConfigError, match="admits only holders of its key"):
            RemoteDirectory(server.address)
        assert client_lookup(server.address, key) == [-1, -1]  # the keyless bind did nothing
        client = RemoteDirectory(server.address, key)
        assert client.bind("p", ["k"], [7]) == [7]
        client.close()
        # another hub's key; the server's public key with another client key (ZAP refuses)
        other_client = HubKey(key.server_secret, zmq.curve_keypair()[1])
        for wrong in (HubKey.generate(), other_client):
            impostor = RemoteDirectory(server.address, wrong)
            refused = server.refused_peers
            impostor._sock.send(_ENC.encode(_Call("bind", ["p", ["k2"], [1]])))
            assert wait_for(lambda: server.refused_peers > refused)  # noqa: B023
            assert not impostor._sock.poll(200)
            impostor.close()
        assert client_lookup(server.address, key) == [7, -1]
        # each refusal logged in one line at most (1st, 2nd, 4th, ...), no traceback
        records = [r for r in caplog.records if r.name.startswith("flowrl")]
        assert records and all("refused a peer" in r.getMessage() for r in records)
        assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
        assert len(records) <= server.refused_peers.bit_length()
    finally:
        raw.close()
        server.close()


def client_lookup(address: str, key: HubKey) -> list[int]:
    client = RemoteDirectory(address, key)
    try:
        return client.lookup("p", ["k", "k2"])
    finally:
        client.close()

"""Malformed frames and over-sized requests at a multi-process hub's servers (issue 26,
item 7): each is answered with a typed error, logged in one line (no traceback), and
changes nothing.

A fuzz run used to log full tracebacks for strings that are not UTF-8 (msgspec raises
UnicodeDecodeError) and for deeply nested msgpack (RecursionError), and a
``Reserve(ahead=2**63-1)`` took almost every free slot of the hub.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import flowrl
from flowrl import Column, HubConfig
from flowrl._launch.processes import request_shutdown
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl._transport.controller_server import ControllerServer
from flowrl._transport.unit_server import UnitServer

pytestmark = pytest.mark.integration

GUARD_MS = 10_000  # how long a reply may take before the test fails instead of hanging
CAPACITY = 1024
_rids = itertools.count(1)

#: msgpack of {"op": <tag>, <field>: <value>} with a string value that is not UTF-8
NOT_UTF8 = {
    "controller": b"\x82\xa2op\xa5claim\xa4task\xa3\xff\xfe\xfd",
    "unit": b"\x83\xa2op\xa4read\xa7indices\xc4\x00\xa7columns\x91\xa3\xff\xfe\xfd",
}
#: msgpack of {"x": [[[...]]], "op": "hello"}: nested deeper than Python's stack
TOO_DEEP = b"\x82\xa1x" + b"\x91" * 100_000 + b"\xc0" + b"\xa2op\xa5hello"


@pytest.fixture
def hub() -> Iterator[Any]:
    """A hub whose controller and storage unit serve in threads of this process, so that
    ``caplog`` sees what they log; a client of it."""
    folder = tempfile.mkdtemp(prefix="flowrl-")
    address, unit, unit_control = (f"ipc://{folder}/{n}" for n in ("ctl", "unit", "unit-ctl"))
    servers = [
        UnitServer(0, CAPACITY, unit, unit_control),
        ControllerServer(
            address,
            f"ipc://{folder}/events",
            [unit],
            [unit_control],
            [Column.scalar("x", "int64")],
            {"train": ["x"]},
            HubConfig(capacity=CAPACITY, n_units=1),
        ),
    ]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    hub = flowrl.connect(address)
    hub.put({"x": np.arange(4)})
    yield hub
    hub.close()
    request_shutdown([address, unit])
    for t in threads:
        t.join(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)


def ask(address: str, body: bytes) -> Any:
    """Send one request on a fresh socket; its decoded reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        rid = next(_rids).to_bytes(8, "little")
        sock.send_multipart([rid, body])
        assert sock.poll(GUARD_MS), "the server did not answer"
        got_rid, reply, *_ = sock.recv_multipart()
        assert got_rid == rid
        return wire.decode_reply(reply)
    finally:
        sock.close()


def address_of(hub: Any, server: str) -> str:
    return hub.address if server == "controller" else hub.unit_addresses[0]


@pytest.mark.parametrize("server", ["controller", "unit"])
@pytest.mark.parametrize("frame", ["not utf-8", "too deep"])
def test_a_malformed_frame_gets_a_typed_error_and_one_log_line(
    hub: Any, server: str, frame: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = hub.statistics()
    caplog.set_level(logging.WARNING, logger="flowrl")
    body = NOT_UTF8[server] if frame == "not utf-8" else TOO_DEEP
    reply = ask(address_of(hub, server), body)
    assert isinstance(reply, wire.Error) and reply.type == "TransportError", reply
    assert "malformed" in reply.message
    records = [r for r in caplog.records if r.name.startswith("flowrl.")]
    assert [r.getMessage().count("\n") for r in records] == [0], caplog.text  # one line
    assert "refused a request" in records[0].getMessage()
    assert records[0].exc_info is None, "a traceback was logged"
    assert hub.statistics() == before


def test_reserving_far_ahead_is_refused_and_takes_no_slot(hub: Any) -> None:
    before = hub.statistics()
    body = wire.encode(commands.Reserve(n=1, ahead=2**63 - 1))
    reply = ask(hub.address, body)
    assert isinstance(reply, wire.Error) and reply.type == "ConfigError", reply
    assert "ahead" in reply.message
    assert hub.statistics() == before
    assert hub.put({"x": np.array([9])}).size == 1  # every slot but the live ones is free

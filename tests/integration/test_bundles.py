"""Bundles: a server working through a backlog sends each peer one message for several
(a storage unit's handed-on commits to the controller, the controller's answers to a
producer); a client takes each answer in a bundle as if it had come alone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

import flowrl
from flowrl import Column, HubConfig
from flowrl._transport import wire
from flowrl._transport.bundles import BUNDLE
from flowrl._transport.session import Session
from flowrl.errors import ConfigError

pytestmark = pytest.mark.integration

GUARD_MS = 10_000  # how long a reply may take before the test fails instead of hanging


@pytest.fixture
def hub() -> Iterator[Any]:
    hub = flowrl.launch_hub(
        [Column.ragged("ids", "int64"), Column.scalar("score", "int64")],
        tasks={"train": ["ids"], "scored": ["ids", "score"]},
        config=HubConfig(capacity=4096, lease_timeout=30.0),
    )
    yield hub
    hub.close()


def _rid(k: int) -> bytes:
    return k.to_bytes(8, "little")


def test_the_controller_answers_a_bundle_with_one(hub: Any) -> None:
    """Requests sent as one bundle are each handled; their answers come back as one
    bundle, in order: a malformed one is answered with its error, a trailing odd frame
    (no request) is skipped."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.address)
    try:
        ping = wire.encode(wire.Ping(rid=b""))
        sock.send_multipart(
            [BUNDLE, _rid(1), ping, _rid(2), b"\xc1not msgpack", _rid(3), ping, _rid(4)]
        )
        assert sock.poll(GUARD_MS), "the controller did not answer"
        frames = sock.recv_multipart()
        assert frames[0] == BUNDLE and frames[1::2] == [_rid(1), _rid(2), _rid(3)]
        replies = [wire.decode_reply(body) for body in frames[2::2]]
        assert [type(r) for r in replies] == [wire.Pong, wire.Error, wire.Pong]
        assert "malformed" in replies[1].message
        assert sock.poll(200) == 0  # nothing else: the odd frame was no request
    finally:
        sock.close()


def test_a_unit_backlog_of_puts_is_handed_on_and_answered_in_bundles(hub: Any) -> None:
    """put_async to claimed samples queued at a stopped storage unit: once it runs again,
    it hands their commits on in bundles and the controller answers in bundles; every
    put lands once, with its own values."""
    taken: list[int] = []
    session = hub._session
    take_bundle = session._take_bundle

    def counting(frames: list[Any], rids: tuple[bytes, ...]) -> Any:
        taken.append(len(frames) // 2)
        return take_bundle(frames, rids)

    session._take_bundle = counting
    n = 24
    hub.put({"ids": [np.arange(k % 5 + 1) for k in range(8 * n)]})
    metas = [hub.claim("train", 8, timeout=10) for _ in range(n)]
    unit = int(hub.servers.procs[0].pid)
    os.kill(unit, signal.SIGSTOP)
    try:  # (puts to claimed samples reserve nothing: none waits for the unit)
        futures = [
            hub.put_async({"score": np.full(8, k)}, indices=meta) for k, meta in enumerate(metas)
        ]
        time.sleep(0.2)  # (all queued at the unit)
    finally:
        os.kill(unit, signal.SIGCONT)
    hub.flush(timeout=30)
    assert taken and max(taken) > 1, taken
    for meta, fut in zip(metas, futures, strict=True):
        assert fut.result(timeout=0).tolist() == meta.indices.tolist()
    scored = hub.claim("scored", 8 * n, timeout=10)
    expected = {i: k for k, meta in enumerate(metas) for i in meta.indices.tolist()}
    got = hub.get(scored)
    assert dict(zip(scored.indices.tolist(), got["score"].tolist(), strict=True)) == expected
    assert [np.asarray(a).size for a in got["ids"]] == [i % 5 + 1 for i in scored.indices]
    hub.ack(scored)


@pytest.fixture
def peer() -> Iterator[tuple[zmq.Socket, Session]]:
    """A ROUTER standing in for the controller, and a session talking to it."""
    router: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    session = Session(f"tcp://127.0.0.1:{port}", rpc_timeout=10.0)
    yield router, session
    session.close()
    router.close()


def _requests(router: zmq.Socket, n: int) -> tuple[bytes, list[bytes]]:
    """The sender and request ids of the next ``n`` requests."""
    rids = []
    for _ in range(n):
        assert router.poll(GUARD_MS)
        ident, rid, _ = router.recv_multipart()
        rids.append(rid)
    return ident, rids


def test_a_client_takes_each_answer_of_a_bundle(peer: tuple[zmq.Socket, Session]) -> None:
    """The answer waited for is returned; answers to no request waited for go to the
    put_async bookkeeping (``on_stray``); one to another request the thread waits for
    (a parked claim's and its ping's) is kept for its wait; an error raises after the
    others were taken."""
    router, session = peer
    strays: list[tuple[bytes, Any]] = []
    session.on_stray = lambda rid, reply: strays.append((rid, reply))
    pong = wire.encode(wire.Pong(parked=True))
    first, second = (session.send(None, wire.Ping(rid=b"")) for _ in range(2))
    ident, rids = _requests(router, 2)
    assert rids == [first, second]
    router.send_multipart([ident, BUNDLE, _rid(999), wire.encode(wire.Done()), second, pong])
    router.send_multipart([ident, first, pong])
    deadline = time.monotonic() + 10
    got = session.recv_first(None, (first, second), deadline)
    assert got is not None and got[0] == second
    assert [rid for rid, _ in strays] == [_rid(999)]
    got = session.recv_first(None, (first,), deadline)
    assert got is not None and got[0] == first

    third, fourth = (session.send(None, wire.Ping(rid=b"")) for _ in range(2))
    ident, _ = _requests(router, 2)
    error = wire.encode(wire.error_of(ConfigError("no such thing")))
    router.send_multipart([ident, BUNDLE, fourth, pong, third, error])
    got = session.recv_first(None, (third, fourth), deadline)
    assert got is not None and got[0] == fourth
    with pytest.raises(ConfigError, match="no such thing"):
        session.recv_first(None, (third,), deadline)  # (kept, and raised when taken)
    assert len(strays) == 1

"""What only the multi-process placement has: servers, the wire, other processes, death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import numpy as np
import pytest
import zmq

import flowrl
from flowrl import Column, HubConfig
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl.errors import SchemaError, TransportError

pytestmark = pytest.mark.integration

COLUMNS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]


@pytest.fixture
def hub():
    h = flowrl.launch_hub(
        COLUMNS,
        tasks={"train": ["ids", "reward"]},
        config=HubConfig(capacity=256, n_units=2, lease_timeout=30.0),
    )
    yield h
    h.close()


def _put(hub, n: int, start: int = 0) -> np.ndarray:
    return hub.put(
        {
            "ids": [np.arange(start + i, start + i + 3) for i in range(n)],
            "reward": np.arange(n, dtype=np.float32),
        }
    )


def test_samples_sharded_across_units_read_back_in_claim_order(hub) -> None:
    for k in range(4):
        _put(hub, 4, start=10 * k)
    meta = hub.claim("train", 16, timeout=5)
    assert set(meta.units.tolist()) == {0, 1}
    batch = hub.get(meta)
    firsts = [seq[0] for seq in batch["ids"].tolist()]
    assert firsts == [10 * k + i for k in range(4) for i in range(4)]
    hub.ack(meta)
    assert hub.statistics().live == 0
    deadline = time.monotonic() + 5  # evictions reach the units asynchronously
    while any(u.samples for u in hub.statistics().units) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(u.samples == 0 for u in hub.statistics().units)


def test_server_errors_arrive_as_the_same_typed_exception(hub) -> None:
    with pytest.raises(SchemaError, match="reward"):
        hub.put({"ids": [np.arange(2)], "reward": np.zeros(1, dtype=np.int64)})
    with pytest.raises(flowrl.errors.UnknownTaskError, match="nope"):
        hub.claim("nope", 1, timeout=0)
    _put(hub, 1)
    meta = hub.claim("train", 1, timeout=5)
    hub.ack(meta)
    with pytest.raises(flowrl.errors.LeaseError, match="already settled"):
        hub.ack(meta)


def test_malformed_requests_get_errors_and_the_server_stays_up(hub) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.address)
    try:
        one = np.zeros(1, np.int64).tobytes()
        cells = {"reward": commands.Cell(np.full(2, 4, np.int64).tobytes())}
        bad_commits = [  # per-sample versions: wrong length, negative, or with a version
            commands.Commit(
                indices=np.arange(2).tobytes(), cells=cells, new=True, versions=v, version=w
            )
            for v, w in [(one, None), (np.array([0, -1]).tobytes(), None), (one * 2, 3)]
        ]
        malformed = [b"", b"\xff\xfe garbage", wire.encode({"op": "claim", "task": 3})]
        for body in malformed + [wire.encode(c) for c in bad_commits]:
            sock.send_multipart([b"rid00001", body])
            assert sock.poll(5000), "server did not answer a malformed request"
            rid, reply = sock.recv_multipart()
            assert rid == b"rid00001"
            err = wire.decode_reply(reply)
            assert isinstance(err, wire.Error) and err.type == "TransportError"
        sock.send_multipart([b"lonely-frame"])  # too few frames: ignored, not fatal
    finally:
        sock.close()
    idx = _put(hub, 2)
    meta = hub.claim("train", 2, timeout=5)
    assert meta.indices.tolist() == idx.tolist()
    hub.ack(meta)


def test_unit_rejects_frames_that_do_not_match_headers(hub) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.unit_addresses[0])
    try:
        header = wire.write_request(
            np.arange(2, dtype=np.int64).tobytes(),
            [COLUMNS[1]],
            [flowrl._transport.frames.ArrayHeader("reward", 2, 1)],
        )
        sock.send_multipart([b"r", wire.encode(header), b"123"])  # 3 bytes, need 8
        assert sock.poll(5000)
        _, reply = sock.recv_multipart()
        assert isinstance(wire.decode_reply(reply), wire.Error)
    finally:
        sock.close()
    assert hub.statistics().units[0].samples == 0


def test_a_put_is_claimable_the_moment_it_returns(hub) -> None:
    # The unit hands the commit to the controller, which answers the producer: when put()
    # returns, the samples are committed (read-your-writes), on every unit.
    for k in range(6):
        idx = _put(hub, 1, start=k)
        meta = hub.claim_nowait("train", 1)
        assert meta.indices.tolist() == idx.tolist()
        assert hub.get(meta)["ids"].tolist() == [[k, k + 1, k + 2]]
        hub.ack(meta)


def _reserved_write(hub, bad_commit: dict, wait: bool = True):
    enc, _, _ = hub.schema.encode_all({"ids": [np.arange(3)], "reward": [1.0]}, None, "t")
    idx, unit, _ = hub._control.reserve(1, None)
    cells = {k: commands.Cell(e.nbytes, e.lengths) for k, e in enc.items()}
    commit = commands.Commit(indices=idx, cells=cells, new=True)
    commit = msgspec.structs.replace(commit, **bad_commit)
    types = {c.name: c for c in hub.schema.columns()}
    return idx, unit, lambda: hub._data.write_commit(unit, idx, enc, types, commit, wait, None)


@pytest.mark.parametrize(
    ("cells", "error", "match"),
    [
        # a column the controller does not know
        ({"nope": (np.array([8]), None)}, flowrl.errors.UnknownColumnError, "nope"),
        # malformed: two cells for one sample. The unit hands the commit on undecoded; the
        # controller answers the producer (not the unit).
        (
            {"ids": (np.array([8, 8]), np.array([1, 1]))},
            flowrl.errors.TransportError,
            "malformed Commit",
        ),
    ],
    ids=["unknown-column", "malformed"],
)
def test_a_commit_the_controller_refuses_reaches_the_producer(hub, cells, error, match) -> None:
    # The producer discards the stored bytes and gives the indices back, as for any refusal.
    cells = {k: commands.Cell(*v) for k, v in cells.items()}
    idx, unit, write = _reserved_write(hub, {"cells": cells})
    with pytest.raises(error, match=match):
        write()
    hub._data.discard(unit, idx, ("ids", "reward"))
    hub._control.abort(idx)
    stats = hub.statistics()
    assert stats.live == stats.reserved == 0 and stats.units[unit].samples == 0
    assert _put(hub, 1).size == 1  # and the hub goes on


def test_a_put_async_the_controller_refuses_leaves_nothing_behind(hub) -> None:
    cells = {"nope": commands.Cell(np.array([8]))}
    _, unit, write = _reserved_write(hub, {"cells": cells}, wait=False)
    fut = write()
    with pytest.raises(flowrl.errors.UnknownColumnError, match="nope"):
        fut.result(5)
    # the client discarded the stored bytes and gave the reserved index back
    stats = hub.statistics()
    assert stats.live == stats.reserved == 0 and stats.units[unit].samples == 0
    hub.flush(5)  # reported through its future: not again
    assert _put(hub, 1).size == 1


def test_unit_refuses_a_commit_for_other_samples(hub) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(hub.unit_addresses[0])
    commit = commands.Commit(indices=np.arange(1, 3, dtype=np.int64).tobytes(), cells={}, new=True)
    try:
        header = wire.write_request(
            np.arange(2, dtype=np.int64).tobytes(),
            [COLUMNS[1]],
            [flowrl._transport.frames.ArrayHeader("reward", 2, 1)],
            commit=commit,
            controller=hub.address,
            reply_to=b"someone",
        )
        sock.send_multipart([b"r", wire.encode(header), np.zeros(2, np.float32).tobytes()])
        assert sock.poll(5000)
        _, reply = sock.recv_multipart()
        err = wire.decode_reply(reply)
        assert isinstance(err, wire.Error) and "other samples" in err.message
    finally:
        sock.close()
    assert hub.statistics().units[0].samples == 0


def test_indices_reserved_ahead_are_freed_by_end_of_stream_and_close(hub) -> None:
    other = flowrl.connect(hub.address)
    try:
        _put(other, 1)  # its pool: indices reserved ahead for its next small puts
        stats = hub.statistics()
        assert stats.reserved_ahead > 0 and stats.live == 1 and stats.reserved == 0
        other.close()  # gives its pool back
        assert hub.statistics().reserved_ahead == 0
    finally:
        other.close()
    _put(hub, 1)
    assert hub.statistics().reserved_ahead > 0
    hub.ack(hub.claim("train", 2, timeout=5))  # the other's sample and this one
    hub.end_stream()
    with pytest.raises(flowrl.errors.EndOfStream):
        # at once, not "nothing ready yet": nobody is writing the pooled indices
        hub.claim_nowait("train", 1)
    assert hub.statistics().reserved_ahead == 0
    with pytest.raises(flowrl.errors.EndOfStream):
        _put(hub, 1)  # its pooled indices are gone: the put learns the stream ended


def test_a_put_to_claimed_samples_asks_the_controller_nothing_first(hub, monkeypatch) -> None:
    """The claim's handle names where its samples live: a stage's output put to one
    storage unit goes there at once (3 legs, not 5), and the commit checks what the lookup
    checked (the unit refuses samples it no longer holds)."""
    idx = _put(hub, 4)  # one put: one unit

    def no_lookup(*args: object) -> None:
        raise AssertionError("put(indices=meta) asked the controller where samples live")

    monkeypatch.setattr(hub._control, "check_update", no_lookup)
    hub.register_task("next", ["ids", "reward"])
    meta = hub.claim("train", 4, timeout=5)
    hub.put({"reward": np.full(4, 7, np.float32)}, indices=meta, ack=meta)
    done = hub.claim("next", 4, timeout=5)
    assert sorted(done.indices.tolist()) == sorted(idx.tolist())
    assert hub.get(done)["reward"].tolist() == [7.0] * 4
    hub.end_stream(["reward"])
    before = hub.statistics()
    with pytest.raises(SchemaError, match="closed by end_stream"):  # refused by the commit
        hub.put({"reward": np.zeros(4, np.float32)}, indices=done)
    assert hub.statistics().tasks == before.tasks and hub.statistics().events == before.events
    hub.drop(done)  # every task settled: evicted
    deadline = time.monotonic() + 5  # evictions reach the units asynchronously
    while any(u.samples for u in hub.statistics().units) and time.monotonic() < deadline:
        time.sleep(0.01)
    stale = hub.statistics()
    with pytest.raises(flowrl.errors.UnknownIndexError):  # refused by the unit
        hub.put({"ids": [[1]] * 4}, indices=done)
    assert hub.statistics() == stale  # not a byte stored


CONSUMER = textwrap.dedent(
    """
    import sys, time, flowrl
    hub = flowrl.connect(sys.argv[1])
    meta = hub.claim("train", 4, timeout=10, lease_timeout=1.0)
    print("claimed", *meta.indices.tolist(), flush=True)
    time.sleep(60)   # killed here, mid-batch, without ack
    """
)


def test_a_wait_longer_than_a_slice_gets_its_answer_and_close_ends_it(hub) -> None:
    """A wait polls in slices (``POLL_SLICE_S``): a claim answered after two slices
    returns, and a wait the client is closed under by another thread ends with HubClosed,
    not at its timeout. (A blocking receive instead of the poll, its timeout the slice,
    saved a few µs a wait but aborted the process here: libzmq asserts when a socket is
    closed under a receive.)"""
    import threading

    from flowrl._transport.session import POLL_SLICE_S

    threading.Timer(
        2.2 * POLL_SLICE_S,
        lambda: flowrl.connect(hub.address).put(
            {"ids": [np.arange(3)], "reward": np.zeros(1, dtype=np.float32)}
        ),
    ).start()
    t0 = time.monotonic()
    meta = hub.claim("train", 1, timeout=30)
    assert len(meta) == 1 and 2 * POLL_SLICE_S < time.monotonic() - t0 < 15
    other = flowrl.connect(hub.address)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            other.claim("train", 1, timeout=60)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    other.close()
    waiter.join(timeout=10 * POLL_SLICE_S)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], flowrl.errors.HubClosed)


def test_consumer_killed_mid_batch_loses_nothing(hub) -> None:
    idx = _put(hub, 4)
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, hub.address], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "claimed" and sorted(map(int, line[1:])) == sorted(idx.tolist())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    meta = hub.claim("train", 4, timeout=10)  # the lease expires after 1 s
    assert sorted(meta.indices.tolist()) == sorted(idx.tolist())
    assert hub.get(meta)["reward"].tolist() == [0.0, 1.0, 2.0, 3.0]
    hub.ack(meta)
    assert hub.statistics().live == 0


def test_other_process_connects_and_puts(hub) -> None:
    code = textwrap.dedent(
        """
        import sys, numpy as np, flowrl
        hub = flowrl.connect(sys.argv[1])
        hub.put({"ids": [np.arange(5)], "reward": np.ones(1, dtype=np.float32)}, producer="p")
        hub.close()
        """
    )
    subprocess.run([sys.executable, "-c", code, hub.address], check=True, timeout=60)
    meta = hub.claim("train", 1, timeout=5)
    assert hub.get(meta)["ids"].tolist() == [[0, 1, 2, 3, 4]]
    hub.ack(meta)


def test_events_reach_remote_subscribers_in_order(hub) -> None:
    seen: list = []
    hub.subscribe(seen.append)
    _put(hub, 2)
    meta = hub.claim("train", 2, timeout=5)
    hub.ack(meta)
    hub.publish_version(1)
    deadline = time.monotonic() + 5
    while len(seen) < 6 and time.monotonic() < deadline:
        hub.flush_events(0.1)
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["IndexWatermark", "Put", "Claimed", "Acked", "Evicted", "VersionPublished"]
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)


def test_close_stops_servers_and_later_calls_fail_cleanly() -> None:
    h = flowrl.launch_hub(COLUMNS, tasks={"train": ["ids", "reward"]})
    address = h.address
    h.close()
    with pytest.raises(flowrl.errors.HubClosed):
        h.claim("train", 1, timeout=0)
    with pytest.raises(TransportError):
        flowrl._transport.remote.RemoteHub(address, rpc_timeout=0.5)


def test_servers_exit_when_the_launching_process_dies() -> None:
    code = textwrap.dedent(
        """
        import os, numpy as np, flowrl
        hub = flowrl.launch_hub([flowrl.Column.ragged("x", "int64")])
        hub.put({"x": [np.arange(100_000)]})  # large enough for the unit's shared memory
        print(hub.address, flush=True)
        os._exit(0)   # dies without closing the hub
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=60,
        check=True,
    )
    address = out.stdout.strip()
    name = address.removeprefix("ipc://").rsplit("/", 2)[-2].removeprefix("flowrl-")
    arena = f"/dev/shm/flowrl-{name}-unit0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            flowrl._transport.remote.RemoteHub(address, rpc_timeout=0.3).close()
        except TransportError:
            break  # the controller is gone
        time.sleep(0.2)
    else:
        pytest.fail("the hub's servers outlived the process that launched them")
    while os.path.exists(arena):  # the unit took its shared memory with it
        assert time.monotonic() < deadline + 5, f"{arena} outlived its storage unit"
        time.sleep(0.1)

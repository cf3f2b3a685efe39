"""A zmq put's payload written into the storage unit's lent shared memory, and the next
put's indices reserved with a put's commit (issue 28, puts at the speed of the wire)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig
from flowrl._protocol import commands
from flowrl._transport import wire
from flowrl._transport.frames import encoded_frames
from flowrl.errors import TransportError

pytestmark = pytest.mark.integration

COLUMNS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
SEQ = 4096  # 32 KiB a sample: a put of 4 is past the 64 KiB a lane is used from


@pytest.fixture
def hub() -> Iterator[Any]:
    h = flowrl.launch_hub(
        COLUMNS, tasks={"train": ["ids", "reward"]}, config=HubConfig(capacity=4096)
    )
    yield h
    h.close()


def batch(n: int, start: int = 0) -> dict[str, Any]:
    cu = np.arange(n + 1, dtype=np.int64) * SEQ
    ids = np.arange(start * SEQ, (start + n) * SEQ, dtype=np.int64)
    return {
        "ids": flowrl.RaggedArray(ids, cu),
        "reward": np.arange(start, start + n, dtype=np.float32),
    }


def test_a_large_put_goes_through_lent_memory_and_reads_back(hub: Any) -> None:
    for k in range(3):
        hub.put(batch(4, start=4 * k))
    lanes = hub._data._lanes
    assert lanes._usable == [True] and 0 in lanes._local.lanes  # the unit lent memory
    meta = hub.claim("train", 12, timeout=5)
    got = hub.get(meta)
    ids, cu = got.packed("ids")
    assert np.array_equal(ids, np.arange(12 * SEQ)) and cu[-1] == 12 * SEQ
    assert got["reward"].tolist() == list(range(12))
    hub.ack(meta)


def _lent_write(hub: Any, grant: int, refs: list[wire.ShmRef], indices: np.ndarray) -> Any:
    data = hub.schema.encode_all(batch(indices.size), None, "test")[0]
    headers = [encoded_frames(name, enc)[0] for name, enc in data.items()]
    msg = wire.write_request(indices.tobytes(), list(COLUMNS), headers, grant=grant, refs=refs)
    return hub._session.call(0, msg)


def test_a_write_naming_memory_outside_its_grant_is_refused(hub: Any) -> None:
    hub.put(batch(4))  # this thread's lane holds a grant now
    lane = hub._data._lanes._local.lanes[0]
    idx, _ = hub._session.call(None, commands.Reserve(n=4))[0].indices, None
    indices = wire.ints(idx)
    used = lane.next - 64  # bytes an earlier write named: written once only
    cases = {
        "before the free part": (lane.grant, [wire.ShmRef(lane.path, used, 64)] * 3),
        "past the grant": (lane.grant, [wire.ShmRef(lane.path, lane.end - 8, 64)] * 3),
        "another segment": (lane.grant, [wire.ShmRef(lane.path + "x", lane.next, 8)] * 3),
        "a grant never lent": (lane.grant + 1000, [wire.ShmRef(lane.path, lane.next, 8)] * 3),
    }
    before = hub.statistics().units[0]
    for what, (grant, refs) in cases.items():
        with pytest.raises(TransportError, match="shared memory"):
            _lent_write(hub, grant, refs, indices)
        assert hub.statistics().units[0] == before, what  # nothing stored


def test_a_grant_is_its_sockets_only(hub: Any) -> None:
    import threading

    hub.put(batch(4))
    lane = hub._data._lanes._local.lanes[0]
    idx = wire.ints(hub._session.call(None, commands.Reserve(n=4))[0].indices)
    errors: list[BaseException] = []

    def other_thread() -> None:  # another socket of the client names this thread's grant
        try:
            _lent_write(hub, lane.grant, [wire.ShmRef(lane.path, lane.next, 8)] * 3, idx)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "did not lend to its sender" in str(errors[0])


def test_a_batched_put_reserves_the_next_ones_indices_and_close_gives_them_back(
    hub: Any,
) -> None:
    producer = flowrl.connect(hub.address)
    try:
        first = producer.put(batch(32))
        pool = producer._control._local.pool
        assert pool.indices.size == 32 and pool.left() == 32  # the commit reserved the next 32
        assert hub.statistics().reserved_ahead == 32
        second = producer.put(batch(32))
        assert second.tolist() == pool.indices.tolist() and first.max() < second.min()
    finally:
        producer.close()  # gives back what the last put reserved
    stats = hub.statistics()
    assert stats.reserved == stats.reserved_ahead == 0 and stats.live == 64


def test_a_batched_put_async_stream_reserves_ahead_once_and_its_commits_keep_it_full() -> None:
    """A put_async's answer is read later: a batched stream reserves STREAM_AHEAD puts
    ahead with its first put, and each commit reserves for a later put as it is answered,
    so a steady stream (answers read a few puts later) never waits for a reserve again;
    closing gives back what it did not use."""
    from flowrl._transport.pools import STREAM_AHEAD

    config = HubConfig(capacity=65536)  # pools hold up to 1/64 of it: 1,024 indices
    hub = flowrl.launch_hub(COLUMNS, tasks={"train": ["ids", "reward"]}, config=config)
    producer = flowrl.connect(hub.address)
    producer.max_puts_in_flight = STREAM_AHEAD - 3  # each answer read 4 puts later
    reserves: list[Any] = []
    call = producer._session.call_parked

    def counted(request: Any, *args: Any) -> Any:
        reserves.append(request(None))
        return call(request, *args)

    producer._session.call_parked = counted  # type: ignore[method-assign]
    n, puts = 32, 4 * STREAM_AHEAD
    try:
        futures = [producer.put_async(batch(n, start=n * k)) for k in range(puts)]
        producer.flush()
        got = np.concatenate([f.result() for f in futures])
        assert len(reserves) == 1 and reserves[0].ahead == n * STREAM_AHEAD
        assert got.size == np.unique(got).size == n * puts
        assert hub.statistics().reserved_ahead == n * STREAM_AHEAD  # topped up to the full
        producer.close()
        stats = hub.statistics()
        assert stats.reserved == stats.reserved_ahead == 0 and stats.live == n * puts
        meta = hub.claim("train", n * puts, timeout=5)
        assert sorted(hub.get(meta)["reward"].tolist()) == list(range(n * puts))
    finally:
        producer.close()
        hub.close()


def test_a_lane_idle_for_half_the_units_patience_asks_for_a_new_grant(hub: Any) -> None:
    """A unit lets go of grants idle for GRANT_IDLE_S (a dead client's would keep its
    segment): a client asks anew after half that, so its puts never name a dropped one."""
    from flowrl._transport.lanes import GRANT_IDLE_S

    hub.put(batch(4))
    lane = hub._data._lanes._local.lanes[0]
    hub.put(batch(4, start=4))
    assert hub._data._lanes._local.lanes[0].grant == lane.grant  # still the same grant
    lane.used -= GRANT_IDLE_S / 2
    hub.put(batch(4, start=8))
    assert hub._data._lanes._local.lanes[0].grant != lane.grant
    meta = hub.claim("train", 12, timeout=5)
    assert hub.get(meta)["reward"].tolist() == list(range(12))


def test_memory_is_reused_across_steps_and_never_under_a_reader() -> None:
    """Steps of put, read, ack: the unit reuses retired segments (the same files under new
    names) once no client maps them, and an array a reader still holds keeps its bytes."""
    big = 1 << 17  # 1 MiB a sample: a step of 96 fills more than a 64 MiB segment
    cols = [Column.tensor("ids", "int64", (big,)), Column.scalar("reward", "float32")]
    hub = flowrl.launch_hub(cols, tasks={"train": ["ids", "reward"]})
    try:
        address = hub.address.removeprefix("ipc://")
        arena = f"/dev/shm/flowrl-{address.rsplit('/', 2)[-2].removeprefix('flowrl-')}-unit0"
        seen: dict[int, set[str]] = {}  # segment inode -> the names it had
        held = None
        for step in range(5):
            for k in range(24):
                first = (step * 24 + k) * 4
                ids = np.arange(first, first + 4, dtype=np.int64)[:, None] + np.zeros(big, np.int64)
                hub.put({"ids": ids, "reward": np.arange(first, first + 4, dtype=np.float32)})
            for name in os.listdir(arena):
                if name != "owner":
                    seen.setdefault(os.stat(f"{arena}/{name}").st_ino, set()).add(name)
            for _ in range(24):
                meta = hub.claim("train", 4, timeout=10)
                got = hub.get(meta)
                firsts = got["ids"][:, [0, -1]]
                assert np.array_equal(
                    firsts, np.repeat(got["reward"].astype(np.int64), 2).reshape(4, 2)
                )
                if held is None:
                    held = (got["ids"], got["reward"].copy())  # kept across the steps below
                hub.ack(meta)
        assert any(len(names) > 1 for names in seen.values())  # a file under a second name
        ids, reward = held
        assert np.array_equal(ids[:, 0], reward.astype(np.int64))  # unchanged under its reader
        assert np.array_equal(ids[:, -1], reward.astype(np.int64))
    finally:
        hub.close()

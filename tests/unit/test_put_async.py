"""put_async / flush under every placement: pipelined puts, deferred errors, the window."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError, EndOfStream, LeaseError, SchemaError

COLS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
GUARD = 5.0


def one(i: int) -> dict[str, Any]:
    return {"ids": [np.arange(i % 5, dtype=np.int64) + i], "reward": np.array([i], np.float32)}


def test_put_async_samples_are_committed_in_order_once(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    futures = [hub.put_async(one(i)) for i in range(100)]
    assert all(isinstance(f, flowrl.PutFuture) for f in futures)
    hub.flush(GUARD)
    assert all(f.done() and f.exception() is None for f in futures)
    indices = np.concatenate([f.result() for f in futures])
    assert np.unique(indices).size == 100
    meta = hub.claim("train", 100, timeout=GUARD)
    assert meta.indices.tolist() == indices.tolist()  # one thread, one unit: put order
    batch = hub.get(meta)
    assert batch["reward"].tolist() == list(range(100))
    assert [s.tolist() for s in batch["ids"]] == [one(i)["ids"][0].tolist() for i in range(100)]
    hub.ack(meta)
    assert hub.statistics().live == 100  # "score" has not consumed them yet


def test_result_waits_for_its_own_put(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    first = hub.put_async(one(1))
    second = hub.put_async(one(2))
    assert second.result(GUARD).tolist() == [int(first.indices[0]) + 1]
    assert first.result(GUARD).size == 1
    assert hub.statistics().tasks["train"].ready == 2


def test_bad_input_raises_at_once_and_changes_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    hub.put_async(one(0)).result(GUARD)
    before = hub.statistics()
    with pytest.raises(SchemaError, match="reward"):
        hub.put_async({"ids": [np.arange(3)], "reward": np.zeros(1, np.float64)})
    with pytest.raises(ConfigError, match="partition"):
        hub.put_async(one(1), partition=3)
    hub.flush(GUARD)
    assert hub.statistics() == before


def test_a_refused_put_raises_from_its_future_and_changes_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    hub.put({"ids": [np.arange(2), np.arange(3)]})
    first = hub.claim("score", 1, timeout=GUARD)
    second = hub.claim("score", 1, timeout=GUARD)
    before = hub.statistics()
    reward = {"reward": np.zeros(1, np.float32)}
    try:
        fut = hub.put_async(reward, indices=first, ack=second)
    except LeaseError:
        return  # in-process: the put completes (here: is refused) before the call returns
    with pytest.raises(LeaseError, match="does not hold"):
        fut.result(GUARD)
    assert isinstance(fut.exception(), LeaseError)
    assert hub.statistics() == before
    hub.flush(GUARD)  # reported through its future: not again


def test_a_failure_nobody_waited_for_is_raised_by_flush_once(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    hub.put({"ids": [np.arange(2), np.arange(3)]})
    first = hub.claim("score", 1, timeout=GUARD)
    second = hub.claim("score", 1, timeout=GUARD)
    reward = {"reward": np.zeros(1, np.float32)}
    try:
        hub.put_async(reward, indices=first, ack=second)
    except LeaseError:
        return  # in-process: refused at once
    ok = hub.put_async(one(7))
    with pytest.raises(LeaseError) as info:
        hub.flush(GUARD)
    assert any("earlier put_async" in note for note in info.value.__notes__)
    hub.flush(GUARD)  # reported once
    assert ok.result(GUARD).size == 1  # a later put is unaffected


def test_a_failure_nobody_waited_for_is_raised_by_the_next_put_async(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    hub.put({"ids": [np.arange(2), np.arange(3)]})
    first = hub.claim("score", 1, timeout=GUARD)
    second = hub.claim("score", 1, timeout=GUARD)
    try:
        bad = hub.put_async({"reward": np.zeros(1, np.float32)}, indices=first, ack=second)
    except LeaseError:
        return  # in-process: refused at once
    hub.put_async(one(1)).result(GUARD)  # waits past the refusal
    assert bad.done()
    before = hub.statistics()
    with pytest.raises(LeaseError):
        hub.put_async(one(2))
    assert hub.statistics() == before  # the call that raised put nothing
    hub.put_async(one(3)).result(GUARD)


def test_puts_after_end_stream_fail_like_put(make_hub) -> None:
    # Pooled indices are given up when the stream ends: the put is made again and fails
    # as a synchronous put would, with EndOfStream; nothing is added.
    hub = make_hub(columns=COLS, tasks=TASKS)
    hub.put_async(one(0)).result(GUARD)
    hub.end_stream()
    before = hub.statistics()
    with pytest.raises(EndOfStream):
        hub.put_async(one(1)).result(GUARD)
    hub.flush(GUARD)
    assert hub.statistics().live == before.live


def test_no_more_than_max_puts_in_flight(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    if hasattr(hub, "max_puts_in_flight"):
        hub.max_puts_in_flight = 4
    futures = []
    for i in range(40):
        futures.append(hub.put_async(one(i)))
        assert sum(not f.done() for f in futures) <= 4
    hub.flush(GUARD)
    assert hub.statistics().tasks["train"].ready == 40


def test_result_from_another_thread_is_refused_until_done(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    fut = hub.put_async(one(0))
    seen: list[Any] = []

    def other() -> None:
        try:
            seen.append(fut.result(GUARD))
        except ConfigError as exc:
            seen.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(GUARD)
    if fut.done() and not isinstance(seen[0], ConfigError):
        return  # answered before the other thread asked (in-process: always)
    assert isinstance(seen[0], ConfigError) and "thread that made" in str(seen[0])
    hub.flush(GUARD)
    assert fut.result().size == 1


@pytest.mark.parametrize("seq", [1, 64, 4096], ids=["frames", "small", "lent"])
def test_the_callers_arrays_can_be_reused_once_a_put_returns(make_hub, seq: int) -> None:
    """put may write the caller's arrays without copying them first (over a transport it
    copies them out before it returns), put_async copies them: either way, overwriting
    them afterwards changes nothing stored."""
    hub = make_hub(columns=[Column.tensor("x", "int64", (seq,))], tasks={"train": ["x"]})
    buf = np.zeros((4, seq), dtype=np.int64)
    for i in range(6):
        buf[:] = i
        if i % 2:
            hub.put({"x": buf})
        else:
            hub.put_async({"x": buf})
    hub.flush(GUARD)
    buf[:] = -1
    batch = hub.get(hub.claim("train", 24, timeout=GUARD))
    assert sorted(set(np.asarray(batch["x"])[:, 0].tolist())) == list(range(6))
    assert all(np.unique(row).size == 1 for row in np.asarray(batch["x"]))

"""Hub behaviour through the public client API, under every placement (``make_hub``).

Blocking calls always carry a short timeout as a guard; no test asserts how long anything
took. Events are awaited with ``hub.flush_events()`` where the client has it, otherwise by
polling with a deadline.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, Observer
from flowrl.errors import (
    ConfigError,
    EndOfStream,
    FlowRLError,
    HubClosed,
    HubFull,
    LeaseError,
    NothingReady,
    Timeout,
    UnknownIndexError,
    UnknownTaskError,
    WouldBlock,
)
from flowrl.events import (
    Acked,
    Claimed,
    Evicted,
    IndexWatermark,
    LeaseExpired,
    Put,
    Released,
    StreamEnded,
    TaskRegistered,
    TaskUnregistered,
    VersionPublished,
)

COLS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
TWO_TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
#: Seconds a blocking call may wait before the test fails instead of hanging: a hang guard,
#: not a timing. Every wait ends on what it waits for (a put, an ack, an expiry, a close),
#: so a passing test never waits it out, however loaded the machine.
GUARD = 60.0


def ids(n: int, start: int = 0) -> list[np.ndarray]:
    return [np.arange(1 + (i % 4), dtype=np.int64) + 100 * i for i in range(start, start + n)]


def sample(n: int, start: int = 0) -> dict[str, Any]:
    return {"ids": ids(n, start), "reward": np.arange(start, start + n, dtype=np.float32)}


def flush(hub: Any) -> None:
    flush_events = getattr(hub, "flush_events", None)
    if flush_events is not None:
        assert flush_events(GUARD)


def wait_until(predicate: Callable[[], bool], timeout: float = GUARD) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class Background:
    """Run ``fn`` in a thread; ``result()`` returns its value or re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout: float = GUARD * 2) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background call did not return"
        if self._error is not None:
            raise self._error
        return self._value


# -- the basic flow ----------------------------------------------------------------------------
def test_put_claim_get_ack(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    idx = hub.put(sample(4))
    assert idx.tolist() == [0, 1, 2, 3]
    meta = hub.claim("train", 4, timeout=GUARD)
    assert isinstance(meta, flowrl.BatchMeta)
    assert meta.indices.tolist() == [0, 1, 2, 3]
    assert meta.task == "train"
    assert len(meta) == 4
    batch = hub.get(meta)
    assert isinstance(batch, flowrl.Batch)
    assert batch.indices.tolist() == [0, 1, 2, 3]
    assert batch["reward"].tolist() == [0, 1, 2, 3]
    assert [s.tolist() for s in batch["ids"]] == [s.tolist() for s in ids(4)]
    assert meta.tokens.tolist() == [1, 2, 3, 4]  # ragged lengths
    stats = hub.statistics()
    assert stats.tasks["train"] == flowrl.TaskStats(ready=0, leased=4, consumed=0)
    assert stats.live == 4
    hub.ack(meta)
    stats = hub.statistics()
    assert stats.tasks["train"] == flowrl.TaskStats(ready=0, leased=0, consumed=4)
    assert stats.live == 0
    assert stats.leases == 0


def test_claim_takes_oldest_first_and_n_at_most(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    hub.put(sample(3))
    hub.put(sample(3, 3))
    assert hub.claim("train", 2, timeout=GUARD).indices.tolist() == [0, 1]
    assert hub.claim("train", 3, timeout=GUARD).indices.tolist() == [2, 3, 4]
    assert hub.claim("train", 3, min_n=1, timeout=GUARD).indices.tolist() == [5]


def test_a_stage_writes_back_into_claimed_samples(make_hub) -> None:
    """The reward pattern: claim ids, put reward on the same samples, ack."""
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put({"ids": ids(3)})
    meta = hub.claim("score", 3, timeout=GUARD)
    rewards = np.array([len(s) for s in hub.get(meta)["ids"]], dtype=np.float32)
    assert hub.put({"reward": rewards}, indices=meta).tolist() == meta.indices.tolist()
    hub.ack(meta)
    batch = hub.get(hub.claim("train", 3, timeout=GUARD))
    assert batch["reward"].tolist() == [1.0, 2.0, 3.0]


def test_per_column_readiness(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    idx = hub.put({"ids": ids(2)})
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1)  # needs reward too
    assert hub.statistics().tasks["train"].ready == 0
    assert hub.claim("score", 2, timeout=GUARD).indices.tolist() == idx.tolist()
    hub.put({"reward": np.array([1.0], np.float32)}, indices=idx[1:])
    assert hub.claim("train", 2, min_n=1, timeout=GUARD).indices.tolist() == [idx[1]]
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1)
    hub.put({"reward": np.array([2.0], np.float32)}, indices=idx[:1])
    assert hub.claim_nowait("train", 1).indices.tolist() == [idx[0]]


def test_claim_of_a_column_subset_reads_only_those(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(2))
    meta = hub.claim("train", 2, columns=["reward"], timeout=GUARD)
    assert meta.columns == ("reward",)
    assert hub.get(meta).columns == ("reward",)


# -- blocking, timeouts, non-blocking ----------------------------------------------------------
def test_claim_blocks_until_a_put_from_another_thread(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    waiter = Background(lambda: hub.claim("train", 2, timeout=GUARD * 2))
    time.sleep(0.05)  # give the claim time to start waiting (not asserted)
    assert waiter.running
    hub.put({"ids": ids(2)})
    time.sleep(0.02)
    assert waiter.running  # ids alone do not make the samples ready for 'train'
    idx = hub.put({"reward": np.ones(2, np.float32)}, indices=[0, 1])
    assert waiter.result().indices.tolist() == idx.tolist()


def test_a_blocked_claim_waits_out_other_tasks_puts_and_takes_its_own(make_hub) -> None:
    hub = make_hub(
        columns=[*COLS, Column.scalar("verdict", "int64")],
        tasks={"score": ["ids"], "judge": ["verdict"]},
    )
    judge = Background(lambda: hub.claim("judge", 1, timeout=GUARD * 2))
    score = Background(lambda: hub.claim("score", 2, timeout=GUARD * 2))
    time.sleep(0.05)  # give both claims time to start waiting (not asserted)
    idx = hub.put({"ids": ids(2)})
    assert score.result().indices.tolist() == idx.tolist()
    for k in range(4):
        hub.put({"ids": ids(1, start=k)})  # for 'score' only
    time.sleep(0.02)
    assert judge.running
    hub.put({"verdict": np.array([7])}, indices=idx[1:])
    assert judge.result().indices.tolist() == [idx[1]]


def test_timeout_and_nothing_ready(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    with pytest.raises(Timeout) as info:
        hub.claim("train", 1, timeout=0.05)
    assert isinstance(info.value, TimeoutError)
    assert "train" in str(info.value)
    with pytest.raises(NothingReady) as nothing:
        hub.claim_nowait("train", 1)
    assert isinstance(nothing.value, WouldBlock)
    hub.put(sample(1))
    with pytest.raises(Timeout):
        hub.claim("train", 2, timeout=0.05)  # one is not enough without min_n
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 2)
    assert hub.statistics().leases == 0
    assert hub.claim_nowait("train", 2, min_n=1).indices.tolist() == [0]


def test_min_n_partial_claims(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(3))
    meta = hub.claim("train", 5, min_n=2, timeout=GUARD)
    assert meta.indices.tolist() == [0, 1, 2]
    hub.put(sample(1, 3))
    with pytest.raises(Timeout):
        hub.claim("train", 5, min_n=2, timeout=0.05)
    hub.put(sample(1, 4))
    assert hub.claim("train", 5, min_n=2, timeout=GUARD).indices.tolist() == [3, 4]


# -- end of stream ---------------------------------------------------------------------------
def test_end_stream_gives_the_partial_batch_then_end_of_stream(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    hub.put(sample(5))
    hub.end_stream()
    assert hub.statistics().ended
    first = hub.claim("train", 4, timeout=GUARD)
    assert first.indices.tolist() == [0, 1, 2, 3]
    last = hub.claim("train", 4, timeout=GUARD)
    assert last.indices.tolist() == [4]  # partial, without min_n
    # a lease is outstanding: it could still expire and come back, so no EndOfStream yet
    with pytest.raises(Timeout):
        hub.claim("train", 4, timeout=0.05)
    hub.ack(first)
    hub.ack(last)
    with pytest.raises(EndOfStream, match="train"):
        hub.claim("train", 4, timeout=GUARD)
    with pytest.raises(EndOfStream):
        hub.claim_nowait("train", 1)
    with pytest.raises(EndOfStream):
        hub.put(sample(1))


def test_end_of_stream_is_never_inferred_from_emptiness(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    with pytest.raises(Timeout):
        hub.claim("train", 1, timeout=0.05)
    hub.put(sample(2))
    hub.ack(hub.claim("train", 2, timeout=GUARD))
    with pytest.raises(Timeout):
        hub.claim("train", 1, timeout=0.05)  # everything consumed, but not ended
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1)


def test_end_stream_wakes_blocked_claimers(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    waiter = Background(lambda: hub.claim("train", 3, timeout=GUARD * 2))
    hub.put(sample(2))
    time.sleep(0.05)
    assert waiter.running  # 2 < 3 and the stream is open
    hub.end_stream()
    first = waiter.result()
    assert first.indices.tolist() == [0, 1]
    # the next claim waits on the outstanding lease, and ends when it is acked
    waiter = Background(lambda: hub.claim("train", 3, timeout=GUARD * 2))
    time.sleep(0.05)
    assert waiter.running
    hub.ack(first)
    with pytest.raises(EndOfStream):
        waiter.result()


def test_end_stream_with_pending_samples_waits_for_open_columns(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    idx = hub.put({"ids": ids(2)})
    hub.end_stream()  # no new samples, but 'reward' may still be written
    hub.ack(hub.claim("score", 2, timeout=GUARD))
    with pytest.raises(Timeout):
        hub.claim("train", 2, timeout=0.05)
    hub.put({"reward": np.ones(2, np.float32)}, indices=idx)
    hub.ack(hub.claim("train", 2, timeout=GUARD))
    with pytest.raises(EndOfStream):
        hub.claim("train", 1, timeout=GUARD)
    assert hub.statistics().live == 0


def test_end_stream_with_closed_columns_ends_tasks_that_need_them(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put({"ids": ids(2)})
    hub.end_stream(["reward"])  # reward will never be written: 'train' is done
    with pytest.raises(EndOfStream):
        hub.claim("train", 1, timeout=GUARD)
    assert hub.claim("score", 2, timeout=GUARD).indices.tolist() == [0, 1]


def test_end_stream_closed_column_missing_alongside_an_open_one(make_hub) -> None:
    hub = make_hub(
        columns=[*COLS, Column.scalar("adv", "float32")],
        tasks={"train": ["ids", "reward", "adv"]},
    )
    hub.put({"ids": ids(2)})  # reward and adv missing
    hub.end_stream(["reward"])  # reward never comes: 'train' can never get these samples
    with pytest.raises(EndOfStream):
        hub.claim("train", 1, timeout=0.3)


# -- capacity --------------------------------------------------------------------------------
def test_capacity_put_nowait_raises_and_put_blocks_until_eviction(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(capacity=4))
    hub.put(sample(4))
    before = hub.statistics()
    with pytest.raises(HubFull) as info:
        hub.put_nowait(sample(1, 4))
    assert isinstance(info.value, WouldBlock)
    with pytest.raises(Timeout):
        hub.put(sample(1, 4), timeout=0.05)
    assert hub.statistics() == before
    producer = Background(lambda: hub.put(sample(2, 4), timeout=GUARD * 2))
    time.sleep(0.05)
    assert producer.running
    train = hub.claim("train", 4, timeout=GUARD)
    hub.ack(train)  # 'score' has not acked: nothing is evicted, the put keeps waiting
    time.sleep(0.02)
    assert producer.running
    assert hub.statistics().live == 4
    score = hub.claim("score", 4, timeout=GUARD)
    hub.ack(score, indices=score.indices[:1])  # frees one slot: not enough for 2
    time.sleep(0.02)
    assert producer.running
    hub.ack(score, indices=score.indices[1:])
    assert producer.result().tolist() == [4, 5]
    assert hub.statistics().live == 2
    batch = hub.get(hub.claim("train", 2, timeout=GUARD))
    assert batch["reward"].tolist() == [4.0, 5.0]


def test_close_wakes_a_blocked_producer(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(capacity=2))
    hub.put(sample(2))
    producer = Background(lambda: hub.put(sample(1, 2), timeout=GUARD))
    time.sleep(0.05)
    hub.close()
    with pytest.raises(HubClosed):
        producer.result()


def test_end_stream_wakes_a_blocked_producer(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(capacity=2))
    hub.put(sample(2))
    producer = Background(lambda: hub.put(sample(1, 2), timeout=GUARD))
    time.sleep(0.05)
    hub.end_stream()
    with pytest.raises(EndOfStream):
        producer.result()
    assert hub.statistics().live == 2


def test_a_put_larger_than_capacity_fails_at_once(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(capacity=4))
    with pytest.raises(HubFull, match="4"):
        hub.put(sample(5), timeout=GUARD)
    assert hub.statistics().live == 0


# -- leases ------------------------------------------------------------------------------------
def test_lease_expiry_returns_samples_to_another_claimer(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(3))
    lost = hub.claim("train", 2, lease_timeout=0.1, timeout=GUARD)
    assert lost.indices.tolist() == [0, 1]
    # another consumer asks for 3: it gets them once the first lease has expired
    again = hub.claim("train", 3, timeout=GUARD)
    assert sorted(again.indices.tolist()) == [0, 1, 2]
    with pytest.raises(LeaseError, match=str(lost.lease)):
        hub.ack(lost)
    with pytest.raises(LeaseError):
        hub.release(lost)
    hub.ack(again)
    assert hub.statistics().tasks["train"].consumed == 3


def test_config_lease_timeout_applies(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(lease_timeout=0.1))
    hub.put(sample(2))
    first = hub.claim("train", 2, timeout=GUARD)
    second = hub.claim("train", 2, timeout=GUARD)
    assert second.indices.tolist() == first.indices.tolist()
    with pytest.raises(LeaseError):
        hub.ack(first)


def test_expired_samples_come_back_first_in_line(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(2))
    hub.claim("train", 2, lease_timeout=0.05, timeout=GUARD)
    hub.put(sample(2, 2))
    time.sleep(0.1)
    assert hub.claim("train", 2, timeout=GUARD).indices.tolist() == [0, 1]


def test_partial_ack_then_expiry_returns_only_the_rest(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(4))
    meta = hub.claim("train", 4, lease_timeout=0.5, timeout=GUARD)
    hub.ack(meta, indices=[1, 3])
    with pytest.raises(LeaseError):
        hub.ack(meta, indices=[1])  # already acked
    again = hub.claim("train", 4, min_n=2, timeout=GUARD)
    assert sorted(again.indices.tolist()) == [0, 2]
    with pytest.raises(LeaseError):
        hub.ack(meta, indices=[0])
    hub.ack(again)
    assert hub.statistics().tasks["train"].consumed == 4


def test_ack_of_no_indices_changes_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(2))
    meta = hub.claim("train", 2, timeout=GUARD)
    before = hub.statistics()
    with contextlib.suppress(FlowRLError):  # raising is fine, so is a silent no-op
        hub.ack(meta, indices=[])
    assert hub.statistics() == before
    hub.ack(meta)


def test_release_returns_samples_first_in_line(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(6))
    first = hub.claim("train", 2, timeout=GUARD)
    second = hub.claim("train", 2, timeout=GUARD)
    assert second.indices.tolist() == [2, 3]
    hub.release(first)
    assert hub.statistics().tasks["train"] == flowrl.TaskStats(ready=4, leased=2, consumed=0)
    assert hub.claim("train", 2, timeout=GUARD).indices.tolist() == [0, 1]
    assert hub.claim("train", 2, timeout=GUARD).indices.tolist() == [4, 5]
    with pytest.raises(LeaseError):
        hub.ack(first)


def test_ack_is_per_task(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(2))
    train = hub.claim("train", 2, timeout=GUARD)
    hub.ack(train)
    with pytest.raises(NothingReady):
        hub.claim_nowait("train", 1)  # never delivered again to 'train'
    assert hub.claim("score", 2, timeout=GUARD).indices.tolist() == [0, 1]  # still owed


# -- eviction ----------------------------------------------------------------------------------
def test_eviction_only_after_every_registered_task_acked(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.register_task("audit", ["reward"])
    hub.put(sample(3))
    train = hub.claim("train", 3, timeout=GUARD)
    score = hub.claim("score", 3, timeout=GUARD)
    audit = hub.claim("audit", 3, timeout=GUARD)
    hub.ack(train)
    hub.ack(score)
    assert hub.statistics().live == 3
    hub.ack(audit, indices=[1])
    assert hub.statistics().live == 2
    with pytest.raises(UnknownIndexError):
        hub.meta([1], ["ids"])
    check = hub.get(hub.meta([0, 2], ["reward"]))
    assert check["reward"].tolist() == [0.0, 2.0]
    hub.ack(audit)
    assert hub.statistics().live == 0
    # Storage units hear of evictions from the controller, not from this client: soon, not
    # necessarily before this client's next request reaches them.
    assert wait_until(lambda: all(u.samples == 0 and u.chunks == 0 for u in hub.statistics().units))


def test_unregister_task_forgets_it_and_evicts_what_only_it_held(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    seen: list[Any] = []
    hub.subscribe(seen.append)
    hub.put(sample(3))
    hub.ack(hub.claim("score", 3, timeout=GUARD))
    assert hub.statistics().live == 3  # 'train' has not acked them
    hub.unregister_task("train")
    stats = hub.statistics()
    assert set(stats.tasks) == {"score"} and set(stats.counters.tasks) == {"score"}
    assert stats.live == 0  # every task left had consumed them
    with pytest.raises(UnknownTaskError):
        hub.claim_nowait("train", 1)
    flush(hub)
    assert wait_until(lambda: isinstance(seen[-1], Evicted))
    assert isinstance(seen[-2], TaskUnregistered) and seen[-2].task == "train"
    assert seen[-1].indices == (0, 1, 2)
    assert wait_until(lambda: all(u.samples == 0 for u in hub.statistics().units))
    hub.register_task("train", ["ids"])  # the name is free again, with other columns
    hub.put(sample(1, 3))
    assert hub.claim("train", 1, timeout=GUARD).indices.tolist() == [3]


def test_indices_are_never_reused(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(capacity=3))
    seen: list[int] = []
    rng = random.Random(0)
    for cycle in range(60):
        n = rng.randint(1, 3)
        idx = hub.put(sample(n, cycle), timeout=GUARD).tolist()
        seen += idx
        for task in ("score", "train"):
            meta = hub.claim(task, 3, min_n=1, timeout=GUARD)
            assert meta.indices.tolist() == idx
            batch = hub.get(meta, columns=["reward"])
            assert batch["reward"].tolist() == list(range(cycle, cycle + n))
            hub.ack(meta)
        assert hub.statistics().live == 0
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)


def test_stale_handle_cannot_read_a_reused_slot(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]}, config=HubConfig(capacity=2))
    hub.put(sample(2))
    old = hub.claim("train", 2, timeout=GUARD)
    hub.ack(old)
    hub.put(sample(2, 2))
    with pytest.raises(UnknownIndexError):
        hub.get(old)
    assert hub.get(hub.claim("train", 2, timeout=GUARD))["reward"].tolist() == [2.0, 3.0]


# -- events ------------------------------------------------------------------------------------
class Recorder(Observer):
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.kinds: Counter[str] = Counter()

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        super().__call__(event)

    def on_put(self, event: Put) -> None:
        self.kinds["put"] += 1

    def on_claim(self, event: Claimed) -> None:
        self.kinds["claim"] += 1

    def on_ack(self, event: Acked) -> None:
        self.kinds["ack"] += 1

    def on_release(self, event: Released) -> None:
        self.kinds["release"] += 1

    def on_lease_expired(self, event: LeaseExpired) -> None:
        self.kinds["lease_expired"] += 1

    def on_evict(self, event: Evicted) -> None:
        self.kinds["evict"] += 1

    def on_version(self, event: VersionPublished) -> None:
        self.kinds["version"] += 1

    def on_stream_end(self, event: StreamEnded) -> None:
        self.kinds["end"] += 1

    def on_task(self, event: TaskRegistered) -> None:
        self.kinds["task"] += 1


def test_subscribe_receives_typed_events_in_order(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    rec = Recorder()
    plain: list[Any] = []
    sub = hub.subscribe(rec)
    hub.subscribe(plain.append)
    hub.register_task("score", ["ids"])
    idx = hub.put(sample(2), producer="gen")
    released = hub.claim("train", 2, timeout=GUARD, consumer="c0")
    hub.release(released)
    meta = hub.claim("train", 2, timeout=GUARD)
    hub.ack(meta)
    hub.ack(hub.claim("score", 2, timeout=GUARD))
    hub.publish_version(3)
    hub.put(sample(1, 2))
    hub.claim("train", 1, lease_timeout=0.05, timeout=GUARD)
    hub.claim("train", 1, timeout=GUARD)  # waits for the expiry
    hub.end_stream()
    n_events = hub.statistics().events
    flush(hub)
    assert wait_until(lambda: len(plain) >= 15)
    kinds = [type(e) for e in rec.events]
    assert kinds == [
        TaskRegistered,
        IndexWatermark,  # the first put's indices are reserved
        Put,
        Claimed,
        Released,
        Claimed,
        Acked,
        Claimed,
        Acked,
        Evicted,
        VersionPublished,
        Put,
        Claimed,
        LeaseExpired,
        Claimed,
        StreamEnded,
    ]
    assert [e.seq for e in plain] == [e.seq for e in rec.events]
    seqs = [e.seq for e in rec.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert seqs[-1] == n_events
    put = rec.events[2]
    assert put.indices == tuple(idx.tolist())
    assert set(put.columns) == {"ids", "reward"}
    assert put.new and put.producer == "gen" and put.version == 0
    assert put.tokens == (1, 2)
    assert rec.events[3].consumer == "c0"
    assert rec.events[4].lease == released.lease
    assert rec.events[6].lease == meta.lease
    assert rec.events[9].indices == (0, 1)
    assert rec.events[10].version == 3
    assert rec.events[11].version == 3
    assert rec.events[13].indices == rec.events[14].indices == (2,)
    assert rec.kinds == Counter(
        task=1, put=2, claim=5, release=1, ack=2, evict=1, version=1, lease_expired=1, end=1
    )
    sub.cancel()
    hub.publish_version(4)
    flush(hub)
    assert wait_until(lambda: len(plain) == len(rec.events) + 1)
    assert isinstance(plain[-1], VersionPublished)
    assert len(rec.events) == 16  # the cancelled subscriber saw nothing more


def test_a_subscriber_of_some_kinds_receives_those_only_and_a_relay_decodes_no_more(
    make_hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowrl._transport import subscriber

    decoded: list[Any] = []
    real = subscriber.event_decoder

    class Counting:
        def decode(self, body: bytes) -> Any:
            decoded.append(body)
            return real.decode(body)

    monkeypatch.setattr(subscriber, "event_decoder", Counting())
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    versions: list[Any] = []
    sub = hub.subscribe(versions.append, events=[VersionPublished])
    hub.put(sample(2))
    hub.ack(hub.claim("train", 2, timeout=GUARD))
    hub.publish_version(1)
    hub.put(sample(1))
    hub.publish_version(2)
    flush(hub)
    assert wait_until(lambda: len(versions) == 2)
    assert [e.version for e in versions] == [1, 2]
    if hub.__class__.__name__ == "RemoteHub":
        assert len(decoded) == 2  # the puts, claims, acks and evictions were skipped
    everything: list[Any] = []
    hub.subscribe(everything.append)  # now someone wants all: decoded again
    hub.put(sample(1))
    flush(hub)
    assert wait_until(lambda: any(isinstance(e, Put) for e in everything))
    sub.cancel()
    for bad in (VersionPublished, [], ["version"], [int], "Put"):
        with pytest.raises(ConfigError, match="subscribe\\(\\) events"):
            hub.subscribe(versions.append, events=bad)


def test_an_observer_that_raises_is_unsubscribed_and_the_hub_keeps_working(
    make_hub, caplog: pytest.LogCaptureFixture
) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})
    calls: list[Any] = []
    good: list[Any] = []

    def bad(event: Any) -> None:
        calls.append(event)
        raise RuntimeError("observer bug")

    hub.subscribe(bad)
    hub.subscribe(good.append)
    hub.put(sample(2))
    flush(hub)
    assert wait_until(lambda: len(good) >= 1)
    meta = hub.claim("train", 2, timeout=GUARD)
    hub.ack(meta)
    flush(hub)
    assert wait_until(lambda: len(good) >= 5)
    assert len(calls) == 1  # unsubscribed after the first failure
    assert [type(e) for e in good] == [IndexWatermark, Put, Claimed, Acked, Evicted]
    assert hub.statistics().tasks["train"].consumed == 2


def test_a_strict_policy_that_raises_fails_the_next_call(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["ids", "reward"]})

    def policy(event: Any) -> None:
        if isinstance(event, Put):
            raise ValueError("policy rejects this put")

    hub.subscribe(policy, strict=True)
    hub.put(sample(1))
    if not hasattr(hub, "flush_events"):
        time.sleep(0.2)
    flush(hub)
    with pytest.raises(ValueError, match="policy rejects"):
        hub.claim("train", 1, timeout=GUARD)
    with pytest.raises(ValueError, match="policy rejects"):
        hub.put(sample(1, 1))


# -- versions, lifecycle -----------------------------------------------------------------------
def test_publish_version_stamps_new_samples(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(1))
    hub.publish_version(2)
    hub.publish_version(2)  # same version again is fine
    assert hub.version == 2
    assert hub.statistics().version == 2
    hub.put(sample(1, 1))
    hub.put(sample(1, 2), version=1)
    meta = hub.claim("train", 3, timeout=GUARD)
    assert meta.versions.tolist() == [0, 2, 1]


def test_a_put_can_give_each_sample_its_own_version(make_hub) -> None:
    """A batch mixing resumed and fresh rollouts: one version per sample, kept per sample
    on new samples and on updates; the Put event names the oldest and lists them all."""
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    rec = Recorder()
    hub.subscribe(rec)
    hub.publish_version(3)
    idx = hub.put(sample(3), version=[2, 0, 3])
    hub.put(sample(2, 3), version=np.array([1, 1]))  # all the same: one version
    meta = hub.claim("train", 5, timeout=GUARD)
    assert meta.versions.tolist() == [2, 0, 3, 1, 1]
    hub.put({"reward": np.zeros(3, np.float32)}, indices=idx, version=[3, 3, 2])  # re-stamps
    assert hub.claim("score", 3, timeout=GUARD).versions.tolist() == [3, 3, 2]
    flush(hub)
    puts = [e for e in rec.events if isinstance(e, Put)]
    assert (puts[0].version, puts[0].versions) == (0, (2, 0, 3))
    assert (puts[1].version, puts[1].versions) == (1, ())
    assert (puts[2].version, puts[2].versions) == (2, (3, 3, 2))


@pytest.mark.parametrize(
    ("version", "match"),
    [
        ([1, 2], "version in put.* 3 ints"),
        ([1, -1, 2], "version in put.* 3 ints"),
        ([0.5, 1.0, 2.0], "version in put.* 3 ints"),
        ([True, False, True], "version in put.* 3 ints"),
        (-1, "policy version must be an int"),
        (True, "policy version must be an int"),
        ("1", "policy version must be an int"),
    ],
)
def test_bad_versions_are_refused_and_change_nothing(make_hub, version: Any, match: str) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    before = hub.statistics()
    with pytest.raises(FlowRLError, match=match):
        hub.put(sample(3), version=version)
    after = hub.statistics()
    assert (after.live, after.reserved, after.tasks) == (before.live, before.reserved, before.tasks)


def test_groups_and_tokens_are_carried_on_the_handle(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(3), groups=[7, 7, 8], tokens=[10, 20, 30])
    hub.put(sample(1, 3), groups=9)
    meta = hub.claim("train", 4, timeout=GUARD)
    assert meta.groups.tolist() == [7, 7, 8, 9]
    assert meta.tokens.tolist() == [10, 20, 30, 4]
    assert meta.nbytes > 0


def test_close_wakes_waiters_and_refuses_calls(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    waiter = Background(lambda: hub.claim("train", 1, timeout=GUARD * 2))
    time.sleep(0.05)
    hub.close()
    with pytest.raises(HubClosed):
        waiter.result()
    with pytest.raises(HubClosed):
        hub.put(sample(1))
    with pytest.raises(HubClosed):
        hub.claim("train", 1, timeout=0.05)
    hub.close()  # idempotent


def test_context_manager_closes(make_hub) -> None:
    with make_hub(columns=COLS, tasks=TWO_TASKS) as hub:
        hub.put(sample(1))
    with pytest.raises(HubClosed):
        hub.put(sample(1))


def test_put_to_existing_samples_across_storage_units(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(n_units=2))
    first = hub.put({"ids": ids(2)})
    second = hub.put({"ids": ids(2, 2)})
    target = np.concatenate([second, first])  # mixed units, out of order
    hub.put({"reward": np.array([30, 40, 10, 20], np.float32)}, indices=target)
    meta = hub.claim("train", 4, timeout=GUARD)
    assert len(set(meta.units.tolist())) == 2
    batch = hub.get(meta)
    assert batch["reward"].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert [s.tolist() for s in batch["ids"]] == [s.tolist() for s in ids(4)]


def test_samples_spread_over_storage_units(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(n_units=2))
    for i in range(4):
        hub.put(sample(2, 2 * i))
    stats = hub.statistics()
    assert len(stats.units) == 2
    assert sum(u.samples for u in stats.units) == 8
    assert all(u.samples > 0 for u in stats.units)
    meta = hub.claim("train", 8, timeout=GUARD)
    assert hub.get(meta)["reward"].tolist() == list(range(8))


# -- concurrency -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_concurrent_producers_and_consumers_consume_each_sample_once_per_task(make_hub) -> None:
    n_producers, per_producer = 2, 200
    hub = make_hub(
        columns=[Column.scalar("x", "int64"), Column.ragged("ids", "int64")],
        tasks={"train": ["x", "ids"], "score": ["x"]},
        config=HubConfig(capacity=48),
    )
    errors: list[BaseException] = []
    consumed: dict[str, list[int]] = {"train": [], "score": []}
    lock = threading.Lock()

    def produce(pid: int) -> None:
        rng = random.Random(pid)
        k = 0
        while k < per_producer:
            n = min(rng.randint(1, 6), per_producer - k)
            xs = np.arange(k, k + n, dtype=np.int64) + pid * 10_000
            hub.put(
                {"x": xs, "ids": [np.full(int(x) % 5 + 1, x) for x in xs]},
                producer=f"p{pid}",
                timeout=20,
            )
            k += n

    def consume(task: str, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            try:
                meta = hub.claim(task, rng.randint(1, 8), min_n=1, timeout=20)
            except EndOfStream:
                return
            batch = hub.get(meta)
            xs = batch["x"].tolist()
            if task == "train":
                for x, seq in zip(xs, batch["ids"], strict=True):
                    assert seq.tolist() == [x] * (x % 5 + 1)
            if rng.random() < 0.1:
                hub.release(meta)  # give it back now and then: must not duplicate
                continue
            hub.ack(meta)
            with lock:
                consumed[task] += xs

    def guarded(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                errors.append(exc)

        return run

    producers = [threading.Thread(target=guarded(produce, p)) for p in range(n_producers)]
    consumers = [
        threading.Thread(target=guarded(consume, task, seed))
        for seed, task in enumerate(["train", "train", "train", "score", "score"])
    ]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(30)
    hub.end_stream()
    for t in consumers:
        t.join(30)
    assert not any(t.is_alive() for t in producers + consumers)
    if errors:
        raise errors[0]
    expected = sorted(p * 10_000 + k for p in range(n_producers) for k in range(per_producer))
    for task in ("train", "score"):
        assert sorted(consumed[task]) == expected, task  # each exactly once
    stats = hub.statistics()
    assert stats.live == 0
    assert stats.tasks["train"].consumed == stats.tasks["score"].consumed == len(expected)


def test_errors_are_flowrl_errors() -> None:
    for cls in (EndOfStream, HubClosed, HubFull, LeaseError, NothingReady, Timeout):
        assert issubclass(cls, FlowRLError)


def test_put_with_ack_writes_and_consumes_in_one_step(make_hub) -> None:
    # "score" reads ids and writes the reward that "train" needs: its put acks its claim.
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    idx = hub.put({"ids": ids(4)})
    meta = hub.claim("score", 4, timeout=GUARD)
    hub.put({"reward": np.arange(4, dtype=np.float32)}, indices=meta, ack=meta)
    stats = hub.statistics()
    assert stats.tasks["score"].consumed == 4 and stats.leases == 0
    with pytest.raises(LeaseError):
        hub.ack(meta)  # already acked by the put
    batch = hub.get(hub.claim("train", 4, timeout=GUARD))
    assert batch["reward"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(NothingReady):
        hub.claim_nowait("score", 1)  # consumed exactly once
    assert sorted(idx.tolist()) == sorted(meta.indices.tolist())


def test_put_with_ack_of_a_claim_that_does_not_hold_the_samples_changes_nothing(
    make_hub,
) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put({"ids": ids(4)})
    first = hub.claim("score", 2, timeout=GUARD)
    second = hub.claim("score", 2, timeout=GUARD)
    reward = {"reward": np.zeros(2, dtype=np.float32)}
    with pytest.raises(LeaseError, match="does not hold"):
        hub.put(reward, indices=first, ack=second)
    with pytest.raises(ConfigError, match="indices="):
        hub.put(reward, ack=first)  # new samples were never claimed
    with pytest.raises(ConfigError, match="BatchMeta"):
        hub.put(reward, indices=first, ack="lease")
    hub.ack(second)
    with pytest.raises(LeaseError):
        hub.put(reward, indices=second, ack=second)  # settled: the put is refused
    stats = hub.statistics()
    assert stats.tasks["score"].consumed == 2 and stats.tasks["train"].ready == 0
    hub.put(reward, indices=first, ack=first)
    assert hub.statistics().tasks["train"].ready == 2


def test_every_call_on_a_closed_hub_raises_hub_closed(make_hub) -> None:
    # F6 (issue 16): a closed embedded hub still served get/ack/statistics/...
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put(sample(2))
    meta = hub.claim("score", 2, timeout=GUARD)
    hub.close()
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: hub.get(meta),
        "ack": lambda: hub.ack(meta),
        "drop": lambda: hub.drop(meta),
        "release": lambda: hub.release(meta),
        "put": lambda: hub.put({"reward": np.zeros(2, np.float32)}, indices=meta),
        "put_ack": lambda: hub.put({"reward": np.zeros(2, np.float32)}, indices=meta, ack=meta),
        "claim": lambda: hub.claim("train", 1, timeout=0.05),
        "meta": lambda: hub.meta(meta.indices, ["ids"]),
        "statistics": hub.statistics,
        "declare": lambda: hub.declare(Column.scalar("extra", "int64")),
        "register_task": lambda: hub.register_task("late", ["ids"]),
        "publish_version": lambda: hub.publish_version(3),
        "end_stream": hub.end_stream,
        "append": lambda: hub.append(meta, "ids", [[1], [2]], version=0),
        "partial": lambda: hub.partial(meta, "ids"),
    }
    for name, call in calls.items():
        with pytest.raises(HubClosed):
            call()
            pytest.fail(f"{name}() on a closed hub did not raise HubClosed")


@pytest.mark.parametrize("n_units", [1, 2])
def test_a_put_refused_for_an_expired_lease_changes_nothing(make_hub, n_units: int) -> None:
    # F1 (issue 16): the refused straggler's bytes had replaced the committed ones
    hub = make_hub(columns=COLS, tasks=TWO_TASKS, config=HubConfig(n_units=n_units))
    for k in range(2):
        hub.put({"ids": ids(2, 2 * k)})  # two puts: with two units, a claim spans both
    straggler = hub.claim("score", 4, timeout=GUARD, lease_timeout=0.05)
    time.sleep(0.1)
    retry = hub.claim("score", 4, timeout=GUARD)  # the lease expired: the same samples
    assert sorted(retry.indices.tolist()) == sorted(straggler.indices.tolist())
    assert len(set(retry.units.tolist())) == n_units
    legit = np.arange(4, dtype=np.float32)
    hub.put({"reward": legit}, indices=retry, ack=retry)
    with pytest.raises(LeaseError):
        hub.put({"reward": -legit - 1}, indices=straggler, ack=straggler)
    batch = hub.get(hub.claim("train", 4, timeout=GUARD))
    expect = dict(zip(retry.indices.tolist(), legit.tolist(), strict=True))
    assert batch["reward"].tolist() == [expect[i] for i in batch.meta.indices.tolist()]


def test_a_refused_put_leaves_a_column_it_never_made_ready_unwritten(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    hub.put({"ids": ids(2)})
    straggler = hub.claim("score", 2, timeout=GUARD, lease_timeout=0.05)
    time.sleep(0.1)
    with pytest.raises(LeaseError):
        hub.put({"reward": np.full(2, -1, np.float32)}, indices=straggler, ack=straggler)
    retry = hub.claim("score", 2, timeout=GUARD)
    hub.put({"reward": np.array([5, 6], np.float32)}, indices=retry, ack=retry)
    batch = hub.get(hub.claim("train", 2, timeout=GUARD))
    assert sorted(batch["reward"].tolist()) == [5.0, 6.0]


def test_a_put_to_a_closed_column_changes_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TWO_TASKS)
    idx = hub.put(sample(2))
    hub.end_stream(["reward"])
    with pytest.raises(flowrl.errors.SchemaError, match="closed by end_stream"):
        hub.put({"reward": np.full(2, -1, np.float32)}, indices=idx)
    batch = hub.get(hub.claim("train", 2, timeout=GUARD))
    assert batch["reward"].tolist() == [0.0, 1.0]

"""What the kill tests of a ``launch_hub`` hub (test_kill.py) and of a Ray hub
(test_ray_hub.py) share: their data, a retry through server restarts, draining with exact
accounting, a producer that keeps putting across a kill, and the controller-kill scenario.

Accounting: every sample produced must be acknowledged exactly once per task, across the
kill and the recovery.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

import flowrl
from flowrl import Column
from flowrl.errors import EndOfStream, FlowRLError, Timeout, TransportError

COLS = [Column.ragged("ids", "int64"), Column.scalar("tag", "int64")]
TASKS = {"train": ["ids", "tag"], "score": ["tag"]}

#: How long a call is retried through a server restart (a loaded machine restarts slowly).
RETRY_S = 60.0


def rows(tags: np.ndarray) -> dict[str, Any]:
    return {"ids": [np.arange(t % 7 + 1) + t for t in tags.tolist()], "tag": tags}


def retry(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call through a server restart: typed transport errors are retried, nothing else."""
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            return fn(*args, **kwargs)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def drain(hub: flowrl.RemoteHub, task: str, acked: Counter[int], tags: dict[int, int]) -> None:
    """Claim, check and ack until end of stream."""
    while True:
        try:
            meta = retry(hub.claim, task, 16, min_n=1, timeout=10)
        except EndOfStream:
            return
        batch = retry(hub.get, meta)
        assert batch["tag"].tolist() == [tags[i] for i in meta.indices.tolist()]
        retry(hub.ack, meta)
        acked.update(meta.indices.tolist())


def assert_each_once(acked: dict[str, Counter[int]], tags: dict[int, int]) -> None:
    for task, counts in acked.items():
        assert sorted(counts) == sorted(tags), task
        assert set(counts.values()) == {1}, task


class Producer:
    """Puts 30 batches of 4 samples from a thread, re-putting a put a kill failed.
    ``tags`` maps each committed index to its tag. A put that got no answer may have
    been committed (the answer, not the commit, was lost): each put names its sequence
    number, so a re-put of one that landed is answered with its first indices."""

    def __init__(self, hub: flowrl.RemoteHub) -> None:
        self.hub = hub
        self.tags: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            for k in range(30):
                batch = np.arange(4 * k, 4 * k + 4)
                idx = retry(self.hub.put, rows(batch), producer="kill-test", seq=k)
                self.tags.update(zip(idx.tolist(), batch.tolist(), strict=True))
                time.sleep(0.01)
        except BaseException as exc:  # surfaced by join()
            self.errors.append(exc)

    def start_and_wait_for(self, n: int) -> None:
        self.thread.start()
        while len(self.tags) < n:
            assert self.thread.is_alive(), f"the producer stopped early: {self.errors}"
            time.sleep(0.01)

    def join(self) -> None:
        if self.thread.ident is not None:
            self.thread.join(timeout=120)
        assert not self.thread.is_alive() and not self.errors, self.errors


def controller_kill_scenario(hub: flowrl.RemoteHub, kill: Callable[[], None]) -> None:
    """``kill()`` kills the controller (and waits for its restart) while a lease is held
    and a claim is parked in it. The recovered controller has the same table, consumption
    and leases; the lease holder can still ack; the parked claim is re-sent and served (or
    times out); every sample is then consumed once per task."""
    tags_arr = np.arange(64)
    idx = hub.put(rows(tags_arr))
    tags = dict(zip(idx.tolist(), tags_arr.tolist(), strict=True))
    acked = {"train": Counter[int](), "score": Counter[int]()}
    first = hub.claim("train", 16, timeout=5)
    hub.ack(first)
    acked["train"].update(first.indices.tolist())
    held = hub.claim("train", 16, timeout=5, lease_timeout=60)  # in flight across the kill
    scored = hub.claim("score", 32, timeout=5)
    hub.ack(scored)
    acked["score"].update(scored.indices.tolist())
    before = hub.statistics()

    blocked: list[Any] = []  # a claim parked in the controller when it dies

    def wait_for_more() -> None:
        try:
            blocked.append(hub.claim("score", 64, min_n=33, timeout=20))  # 32 are ready
        except FlowRLError as exc:
            blocked.append(exc)

    waiter = threading.Thread(target=wait_for_more)
    waiter.start()
    time.sleep(0.3)
    kill()

    after = retry(hub.statistics)
    assert after.live == before.live
    assert after.tasks == before.tasks  # ready, leased and consumed per task
    assert after.version == before.version
    retry(hub.ack, held)  # the lease survived: its holder can still ack it
    acked["train"].update(held.indices.tolist())
    more = retry(hub.put, rows(np.arange(64, 80)))  # lets the parked claim through
    tags.update(zip(more.tolist(), range(64, 80), strict=True))
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    (outcome,) = blocked
    if isinstance(outcome, flowrl.BatchMeta):  # re-sent after the restart and served
        hub.ack(outcome)
        acked["score"].update(outcome.indices.tolist())
    else:
        assert isinstance(outcome, Timeout | TransportError)
    hub.end_stream()
    for task, counts in acked.items():
        drain(hub, task, counts, tags)
    assert_each_once(acked, tags)
    assert hub.statistics().live == 0

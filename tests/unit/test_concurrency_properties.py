"""Property tests of claims and acks under concurrency (hypothesis).

Producer threads put GRPO groups, each in two puts (some without their reward, written
member by member later), into a small hub of several storage units, in-process or as
server processes over zmq; consumer threads of two tasks claim whole groups with a
``GroupSampler``, acking most claims and releasing some, until the stream ends. Whatever
the interleaving:

* **exactly once per task**: each task acks every sample put, once; none is lost;
* **whole groups**: every claim holds complete groups, each exactly as it was put;
* **eviction after every task**: at the end the hub is empty and holds no lease.

Every wait is on an event (a put, an ack, the end of the stream); ``GUARD`` only stops a
hung test.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowrl
from flowrl import Column, GroupSampler, HubConfig
from flowrl.errors import EndOfStream

COLS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}
GUARD = 60.0  # a hang guard, not a timing


class Run:
    """One concurrent run: what was put, claimed and acked, and any thread's failure."""

    def __init__(self, hub: Any, group_size: int) -> None:
        self.hub, self.group_size = hub, group_size
        self.lock = threading.Lock()
        self.put_groups: dict[int, list[int]] = {}  # group -> its indices, as put
        self.claims: list[tuple[str, list[int], list[int]]] = []  # task, indices, groups
        self.acked: dict[str, Counter[int]] = {task: Counter() for task in TASKS}
        self.errors: list[BaseException] = []

    def thread(self, fn: Callable[..., None], *args: Any) -> threading.Thread:
        def guarded() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                with self.lock:
                    self.errors.append(exc)

        return threading.Thread(target=guarded, daemon=True)

    def produce(self, first_group: int, n_groups: int, late_reward: list[bool]) -> None:
        """Each group in two puts (its members become ready piecemeal, between other
        producers' puts); a late reward is written member by member."""
        for k in range(n_groups):
            group = first_group + k
            late = late_reward[k % len(late_reward)]
            cut = 1 + k % self.group_size  # members in the first put
            for part in (range(cut), range(cut, self.group_size)):
                if not part:
                    continue
                data: dict[str, Any] = {"ids": [np.arange(1 + j % 3) for j in part]}
                if not late:
                    data["reward"] = np.full(len(part), group, dtype=np.float32)
                idx = self.hub.put(data, groups=np.full(len(part), group), timeout=GUARD)
                with self.lock:
                    self.put_groups.setdefault(group, []).extend(idx.tolist())
                if late:  # 'train' sees a member only once its reward is written
                    for i in idx.tolist():
                        self.hub.put(
                            {"reward": np.full(1, group, dtype=np.float32)},
                            indices=[i],
                            timeout=GUARD,
                        )

    def consume(self, task: str, groups_per_claim: int, release_every: int) -> None:
        sampler = GroupSampler(self.group_size)
        claims = 0
        while True:
            try:
                meta = self.hub.claim(
                    task,
                    groups_per_claim * self.group_size,
                    min_n=self.group_size,  # a full hub may hold fewer ready for this task
                    sampler=sampler,
                    timeout=GUARD,
                )
            except EndOfStream:
                return
            claims += 1
            with self.lock:
                self.claims.append((task, meta.indices.tolist(), meta.groups.tolist()))
            if release_every and claims % release_every == 0:
                self.hub.release(meta)  # back to the front of the queue: delivered again
                continue
            self.hub.ack(meta)
            with self.lock:
                self.acked[task].update(meta.indices.tolist())


def _check(run: Run) -> None:
    assert not run.errors, run.errors
    put = sorted(i for idx in run.put_groups.values() for i in idx)
    for task in TASKS:
        assert run.acked[task] == Counter(put), f"{task}: not each sample exactly once"
    for task, indices, groups in run.claims:
        by_group: dict[int, list[int]] = {}
        for i, g in zip(indices, groups, strict=True):
            by_group.setdefault(g, []).append(i)
        for g, members in by_group.items():
            assert sorted(members) == sorted(run.put_groups[g]), f"{task}: group {g} split"
    stats = run.hub.statistics()
    assert stats.live == 0 and stats.leases == 0, "evicted only after every task acked"


def _exercise(
    make: Callable[[HubConfig], Any],
    n_units: int,
    group_size: int,
    producers: list[int],
    late_reward: list[bool],
    consumers: int,
    groups_per_claim: int,
    release_every: int,
    slack: int,
) -> None:
    # Room for one unfinished group per producer and one whole group more: a full hub
    # always holds a whole group some task can claim, so puts block but never for good.
    capacity = group_size * (len(producers) + 1) + slack
    hub = make(HubConfig(capacity=capacity, n_units=n_units, lease_timeout=GUARD))
    try:
        run = Run(hub, group_size)
        threads = [
            run.thread(run.produce, 1000 * p, n, late_reward) for p, n in enumerate(producers)
        ]
        readers = [
            run.thread(run.consume, task, groups_per_claim, release_every)
            for task in TASKS
            for _ in range(consumers)
        ]
        for t in threads + readers:
            t.start()
        for t in threads:
            t.join(GUARD)
        hub.end_stream()
        for t in readers:
            t.join(GUARD)
        assert not any(t.is_alive() for t in threads + readers), "a thread hung"
        _check(run)
    finally:
        hub.close()


scenarios = {
    "n_units": st.integers(1, 3),
    "group_size": st.integers(1, 3),
    "producers": st.lists(st.integers(1, 6), min_size=1, max_size=3),
    "late_reward": st.lists(st.booleans(), min_size=1, max_size=4),
    "consumers": st.integers(2, 3),
    "groups_per_claim": st.integers(1, 3),
    "release_every": st.sampled_from([0, 2, 3]),  # 0: never (1 would never ack)
    "slack": st.integers(0, 6),
}
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(SETTINGS, max_examples=100)
@given(**scenarios)
def test_threads_over_an_embedded_hub_get_each_sample_once_in_whole_groups(**case: Any) -> None:
    _exercise(lambda config: flowrl.Hub(COLS, tasks=TASKS, config=config), **case)


@pytest.mark.timeout(600)
@settings(SETTINGS, max_examples=3)
@given(**scenarios)
def test_threads_over_server_processes_get_each_sample_once_in_whole_groups(
    **case: Any,
) -> None:
    _exercise(lambda config: flowrl.launch_hub(COLS, tasks=TASKS, config=config), **case)

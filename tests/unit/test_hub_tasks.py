"""Tasks come and go: ``unregister_task`` and tasks scoped to one partition, through the
public client API in-process and over zmq (``make_hub``; the basic unregister runs on Ray
too, in test_hub_behaviour.py). Bad input gets a typed error and changes nothing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl.errors import ConfigError, LeaseError, NothingReady, UnknownTaskError
from flowrl.testing import abandon

COLS = [Column.scalar("x", "int64"), Column.scalar("y", "float32")]
GUARD = 60.0  # a hang guard, not a timing


def rows(n: int, start: int = 0) -> dict[str, Any]:
    return {"x": np.arange(start, start + n), "y": np.zeros(n, dtype=np.float32)}


def _unchanged(hub: Any) -> Any:
    """What a refused call must leave as it was."""
    stats = hub.statistics()
    return stats.tasks, stats.live, stats.leases, stats.partitions, stats.events


def test_a_scoped_task_reads_only_its_partition_and_holds_only_its_samples(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"all": ["x"]})
    hub.register_task("p", ["x"], partition="p")
    hub.put(rows(2), partition="p")
    hub.put(rows(3, 2), partition="q")
    stats = hub.statistics()
    assert stats.tasks["p"] == flowrl.TaskStats(ready=2, leased=0, consumed=0, partition="p")
    assert stats.partitions == {"p": 2, "q": 3}
    hub.ack(hub.claim("all", 5, timeout=GUARD))
    assert hub.statistics().partitions == {"p": 2}  # q's were for 'all' only
    meta = hub.claim("p", 5, min_n=1, timeout=GUARD)
    assert meta.indices.tolist() == [0, 1]
    hub.ack(meta)
    assert hub.statistics().live == 0


def test_a_scoped_task_registered_late_sees_its_partitions_live_samples(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"all": ["x"]})
    hub.put(rows(2), partition="q")
    hub.put(rows(2, 2), partition="p")
    hub.register_task("p", ["x", "y"], partition="p")
    assert hub.claim("p", 4, min_n=1, timeout=GUARD).indices.tolist() == [2, 3]
    assert hub.statistics().tasks["p"].ready == 0


def test_unregister_is_refused_while_the_task_holds_leases(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"], "score": ["x"]})
    hub.put(rows(3))
    meta = hub.claim("train", 2, timeout=GUARD)
    before = _unchanged(hub)
    with pytest.raises(LeaseError, match="holds 1 leases of 2 samples"):
        hub.unregister_task("train")
    assert _unchanged(hub) == before
    hub.ack(meta)  # the lease still counts: nothing was consumed twice or lost
    hub.unregister_task("train")
    assert set(hub.statistics().tasks) == {"score"}


@pytest.mark.parametrize(
    ("task", "error"), [("nope", UnknownTaskError), ("", ConfigError), (3, ConfigError)]
)
def test_unregister_of_a_task_that_is_not_registered_changes_nothing(
    make_hub, task: Any, error: type
) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put(rows(2))
    before = _unchanged(hub)
    with pytest.raises(error):
        hub.unregister_task(task)
    assert _unchanged(hub) == before


@pytest.mark.parametrize("partition", [3, b"p"])
def test_a_bad_partition_is_refused_and_changes_nothing(make_hub, partition: Any) -> None:
    hub = make_hub(columns=COLS)
    before = _unchanged(hub)
    with pytest.raises(ConfigError, match="partition must be a str or None"):
        hub.register_task("t", ["x"], partition=partition)
    assert _unchanged(hub) == before


def test_registering_a_task_again_in_another_partition_is_refused(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.register_task("p", ["x"], partition="p")
    hub.register_task("p", ["x"], partition="p")  # the same again: nothing changes
    before = _unchanged(hub)
    for partition in ("q", None):
        with pytest.raises(ConfigError, match="unregister_task"):
            hub.register_task("p", ["x"], partition=partition)
    with pytest.raises(ConfigError, match="unregister_task"):
        hub.register_task("train", ["x"], partition="p")
    assert _unchanged(hub) == before


def test_unregister_wakes_a_claim_waiting_for_the_task(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"], "other": ["x"]})
    errors: list[BaseException] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        try:
            hub.claim("train", 1, timeout=GUARD)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    started.wait(GUARD)
    # (the claim may reach the hub before or after the unregister: either way it fails)
    hub.unregister_task("train")
    waiter.join(GUARD)
    assert not waiter.is_alive()
    assert [type(e) for e in errors] == [UnknownTaskError]


def test_the_last_task_unregistered_leaves_the_samples(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"train": ["x"]})
    hub.put(rows(2))
    hub.unregister_task("train")
    assert hub.statistics().live == 2  # nobody consumed them: they wait for a new task
    hub.register_task("late", ["x"])
    assert hub.claim("late", 2, timeout=GUARD).indices.tolist() == [0, 1]
    with pytest.raises(NothingReady):
        hub.claim_nowait("late", 1)


def test_forgotten_and_scoped_tasks_survive_a_crash(tmp_path: Path) -> None:
    config = HubConfig(capacity=64, journal=JournalConfig(path=str(tmp_path)))
    hub = flowrl.Hub(COLS, tasks={"train": ["x"], "score": ["x"]}, config=config)
    hub.register_task("step0", ["x"], partition="step0")
    hub.put(rows(4), partition="step0")
    hub.put(rows(2, 4), partition="step1")
    for task in ("train", "score"):
        hub.ack(hub.claim(task, 6, timeout=GUARD))
    assert hub.statistics().partitions == {"step0": 4}  # step1's: nobody else reads them
    hub.unregister_task("step0")  # evicts step0's
    hub.unregister_task("score")
    hub.register_task("step2", ["x"], partition="step2")
    hub.put(rows(2, 6), partition="step2")
    before = hub.statistics()
    abandon(hub)  # -- crash: nothing is closed or flushed --
    again = flowrl.Hub(config=config)
    after = again.statistics()
    assert after.tasks == before.tasks
    assert set(after.tasks) == {"train", "step2"}
    assert after.live == before.live == 2
    assert after.partitions == before.partitions == {"step2": 2}
    with pytest.raises(UnknownTaskError):
        again.claim_nowait("score", 1)
    assert again.claim("step2", 2, timeout=GUARD).indices.tolist() == [6, 7]
    again.register_task("score", ["x"])  # the name is free again
    assert again.statistics().tasks["score"].ready == 2
    again.close()


@pytest.mark.parametrize("snapshot", [False, True], ids=["replayed", "from-snapshot"])
def test_a_reopened_hub_does_not_bring_back_a_task_unregistered_since(
    tmp_path: Path, snapshot: bool
) -> None:
    # The program that reopens its journal passes the tasks it was started with; one it
    # unregistered since must stay so (registered anew it would take its own acked
    # samples, still live for the other task, as new: delivered twice).
    config = HubConfig(capacity=64, journal=JournalConfig(path=str(tmp_path)))
    tasks = {"train": ["x"], "score": ["x"]}
    hub = flowrl.Hub(COLS, tasks=tasks, config=config)
    hub.put(rows(4))
    hub.ack(hub.claim("score", 4, timeout=GUARD))
    hub.unregister_task("score")
    hub.register_task("late", ["x"])
    hub.unregister_task("late")
    hub.register_task("late", ["x"])  # registered again since: stays
    if snapshot:
        hub._control.journal.compact(hub.controller)  # type: ignore[attr-defined]
    abandon(hub)
    again = flowrl.Hub(COLS, tasks={**tasks, "late": ["x"]}, config=config)
    assert set(again.statistics().tasks) == {"train", "late"}
    assert again.statistics().tasks["train"].ready == 4
    again.register_task("score", ["x"])  # asked for by name: a new task, as before
    again.close()
    fresh = flowrl.Hub(COLS, tasks=tasks, config=HubConfig(capacity=64))
    assert set(fresh.statistics().tasks) == {"train", "score"}  # no journal: all of them
    fresh.close()


def test_a_launched_hub_reopening_its_journal_does_not_bring_back_a_task(tmp_path: Path) -> None:
    config = HubConfig(capacity=64, journal=JournalConfig(path=str(tmp_path)))
    tasks = {"train": ["x"], "score": ["x"]}
    hub = flowrl.launch_hub(COLS, tasks=tasks, config=config)
    try:
        hub.put(rows(4))
        hub.ack(hub.claim("score", 4, timeout=GUARD))
        hub.unregister_task("score")
    finally:
        hub.close()
    again = flowrl.launch_hub(COLS, tasks=tasks, config=config)
    try:
        assert set(again.statistics().tasks) == {"train"}
        assert again.statistics().tasks["train"].ready == 4
    finally:
        again.close()

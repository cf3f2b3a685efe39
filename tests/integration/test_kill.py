"""Kill tests: SIGKILL a consumer, a storage unit and the controller; account for every sample.

Each test counts, per task, which sample indices were acknowledged: every sample that was
produced must be acknowledged exactly once per task, across the kill and the recovery.
Servers of a journaled ``launch_hub`` are restarted by its supervisor; clients reconnect
by themselves, and a call caught by the kill either raises a typed error (retried here) or
is retried by the client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kill_scenarios import (
    COLS,
    TASKS,
    Producer,
    assert_each_once,
    controller_kill_scenario,
    drain,
    rows,
)

import flowrl
from flowrl import HubConfig, JournalConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def journaled(path: Path, compact_bytes: int = 64 << 20, **kw: Any) -> flowrl.RemoteHub:
    journal = JournalConfig(path=str(path), compact_bytes=compact_bytes)
    config = HubConfig(capacity=1024, lease_timeout=2.0, journal=journal, **kw)
    hub = flowrl.launch_hub(COLS, tasks=TASKS, config=config)
    hub.rpc_timeout = 3.0  # notice a dead server in seconds, not the default 30
    return hub


def wait_restarted(hub: flowrl.RemoteHub, restarts: int) -> None:
    deadline = time.monotonic() + 30
    while hub.servers.restarts < restarts:
        assert time.monotonic() < deadline, "the supervisor did not restart the server"
        time.sleep(0.05)


def test_a_killed_consumer_process_loses_nothing() -> None:
    """A consumer SIGKILLed mid-batch: its lease expires and another consumer gets the samples."""
    hub = flowrl.launch_hub(COLS, tasks=TASKS, config=HubConfig(lease_timeout=1.0))
    try:
        tags = np.arange(40)
        idx = hub.put(rows(tags))
        code = textwrap.dedent(
            """
            import sys, time, flowrl
            hub = flowrl.connect(sys.argv[1])
            meta = hub.claim("train", 8, timeout=10)
            print(" ".join(map(str, meta.indices.tolist())), flush=True)
            time.sleep(60)  # mid-batch: killed here
            """
        )
        victim = subprocess.Popen(
            [sys.executable, "-c", code, hub.address], stdout=subprocess.PIPE, text=True
        )
        assert victim.stdout is not None
        held = [int(i) for i in victim.stdout.readline().split()]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        assert len(held) == 8
        hub.end_stream()
        acked: Counter[int] = Counter()
        drain(hub, "train", acked, dict(zip(idx.tolist(), tags.tolist(), strict=True)))
        assert sorted(acked) == idx.tolist()
        assert set(acked.values()) == {1}
    finally:
        hub.close()


def test_a_killed_storage_unit_restarts_with_its_bytes(tmp_path: Path) -> None:
    """Producer and consumer keep going while a storage unit is SIGKILLed and restarted."""
    hub = journaled(tmp_path, n_units=2)
    producer = Producer(hub)
    try:
        producer.start_and_wait_for(40)
        os.kill(hub.servers.procs[0].pid, signal.SIGKILL)
        wait_restarted(hub, 1)
        producer.join()
        hub.end_stream()
        acked: Counter[int] = Counter()
        drain(hub, "train", acked, producer.tags)
        assert_each_once({"train": acked}, producer.tags)
        assert len(producer.tags) == 120
    finally:
        producer.join()
        hub.close()


@pytest.mark.parametrize("compact_bytes", [64 << 20, 256], ids=["log", "snapshots"])
def test_a_killed_controller_recovers_leases_and_consumption(
    tmp_path: Path, compact_bytes: int
) -> None:
    """With ``snapshots`` the journal is compacted after nearly every request: the restarted
    controller recovers from a snapshot plus the few events after it (F8, issue 16)."""
    hub = journaled(tmp_path, compact_bytes)

    def kill() -> None:
        if compact_bytes < 1024:
            assert (tmp_path / "snapshot.msgpack").exists()  # it recovers from one
        os.kill(hub.servers.procs[-1].pid, signal.SIGKILL)
        wait_restarted(hub, 1)

    try:
        controller_kill_scenario(hub, kill)
    finally:
        hub.close()


def test_a_task_unregistered_before_the_controller_was_killed_stays_forgotten(
    tmp_path: Path,
) -> None:
    """The restarted controller recovers from its journal; the launch's ``tasks=`` must not
    register again a task unregistered since."""
    hub = journaled(tmp_path)
    try:
        hub.put({"ids": [[1], [2, 3]], "tag": np.zeros(2, dtype=np.int64)})
        hub.unregister_task("score")
        os.kill(hub.servers.procs[-1].pid, signal.SIGKILL)
        wait_restarted(hub, 1)
        deadline = time.monotonic() + 30
        while True:
            try:
                stats = hub.statistics()
                break
            except flowrl.errors.FlowRLError:  # (reconnecting)
                assert time.monotonic() < deadline
        assert set(stats.tasks) == set(TASKS) - {"score"}
        assert stats.tasks["train"].ready == 2
    finally:
        hub.close()


@pytest.mark.parametrize("journal", [False, True])
def test_a_killed_storage_units_shared_memory_is_removed(tmp_path: Path, journal: bool) -> None:
    """F9 (issue 16): a SIGKILLed unit left its /dev/shm arena behind."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    from flowrl._store.shm import SHM_MIN_BYTES

    config = HubConfig(n_units=2, journal=JournalConfig(path=str(tmp_path)) if journal else None)
    big = flowrl.Column.tensor("big", "uint8", (SHM_MIN_BYTES,))
    hub = flowrl.launch_hub([big], tasks={"t": ["big"]}, config=config)
    try:
        hub.put({"big": np.ones((2, SHM_MIN_BYTES), np.uint8)})  # a put big enough for shm
        arenas = [hub.servers.specs[u].shm_folder for u in range(2)]
        segments = [os.listdir(a) for a in arenas]
        victim = next(u for u, segs in enumerate(segments) if len(segs) > 1)  # owner + one
        os.kill(hub.servers.procs[victim].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        gone = {f"{arenas[victim]}/{s}" for s in segments[victim] if s != "owner"}
        while any(os.path.exists(p) for p in gone):
            assert time.monotonic() < deadline, f"{arenas[victim]} still holds {gone}"
            time.sleep(0.05)
        assert os.listdir(arenas[1 - victim]) == segments[1 - victim]  # the live unit's
    finally:
        hub.close()

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


def journaled(path: Path, **kw: Any) -> flowrl.RemoteHub:
    config = HubConfig(
        capacity=1024, lease_timeout=2.0, journal=JournalConfig(path=str(path)), **kw
    )
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


def test_a_killed_controller_recovers_leases_and_consumption(tmp_path: Path) -> None:
    hub = journaled(tmp_path)

    def kill() -> None:
        os.kill(hub.servers.procs[-1].pid, signal.SIGKILL)
        wait_restarted(hub, 1)

    try:
        controller_kill_scenario(hub, kill)
    finally:
        hub.close()

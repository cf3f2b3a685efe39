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
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._transport import remote
from flowrl.errors import EndOfStream, FlowRLError, Timeout, TransportError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COLS = [Column.ragged("ids", "int64"), Column.scalar("tag", "int64")]
TASKS = {"train": ["ids", "tag"], "score": ["tag"]}


def journaled(path: Path, **kw: Any) -> flowrl.RemoteHub:
    config = HubConfig(
        capacity=1024, lease_timeout=2.0, journal=JournalConfig(path=str(path)), **kw
    )
    hub = flowrl.launch_hub(COLS, tasks=TASKS, config=config)
    hub.rpc_timeout = 3.0  # notice a dead server in seconds, not the default 30
    return hub


def rows(tags: np.ndarray) -> dict[str, Any]:
    return {"ids": [np.arange(t % 7 + 1) + t for t in tags.tolist()], "tag": tags}


def retry(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call through a server restart: typed transport errors are retried, nothing else."""
    for _ in range(20):
        try:
            return fn(*args, **kwargs)
        except TransportError:
            time.sleep(0.2)
    raise AssertionError(f"{fn.__name__} kept failing")


def wait_restarted(hub: flowrl.RemoteHub, restarts: int) -> None:
    deadline = time.monotonic() + 30
    while hub.servers.restarts < restarts:
        assert time.monotonic() < deadline, "the supervisor did not restart the server"
        time.sleep(0.05)


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
    tags: dict[int, int] = {}
    acked: Counter[int] = Counter()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for k in range(30):
                batch = np.arange(4 * k, 4 * k + 4)
                idx = retry(hub.put, rows(batch))  # a failed put committed nothing: re-put
                tags.update(zip(idx.tolist(), batch.tolist(), strict=True))
                time.sleep(0.01)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        while len(tags) < 40:
            time.sleep(0.01)
        os.kill(hub.servers.procs[0].pid, signal.SIGKILL)
        wait_restarted(hub, 1)
        producer.join(timeout=120)
        assert not producer.is_alive() and not errors, errors
        hub.end_stream()
        drain(hub, "train", acked, tags)
        assert sorted(acked) == sorted(tags)
        assert set(acked.values()) == {1}
        assert len(tags) == 120
    finally:
        hub.close()


def test_a_killed_controller_recovers_leases_and_consumption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "CLAIM_SLICE_S", 1.0)  # notice the restart quickly
    hub = journaled(tmp_path)
    try:
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
        os.kill(hub.servers.procs[-1].pid, signal.SIGKILL)
        wait_restarted(hub, 1)

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
            assert sorted(counts) == sorted(tags), task
            assert set(counts.values()) == {1}, task
        assert hub.statistics().live == 0
    finally:
        hub.close()

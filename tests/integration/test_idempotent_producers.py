"""Idempotent producers under kills (issue 26, item 5): producer processes are SIGKILLed
mid-put and restarted under the same name; each re-sends every put it never saw answered
(some of which had landed), and the controller is killed and recovers from its journal
meanwhile. Every sample lands exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PUTS = 150  # per producer, one sample each
PRODUCERS = 3

#: A producer: puts PUTS samples (value = its number * 100000 + seq) with up to 16
#: put_async in flight, and appends each answered seq to its checkpoint file, in order.
#: Started again, it resumes after the last seq in the file: the puts in flight when it
#: died are sent again. A put that fails (the controller restarting) is sent again too.
PRODUCER = textwrap.dedent(
    """
    import collections, contextlib, os, sys, time
    import flowrl
    address, name, checkpoint = sys.argv[1], sys.argv[2], sys.argv[3]
    base = int(name.rsplit("-", 1)[1]) * 100000
    hub = flowrl.connect(address)
    hub.rpc_timeout = 3.0
    done = open(checkpoint).read().split() if os.path.exists(checkpoint) else []
    log = open(checkpoint, "a")
    seq = int(done[-1]) + 1 if done else 0
    pending = collections.deque()
    while seq < PUTS or pending:
        try:
            while seq < PUTS and len(pending) < 16:
                fut = hub.put_async({"x": [base + seq]}, producer=name, seq=seq)
                pending.append((seq, fut))
                seq += 1
            oldest, fut = pending[0]
            fut.result()
            pending.popleft()
            log.write(f"{oldest}\\n")
            log.flush()
        except flowrl.errors.FlowRLError:
            with contextlib.suppress(flowrl.errors.FlowRLError):
                hub.flush(30)  # (reports the other failed ones, so none is raised later)
            seq = pending[0][0] if pending else seq
            pending.clear()
            time.sleep(0.2)
    hub.close()
    """
).replace("PUTS", str(PUTS))


def _acked(checkpoint: Path) -> int:
    return len(checkpoint.read_text().split()) if checkpoint.exists() else 0


def _wait_for(what: str, ok: Callable[[], bool], limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_killed_producers_re_send_their_puts_and_each_lands_once(tmp_path: Path) -> None:
    journal = JournalConfig(path=str(tmp_path / "journal"))
    config = HubConfig(capacity=1024, n_units=2, lease_timeout=5.0, journal=journal)
    hub = flowrl.launch_hub([Column.scalar("x", "int64")], tasks={"train": ["x"]}, config=config)
    hub.rpc_timeout = 5.0
    names = [f"producer-{p}" for p in range(PRODUCERS)]
    checkpoints = {n: tmp_path / f"{n}.acked" for n in names}

    def start(name: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", PRODUCER, hub.address, name, str(checkpoints[name])]
        return subprocess.Popen(argv)

    procs = {n: start(n) for n in names}
    kills = 0
    try:
        for point in (30, 80):  # kill every producer mid-stream twice, restart it at once
            for name in names:
                _wait_for(
                    f"{name} to put {point}", lambda n=name, k=point: _acked(checkpoints[n]) >= k
                )
                os.kill(procs[name].pid, signal.SIGKILL)
                procs[name].wait(30)
                procs[name] = start(name)
                kills += 1
            if point == 30:  # and the controller once: it recovers the windows from its journal
                os.kill(hub.servers.procs[-1].pid, signal.SIGKILL)
                _wait_for("the controller's restart", lambda: hub.servers.restarts >= 1)
        for name, proc in procs.items():
            assert proc.wait(180) == 0, f"{name} failed"
            assert _acked(checkpoints[name]) == PUTS
        hub.end_stream()
        seen: Counter[int] = Counter()
        while True:
            try:
                meta = hub.claim("train", 128, min_n=1, timeout=30)
            except flowrl.errors.EndOfStream:
                break
            seen.update(hub.get(meta)["x"].tolist())
            hub.ack(meta)
        expected = {p * 100000 + s for p in range(PRODUCERS) for s in range(PUTS)}
        duplicated = {v: c for v, c in seen.items() if c > 1}
        assert not duplicated, f"put more than once: {duplicated}"
        assert set(seen) == expected, f"lost: {sorted(expected - set(seen))[:10]}"
        assert kills == 2 * PRODUCERS
        print(
            f"re-sent puts dropped since the controller's restart: "
            f"{hub.statistics().duplicate_puts}"
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        hub.close()

"""A zmq client used from many short-lived threads holds a bounded number of sockets
(issue 26, item 1): an ended thread's sockets go to the next new thread.

Before, each thread opened two sockets (controller, storage unit) and never closed them:
after ~510 threads zmq refused new sockets with an untyped ``ZMQError: Too many open
files`` and ``hub.close()`` failed too.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig
from flowrl.errors import ResourceExhausted

pytestmark = [pytest.mark.integration, pytest.mark.slow]

THREADS = 10_000
AT_ONCE = 64
#: Descriptors a live thread may cost: a socket to the controller and one to the unit,
#: each with its mailbox and its connection (2 descriptors per zmq socket).
PER_THREAD_FDS = 2 * 2
#: Descriptors of anything else the client and zmq may open meanwhile.
SLACK_FDS = 64


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def hub() -> Iterator[Any]:
    hub = flowrl.launch_hub(
        [Column.scalar("x", "int64")],
        tasks={"train": ["x"]},
        config=HubConfig(capacity=2 * THREADS + 1024),
    )
    yield hub
    hub.close()


def churn(hub: Any, threads: int, at_once: int) -> int:
    """Put one sample from each of ``threads`` threads, ``at_once`` alive at a time;
    return the most descriptors open after a wave, and re-raise a thread's failure."""
    errors: list[BaseException] = []

    def put(k: int) -> None:
        try:
            hub.put({"x": np.array([k])})
        except BaseException as exc:
            errors.append(exc)

    most = 0
    for start in range(0, threads, at_once):
        wave = [
            threading.Thread(target=put, args=(k,))
            for k in range(start, min(threads, start + at_once))
        ]
        for t in wave:
            t.start()
        for t in wave:
            t.join()
        if errors:
            raise errors[0]
        most = max(most, open_fds())
    return most


@pytest.mark.parametrize("at_once", [1, AT_ONCE])
def test_short_lived_threads_keep_sockets_bounded(hub: Any, at_once: int) -> None:
    before = open_fds()
    most = churn(hub, THREADS, at_once)
    assert most - before <= at_once * PER_THREAD_FDS + SLACK_FDS
    assert hub.statistics().tasks["train"].ready == THREADS  # every put landed
    meta = hub.claim("train", THREADS, timeout=30)
    assert sorted(hub.get(meta)["x"].tolist()) == list(range(THREADS))


def test_running_out_of_descriptors_raises_a_typed_error(hub: Any) -> None:
    """Threads that cannot open their sockets get ResourceExhausted (was an untyped
    ZMQError), the others' puts land, and close() still stops the servers."""
    hub.put({"x": np.array([-1])})
    hub.rpc_timeout = 5.0  # a put whose connection zmq could not open waits this long
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for a few threads' sockets, not for 20
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 6 * PER_THREAD_FDS, hard))
    try:
        gate = threading.Event()
        outcomes: list[Any] = []

        def put(k: int) -> None:
            try:
                outcomes.append(hub.put({"x": np.array([k])}))
            except BaseException as exc:
                outcomes.append(exc)
            gate.wait()  # alive until every thread tried: each needs its own sockets

        threads = [threading.Thread(target=put, args=(k,)) for k in range(20)]
        for t in threads:
            t.start()
        while len(outcomes) < len(threads):
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join()
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed, "20 threads' sockets fit in the lowered limit: the test proves nothing"
        for exc in failed:
            assert isinstance(exc, ResourceExhausted), repr(exc)
            assert "ulimit" in str(exc)
        landed = len(outcomes) - len(failed)
        assert hub.statistics().tasks["train"].ready == 1 + landed
        servers = hub.servers.procs
        hub.close()  # with the limit still low
        assert all(p.poll() is not None for p in servers)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

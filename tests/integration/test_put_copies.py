"""A put over zmq copies its payload once: into the storage unit's lent memory, not first
into a private copy of the caller's arrays (on this kind of machine fresh memory costs
as much as the copy itself)."""

from __future__ import annotations

import tracemalloc

import numpy as np

import flowrl
from flowrl import Column

ROWS, WIDTH = 64, 8192  # 4 MiB a put


def test_a_waiting_put_over_zmq_does_not_copy_the_callers_arrays_first() -> None:
    hub = flowrl.launch_hub([Column.tensor("x", "int64", (WIDTH,))], tasks={"train": ["x"]})
    try:
        data = {"x": np.ones((ROWS, WIDTH), dtype=np.int64)}
        hub.put(data)  # grants, connections
        tracemalloc.start()
        try:
            hub.put(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < data["x"].nbytes / 4, f"a put allocated {peak} bytes"
    finally:
        hub.close()


def test_a_put_async_through_lent_memory_copies_once_and_the_caller_may_reuse_its_arrays() -> None:
    """put_async returns before its answer: the caller may change its arrays at once. The
    copy into the unit's lent memory is the put's own (no private copy first)."""
    hub = flowrl.launch_hub([Column.tensor("x", "int64", (WIDTH,))], tasks={"train": ["x"]})
    try:
        data = {"x": np.ones((ROWS, WIDTH), dtype=np.int64)}
        hub.put(data)
        tracemalloc.start()
        try:
            fut = hub.put_async(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        data["x"][:] = -1  # before the put is answered
        fut.result()
        assert peak < data["x"].nbytes / 4, f"a put_async allocated {peak} bytes"
        hub.ack(hub.claim("train", ROWS, timeout=5))
        meta = hub.claim("train", ROWS, timeout=5)
        assert (hub.get(meta)["x"] == 1).all()
    finally:
        hub.close()


def test_a_put_async_sent_as_frames_is_copied_before_it_returns() -> None:
    """A unit on another machine (TCP) lends no memory: the frames go out zero-copy after
    put_async returns, so the put copies them first."""
    hub = flowrl.launch_hub(
        [Column.tensor("x", "int64", (WIDTH,))], tasks={"train": ["x"]}, host="127.0.0.1"
    )
    try:
        data = {"x": np.ones((ROWS, WIDTH), dtype=np.int64)}
        futures = []
        for _ in range(4):
            data["x"][:] = 1
            futures.append(hub.put_async(data))
            data["x"][:] = -1  # at once, while the frames may still be queued
        for fut in futures:
            fut.result()
        meta = hub.claim("train", 4 * ROWS, timeout=5)
        assert (hub.get(meta)["x"] == 1).all()
    finally:
        hub.close()

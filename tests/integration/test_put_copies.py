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
        tracemalloc.start()
        try:
            hub.put_async(data).result()  # the caller may reuse its arrays at once: a copy
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak >= data["x"].nbytes
    finally:
        hub.close()

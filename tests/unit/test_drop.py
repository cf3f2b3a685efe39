"""hub.drop(): a filter discards samples for every later task, and they are evicted."""

from __future__ import annotations

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.events import Acked

COLS = [Column.scalar("x", "int64"), Column.scalar("y", "int64")]


def test_drop_discards_for_other_tasks_and_evicts(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"filter": ["x"], "train": ["x"], "late": ["x", "y"]})
    idx = hub.put({"x": np.arange(6)})
    meta = hub.claim("filter", 6, timeout=5)
    hub.drop(meta, idx[:4])
    hub.ack(meta, idx[4:])
    stats = hub.statistics()
    assert stats.live == 2 and stats.tasks["train"].ready == 2
    assert stats.tasks["late"].consumed == 4  # pending (no y yet) samples are dropped too
    got = hub.claim("train", 2, timeout=5)
    assert got.indices.tolist() == idx[4:].tolist()


def test_a_task_that_already_leased_a_dropped_sample_finishes_it(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={"filter": ["x"], "train": ["x"]})
    hub.put({"x": np.arange(2)})
    leased = hub.claim("train", 2, timeout=5)
    meta = hub.claim("filter", 2, timeout=5)
    hub.drop(meta)
    assert hub.statistics().live == 2  # train still holds them
    assert hub.get(leased)["x"].tolist() == [0, 1]
    hub.ack(leased)
    assert hub.statistics().live == 0


def test_drop_is_an_acked_event_marked_dropped() -> None:
    hub = flowrl.Hub(COLS, tasks={"filter": ["x"], "train": ["x"]})
    seen: list = []
    hub.subscribe(seen.append)
    hub.put({"x": np.arange(3)})
    hub.drop(hub.claim("filter", 3, timeout=5))
    hub.flush_events()
    acks = [e for e in seen if isinstance(e, Acked)]
    assert len(acks) == 1 and acks[0].dropped
    idx = hub.put({"x": [7]})
    with pytest.raises(flowrl.errors.LeaseError, match=r"meta\(\)"):
        hub.drop(hub.meta(idx, ["x"]))  # an unleased handle cannot drop
    hub.close()

"""hub.put_batcher under every placement: puts gathered into one, their data intact and in
order, bad input refused at once, held puts sent on flush / close / result / when full."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError, HubFull, SchemaError

COLS = [
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
    Column.tensor("emb", "float32", (3,)),
    Column.scalar("ok", "bool"),
    Column.string("text"),
]
TASKS = {"train": ["ids", "reward", "emb", "ok", "text"]}
GUARD = 5.0


def batch(i: int, n: int = 3) -> dict[str, Any]:
    """Put ``i`` of ``n`` samples, each value telling which put and sample it came from."""
    rows = range(i * 10, i * 10 + n)
    return {
        "ids": [np.arange(r % 7 + 1, dtype=np.int64) + 1000 * r for r in rows],
        "reward": np.array(rows, np.float32),
        "emb": np.array([[r, -r, 0.5] for r in rows], np.float32),
        "ok": np.array([r % 2 == 0 for r in rows]),
        "text": [f"put {i} row {r}" for r in rows],
    }


def stored(hub: Any, n: int) -> dict[str, list[Any]]:
    meta = hub.claim("train", n, timeout=GUARD)
    assert len(meta) == n
    got = hub.get(meta)
    out = {
        "indices": meta.indices.tolist(),
        "ids": [s.tolist() for s in got["ids"]],
        "reward": got["reward"].tolist(),
        "emb": np.asarray(got["emb"]).tolist(),
        "ok": list(got["ok"]),
        "text": list(got["text"]),
    }
    hub.ack(meta)
    return out


def expected(puts: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {
        "ids": [s.tolist() for p in puts for s in p["ids"]],
        "reward": [float(x) for p in puts for x in p["reward"]],
        "emb": [row.tolist() for p in puts for row in p["emb"]],
        "ok": [bool(x) for p in puts for x in p["ok"]],
        "text": [t for p in puts for t in p["text"]],
    }


def test_batched_puts_land_once_in_order_with_their_data(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    puts = [batch(i, n=1 + i % 4) for i in range(20)]
    with hub.put_batcher(max_puts=8) as batcher:
        held = [batcher.put(p) for p in puts]
    n = sum(len(p["reward"]) for p in puts)
    got = stored(hub, n)
    assert {k: v for k, v in got.items() if k != "indices"} == expected(puts)
    # each put's future names its own samples, in the order they were put
    assert np.concatenate([h.result(GUARD) for h in held]).tolist() == got["indices"]
    assert all(h.done() and h.exception() is None for h in held)
    assert hub.statistics().live == 0


def test_puts_are_held_until_full_then_sent_as_one(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    batcher = hub.put_batcher(max_puts=3)
    first = [batcher.put(batch(i)) for i in range(2)]
    assert batcher.held == 2 and all(h.indices is None for h in first)
    assert hub.statistics().tasks["train"].ready == 0  # held: not on the hub yet
    third = batcher.put(batch(2))
    assert batcher.held == 0
    ids = [h.indices for h in (*first, third)]
    assert all(i is not None and i.size == 3 for i in ids)
    assert np.unique(np.concatenate(ids)).size == 9
    batcher.flush(GUARD)
    assert hub.statistics().tasks["train"].ready == 9


def test_max_bytes_sends_early(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    with hub.put_batcher(max_puts=100, max_bytes=1) as batcher:
        batcher.put(batch(0))
        assert batcher.held == 0  # one put is over a byte: sent at once


def test_result_of_a_held_put_sends_it(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    batcher = hub.put_batcher(max_puts=100)
    held = batcher.put(batch(0))
    assert held.result(GUARD).size == 3
    assert batcher.held == 0
    assert hub.statistics().tasks["train"].ready == 3
    batcher.close()


def test_bad_input_raises_at_once_and_holds_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    with hub.put_batcher() as batcher:
        batcher.put(batch(0))
        bad = batch(1)
        bad["reward"] = bad["reward"].astype(np.float64)
        with pytest.raises(SchemaError, match="reward"):
            batcher.put(bad)
        with pytest.raises(ConfigError, match="partition"):
            batcher.put(batch(2), partition=3)  # type: ignore[arg-type]
        short = batch(3)
        short["text"] = short["text"][:2]
        with pytest.raises(flowrl.FlowRLError, match="text"):
            batcher.put(short)
        assert batcher.held == 1
    assert stored(hub, 3)["reward"] == [0.0, 1.0, 2.0]
    assert hub.statistics().live == 0


def test_caller_may_change_its_arrays_right_after_put(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    puts = [batch(i) for i in range(12)]
    originals = expected(puts)
    with hub.put_batcher(max_puts=4) as batcher:  # three sends: the buffers are reused
        for p in puts:
            batcher.put(p)
            for seq in p["ids"]:
                seq[:] = -1
            p["reward"][:] = -1
            p["emb"][:] = -1
    got = stored(hub, 36)
    assert {k: v for k, v in got.items() if k != "indices"} == originals


def test_options_that_differ_are_not_mixed(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks={**TASKS, "b": ["reward"]})
    hub.register_task("only_b", ["reward"], partition="b")
    with hub.put_batcher(max_puts=100) as batcher:
        a = batcher.put(batch(0), version=1, groups=7)
        b = batcher.put(batch(1), version=2, groups=[8, 8, 9])
        assert batcher.held == 2  # both carry versions and groups: one put
        c = batcher.put(batch(2))  # no version, no groups: the two above go first
        assert a.indices is not None and b.indices is not None and c.indices is None
        d = batcher.put(batch(3), partition="b")
        assert c.indices is not None and d.indices is None
    meta = hub.claim("train", 9, timeout=GUARD)
    versions = dict(zip(meta.indices.tolist(), meta.versions.tolist(), strict=True))
    groups = dict(zip(meta.indices.tolist(), meta.groups.tolist(), strict=True))
    assert [versions[i] for i in a.result()] == [1, 1, 1]
    assert [versions[i] for i in b.result()] == [2, 2, 2]
    assert [groups[i] for i in (*a.result(), *b.result())] == [7, 7, 7, 8, 8, 9]
    hub.ack(meta)
    only_b = hub.claim("only_b", 3, timeout=GUARD)
    assert only_b.indices.tolist() == d.result().tolist()
    hub.ack(only_b)


def test_a_send_the_hub_refuses_fails_every_held_put_and_changes_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS, config=flowrl.HubConfig(capacity=4))
    batcher = hub.put_batcher(max_puts=2, timeout=0.0)
    first = batcher.put(batch(0))
    before = hub.statistics()
    with pytest.raises(HubFull):
        batcher.put(batch(1))  # 6 samples for a hub of 4: refused when sent
    for held in (first,):
        assert isinstance(held.exception(), HubFull)
        with pytest.raises(HubFull):
            held.result()
    assert batcher.held == 0
    assert hub.statistics() == before
    batcher.put(batch(2, n=2))
    batcher.close()
    assert hub.statistics().tasks["train"].ready == 2


def test_batcher_belongs_to_its_thread_and_refuses_puts_after_close(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    batcher = hub.put_batcher()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            batcher.put(batch(0))
        except ConfigError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "thread" in str(errors[0])
    batcher.close()
    with pytest.raises(ConfigError, match="close"):
        batcher.put(batch(0))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="max_puts"):
            hub.put_batcher(max_puts=bad)
    assert hub.statistics().live == 0


def test_a_put_that_declares_columns_is_sent_at_once(make_hub) -> None:
    hub = make_hub(config=flowrl.HubConfig(infer_columns=True))
    with hub.put_batcher(max_puts=100) as batcher:
        first = batcher.put({"x": np.arange(3, dtype=np.int64)})
        assert batcher.held == 0 and first.indices is not None  # declared "x": sent
        second = batcher.put({"x": np.arange(2, dtype=np.int64)})
        assert batcher.held == 1 and second.indices is None
    assert second.result().size == 2


def test_closing_the_hub_or_dropping_the_batcher_sends_what_it_holds(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    batcher = hub.put_batcher(max_puts=100)
    held = batcher.put(batch(0))
    del batcher  # dropped unflushed, in its thread: sent
    assert held.indices is not None
    assert held.result(GUARD).size == 3
    hub.put_batcher(max_puts=100).put(batch(1))  # (that batcher is garbage at once)
    hub.flush(GUARD)
    assert hub.statistics().tasks["train"].ready == 6
    batcher = hub.put_batcher(max_puts=100)
    batcher.put(batch(2))
    hub.close()  # sends what the live batcher holds before the hub goes
    assert batcher.held == 0

"""Idempotent puts (issue 26, item 5): a put that names its producer and a sequence number
lands once, however often it is re-sent — in-process and over zmq, put and put_async,
new samples and updates, across journal replay and compaction. Killed producer processes
re-sending their unanswered puts: tests/integration/test_idempotent_producers.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._controller.producers import Producers
from flowrl.errors import ConfigError, DuplicatePut
from flowrl.testing import abandon

COLS = [Column.scalar("x", "int64")]
TASKS = {"train": ["x"]}
GUARD = 10.0


def xs(*values: int) -> dict[str, Any]:
    return {"x": np.array(values, dtype=np.int64)}


def drain(hub: Any, task: str = "train") -> list[int]:
    """Every value the task is delivered until the stream ends."""
    hub.end_stream()
    seen: list[int] = []
    while True:
        try:
            meta = hub.claim(task, 64, min_n=1, timeout=GUARD)
        except flowrl.errors.EndOfStream:
            return sorted(seen)
        seen += hub.get(meta)["x"].tolist()
        hub.ack(meta)


def test_a_re_sent_put_lands_once_and_answers_as_the_first(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS, config=HubConfig(n_units=2))
    first = hub.put(xs(1, 2), producer="p", seq=0)
    again = hub.put(xs(1, 2), producer="p", seq=0)
    assert again.tolist() == first.tolist()
    assert hub.put(xs(3), producer="p", seq=np.int64(1)).size == 1  # numpy ints are ints
    assert hub.put(xs(4), producer="q", seq=0).size == 1  # another producer's own numbers
    hub.put(xs(5), producer="p")  # no seq: not idempotent, never deduplicated
    hub.put(xs(5), producer="p")
    stats = hub.statistics()
    assert stats.live == 6 and stats.duplicate_puts == 1
    assert drain(hub) == [1, 2, 3, 4, 5, 5]


def test_re_sent_put_async_lands_once_across_units(make_hub) -> None:
    """A producer re-sends all of its pipelined puts, some twice, while the first ones
    are in flight: each lands once, and each future answers with the first's indices."""
    hub = make_hub(columns=COLS, tasks=TASKS, config=HubConfig(n_units=2))
    first = [hub.put_async(xs(s), producer="p", seq=s) for s in range(40)]
    again = [hub.put_async(xs(s), producer="p", seq=s) for s in range(0, 40, 2)]
    hub.flush(GUARD)
    answers = {s: f.result(GUARD).tolist() for s, f in enumerate(first)}
    assert all(f.result(GUARD).tolist() == answers[2 * i] for i, f in enumerate(again))
    assert hub.statistics().duplicate_puts == 20
    assert drain(hub) == list(range(40))


def test_puts_of_one_producer_may_land_out_of_order(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    late = hub.put(xs(5), producer="p", seq=5)
    early = hub.put(xs(3), producer="p", seq=3)  # a gap, filled later: lands
    assert hub.put(xs(3), producer="p", seq=3).tolist() == early.tolist()
    assert hub.put(xs(5), producer="p", seq=5).tolist() == late.tolist()
    assert drain(hub) == [3, 5]


def test_a_re_sent_update_that_acked_its_claim_answers_as_the_first(make_hub) -> None:
    """A stage's output put (to its claim's samples, acking the claim) re-sent after it
    landed: answered with the same samples, not a LeaseError, and not applied again."""
    cols = [*COLS, Column.scalar("y", "int64")]
    hub = make_hub(columns=cols, tasks={"score": ["x"], "train": ["x", "y"]})
    hub.put(xs(1, 2))
    meta = hub.claim("score", 2, timeout=GUARD)
    out = hub.put({"y": [10, 20]}, indices=meta, ack=meta, producer="score", seq=0)
    again = hub.put({"y": [-1, -1]}, indices=meta, ack=meta, producer="score", seq=0)
    assert again.tolist() == out.tolist() == meta.indices.tolist()
    batch = hub.get(hub.claim("train", 2, timeout=GUARD))
    assert sorted(batch["y"].tolist()) == [10, 20]  # the re-sent bytes were dropped


def test_bad_sequence_numbers_are_refused_and_change_nothing(make_hub) -> None:
    hub = make_hub(columns=COLS, tasks=TASKS)
    for seq in (-1, 1.0, "3", True):
        with pytest.raises(ConfigError, match="seq expects an int >= 0"):
            hub.put(xs(1), producer="p", seq=seq)
    with pytest.raises(ConfigError, match="needs producer="):
        hub.put(xs(1), seq=0)
    with pytest.raises(ConfigError, match="needs producer="):
        hub.put_async(xs(1), seq=0)
    assert hub.statistics().live == 0


def test_the_window_keeps_the_newest_puts_and_refuses_older_unknown_ones() -> None:
    producers = Producers(window=4)
    for seq in range(6):  # 0 and 1 leave the window
        producers.check("p", seq)
        producers.record("p", seq, np.array([10 + seq]))
    with pytest.raises(DuplicatePut) as dup:
        producers.check("p", 2)
    assert dup.value.indices == (12,)
    for seq in (0, 1):  # landed, but no longer remembered: cannot tell
        with pytest.raises(ConfigError, match="older than all of them"):
            producers.check("p", seq)
    producers.check("p", 9)  # newer ones, gaps included, are welcome
    producers.check("q", 0)


def _journaled(path: Path, compact_bytes: int) -> HubConfig:
    return HubConfig(
        capacity=256, journal=JournalConfig(path=str(path), compact_bytes=compact_bytes)
    )


@pytest.mark.parametrize("compact_bytes", [64 << 20, 512], ids=["log", "snapshots"])
def test_deduplication_survives_recovery_from_the_journal(
    tmp_path: Path, compact_bytes: int
) -> None:
    """The controller dies; the recovered one (from the event log, or from a snapshot plus
    the events after it) still knows which puts landed: re-sent ones land once."""
    config = _journaled(tmp_path, compact_bytes)
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config)
    first = {s: hub.put(xs(s), producer="p", seq=s).tolist() for s in range(30)}
    scattered = [first[9][0], first[2][0]]  # an update's indices need not be a run
    assert hub.put(xs(109, 102), indices=scattered, producer="q", seq=7).tolist() == scattered
    first.update({s: hub.put(xs(s), producer="p", seq=s).tolist() for s in range(30, 34)})
    abandon(hub)  # (with snapshots: the last one holds both producers' windows)
    if compact_bytes < 1024:
        assert (tmp_path / "snapshot.msgpack").exists()
    hub = flowrl.Hub(config=config)
    try:
        for s in range(34):
            assert hub.put(xs(s), producer="p", seq=s).tolist() == first[s]
        assert hub.put(xs(-9, -2), indices=scattered, producer="q", seq=7).tolist() == scattered
        hub.put(xs(34), producer="p", seq=34)
        expected = sorted({*range(35), 102, 109} - {2, 9})  # the update's values, once
        assert drain(hub) == expected
    finally:
        hub.close()

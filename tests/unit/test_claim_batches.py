"""``claim_batches`` and ``get_batches``: several micro-batches in one round trip, each its
own lease, exactly as that many claims in a row that do not wait (in-process and over zmq
via ``make_hub``). Bad input gets a typed error and changes nothing."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from flowrl import Column, HubConfig, Loader
from flowrl.errors import ConfigError, EndOfStream, NothingReady

COLS = [Column.scalar("x", "int64"), Column.ragged("ids", "int32")]
GUARD = 60.0  # a hang guard, not a timing


def rows(start: int, n: int) -> dict[str, Any]:
    xs = np.arange(start, start + n)
    return {"x": xs, "ids": [np.full(int(x) % 5 + 1, x, dtype=np.int32) for x in xs]}


def test_the_batches_are_what_claims_in_a_row_would_take(make_hub) -> None:
    twin = make_hub(COLS, tasks={"t": ["x", "ids"]})
    hub = make_hub(COLS, tasks={"t": ["x", "ids"]})
    for h in (hub, twin):
        h.put(rows(0, 10))
    metas = hub.claim_batches("t", 3, 5)
    one_by_one = [twin.claim("t", 3, timeout=0)]
    while True:
        try:
            one_by_one.append(twin.claim("t", 3, timeout=0))
        except NothingReady:
            break
    assert [m.indices.tolist() for m in metas] == [m.indices.tolist() for m in one_by_one]
    assert [len(m) for m in metas] == [3, 3, 3]  # the fourth would find 1 < n ready
    assert len({m.lease for m in metas}) == 3
    stats = hub.statistics()
    assert stats.leases == 3 and stats.tasks["t"].leased == 9 and stats.tasks["t"].ready == 1
    hub.ack(metas[0])
    hub.release(metas[1])  # each its own lease: settled alone
    assert hub.statistics().tasks["t"].ready == 4
    assert [len(m) for m in hub.claim_batches("t", 3, 5, min_n=1)] == [3, 1]


def test_the_first_batch_waits_and_the_others_do_not(make_hub) -> None:
    hub = make_hub(COLS, tasks={"t": ["x", "ids"]})
    with pytest.raises(NothingReady):
        hub.claim_batches("t", 2, 4, timeout=0)
    late = threading.Timer(0.2, lambda: hub.put(rows(0, 2)))
    late.start()
    try:
        metas = hub.claim_batches("t", 2, 4, timeout=GUARD)
    finally:
        late.join()
    assert [m.indices.tolist() for m in metas] == [[0, 1]]


def test_at_the_end_of_the_stream_the_rest_comes_and_then_end_of_stream(make_hub) -> None:
    hub = make_hub(COLS, tasks={"t": ["x", "ids"]})
    hub.put(rows(0, 5))
    hub.end_stream()
    metas = hub.claim_batches("t", 2, 8, timeout=GUARD)
    assert [len(m) for m in metas] == [2, 2, 1]  # (the last short one: the stream ended)
    for meta in metas:
        hub.ack(meta)
    with pytest.raises(EndOfStream):
        hub.claim_batches("t", 2, 8, timeout=GUARD)


@pytest.mark.parametrize("batches", [0, -1, 1.5, "2", None, True])
def test_a_bad_batch_count_is_refused_and_changes_nothing(make_hub, batches: Any) -> None:
    hub = make_hub(COLS, tasks={"t": ["x", "ids"]})
    hub.put(rows(0, 4))
    before = hub.statistics()
    with pytest.raises(ConfigError, match="batches must be a positive int"):
        hub.claim_batches("t", 2, batches)
    after = hub.statistics()
    assert (after.leases, after.tasks, after.events) == (before.leases, before.tasks, before.events)


def test_get_batches_reads_what_get_reads(make_hub) -> None:
    hub = make_hub(COLS, tasks={"t": ["x", "ids"]})
    hub.put(rows(0, 7))
    metas = hub.claim_batches("t", 3, 3, min_n=1)
    batches = hub.get_batches(metas)
    assert [b.meta for b in batches] == metas
    for meta, batch in zip(metas, batches, strict=True):
        alone = hub.get(meta)
        assert batch.numpy("x").tolist() == alone.numpy("x").tolist() == meta.indices.tolist()
        assert [a.tolist() for a in batch["ids"]] == [a.tolist() for a in alone["ids"]]
    only_x = hub.get_batches(metas, columns=["x"])
    assert [b.columns for b in only_x] == [("x",)] * 3
    assert hub.get_batches([]) == []
    with pytest.raises(ConfigError, match="expects a list of BatchMeta"):
        hub.get_batches(metas[0])


def test_a_loader_that_claims_ahead_delivers_each_sample_once_in_order(make_hub) -> None:
    hub = make_hub(COLS)  # (the Loader registers its task)
    hub.put(rows(0, 50))
    hub.end_stream()
    loader = Loader(hub, task="t", columns=["x"], batch_size=4, prefetch=6, timeout=GUARD)
    seen = [x for batch in loader for x in batch.numpy("x").tolist()]
    assert seen == list(range(50))
    stats = hub.statistics()
    assert stats.tasks["t"].consumed == 50 and stats.leases == 0


@pytest.mark.parametrize("placement", ["zmq"], indirect=True)
def test_get_batches_reads_each_units_batches_in_one_request(
    make_hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowrl._transport import wire
    from flowrl._transport.session import Session

    hub = make_hub(COLS, tasks={"t": ["x", "ids"]}, config=HubConfig(n_units=2))
    hub.put(rows(0, 12))
    metas = hub.claim_batches("t", 2, 6)
    reads: list[int] = []
    send = Session.send

    def counted(self: Any, unit: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, wire.Read):
            reads.append(unit)
        return send(self, unit, msg, *args, **kwargs)

    monkeypatch.setattr(Session, "send", counted)
    batches = hub.get_batches(metas)
    units = {int(u) for m in metas for u in m.units}
    assert sorted(reads) == sorted(units)  # one read a unit, whatever the batches
    for meta, batch in zip(metas, batches, strict=True):
        assert batch.numpy("x").tolist() == meta.indices.tolist()
        assert [a.tolist() for a in batch["ids"]] == [
            [x] * (x % 5 + 1) for x in meta.indices.tolist()
        ]

"""Durability: the event journal and persistent storage units, recovered after a crash.

A "crash" here abandons a hub without closing it (nothing is flushed or finalised beyond
what every call already wrote), then starts a new hub on the same folder. The kill tests
with real SIGKILLs live in tests/integration/test_kill.py.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

import flowrl
from flowrl import BalancedSampler, Column, FifoSampler, HubConfig, JournalConfig
from flowrl._controller import snapshot
from flowrl._controller.controller import Controller
from flowrl._controller.journal import EVENTS_FILE
from flowrl._protocol.commands import Cell, Claim, Commit
from flowrl._store import persist
from flowrl._store.unit import StorageUnit
from flowrl.errors import ConfigError, JournalError
from flowrl.events import event_decoder, event_encoder
from flowrl.testing import abandon

COLS = [Column.ragged("ids", "int64"), Column.scalar("reward", "float32")]
TASKS = {"train": ["ids", "reward"], "score": ["ids"]}


def config(path: Path, **journal: object) -> HubConfig:
    return HubConfig(capacity=64, journal=JournalConfig(path=str(path), **journal))  # type: ignore[arg-type]


def rows(start: int, n: int) -> dict[str, object]:
    return {
        "ids": [list(range(i, i + 1 + i % 3)) for i in range(start, start + n)],
        "reward": np.arange(start, start + n, dtype=np.float32),
    }


def test_a_crashed_hub_recovers_samples_readiness_and_consumption(tmp_path: Path) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    hub.put(rows(0, 6), groups=[0, 0, 1, 1, 2, 2], partition="step0")
    hub.put({"ids": [[9], [9, 9]]})  # reward missing: ready for "score" only
    acked = hub.claim("train", 2, timeout=1)
    hub.ack(acked)
    held = hub.claim("train", 2, timeout=1)  # in flight when the process "dies"
    hub.publish_version(3)
    before = hub.statistics()
    abandon(hub)  # -- crash: nothing is closed or flushed --
    again = flowrl.Hub(config=config(tmp_path))
    after = again.statistics()
    assert after.live == before.live == 8
    assert after.version == 3
    assert after.tasks["train"].consumed == 2
    assert after.tasks["score"].ready == 8
    # the lease holder died with the process: its samples come back, first in line
    assert after.tasks["train"].ready == before.tasks["train"].ready + 2
    meta = again.claim("train", 10, min_n=1, timeout=1)
    assert meta.indices.tolist()[:2] == held.indices.tolist()
    assert sorted(meta.indices.tolist()) == [2, 3, 4, 5]
    assert meta.groups.tolist()[:2] == [1, 1]
    batch = again.get(meta)
    assert batch["reward"].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert [list(r) for r in batch["ids"]] == [rows(0, 6)["ids"][i] for i in (2, 3, 4, 5)]  # type: ignore[index]
    assert {c.name for c in again.columns} == {"ids", "reward"}
    again.close()


def test_exactly_once_per_task_across_repeated_crashes(tmp_path: Path) -> None:
    """Every sample is acked exactly once per task, however often the hub restarts."""
    acked: dict[str, Counter[int]] = {"train": Counter(), "score": Counter()}
    produced: list[int] = []
    rng = np.random.default_rng(0)
    for life in range(5):
        hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
        held = []
        for _ in range(4):
            produced += hub.put(rows(len(produced), 4)).tolist()
            for task in ("train", "score"):
                meta = hub.claim(task, int(rng.integers(1, 6)), min_n=1, timeout=1)
                if rng.random() < 0.7:
                    hub.ack(meta)
                    acked[task].update(meta.indices.tolist())
                else:
                    held.append(meta)
        if life == 4:
            for meta in held:
                hub.release(meta)
            hub.end_stream()
            for task in ("train", "score"):
                while True:
                    try:
                        meta = hub.claim(task, 8, min_n=1, timeout=1)
                    except flowrl.errors.EndOfStream:
                        break
                    hub.ack(meta)
                    acked[task].update(meta.indices.tolist())
            assert hub.statistics().live == 0
            hub.close()
        else:
            abandon(hub)  # crash with leases outstanding
    for counts in acked.values():
        assert sorted(counts) == produced
        assert set(counts.values()) == {1}


def test_recovered_indices_are_never_reused(tmp_path: Path) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    first = hub.put(rows(0, 3))
    abandon(hub)
    again = flowrl.Hub(config=config(tmp_path))
    second = again.put(rows(3, 3))
    assert second.min() > first.max()
    again.close()


def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    hub.put(rows(0, 2))
    hub.put(rows(2, 2))
    log = tmp_path / EVENTS_FILE
    size = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"\x40\x00\x00\x00partial")  # a crash in the middle of an append
    abandon(hub)
    again = flowrl.Hub(config=config(tmp_path))
    assert log.stat().st_size == size
    assert again.statistics().live == 4
    again.put(rows(4, 1))  # appending resumes after the cut
    again.close()
    third = flowrl.Hub(config=config(tmp_path))
    assert third.statistics().live == 5
    third.close()


def test_corruption_before_the_tail_is_an_error(tmp_path: Path) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    hub.put(rows(0, 2))
    hub.put(rows(2, 2))
    hub.close()
    log = tmp_path / EVENTS_FILE
    data = bytearray(log.read_bytes())
    data[5:9] = b"\xc1\xc1\xc1\xc1"  # never valid msgpack, inside the first record
    log.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="corrupt"):
        flowrl.Hub(config=config(tmp_path))


def test_a_journal_from_another_shape_is_refused(tmp_path: Path) -> None:
    flowrl.Hub(COLS, config=config(tmp_path)).close()
    other = HubConfig(capacity=128, journal=JournalConfig(path=str(tmp_path)))
    with pytest.raises(ConfigError, match="capacity=64"):
        flowrl.Hub(config=other)


def test_conflicting_declarations_on_recovery_are_refused(tmp_path: Path) -> None:
    flowrl.Hub(COLS, config=config(tmp_path)).close()
    with pytest.raises(flowrl.errors.SchemaError, match="ids"):
        flowrl.Hub([Column.scalar("ids", "int64")], config=config(tmp_path))


def test_metadata_only_journal_keeps_state_but_not_bytes(tmp_path: Path) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path, persist_data=False))
    hub.put(rows(0, 2))
    abandon(hub)
    again = flowrl.Hub(config=config(tmp_path, persist_data=False))
    meta = again.claim("train", 2, timeout=1)
    with pytest.raises(flowrl.errors.UnknownColumnError, match="ids"):
        again.get(meta)
    again.close()
    assert not (tmp_path / "unit0").exists()


@pytest.mark.parametrize("sync", ["write", "fsync"])
def test_journal_config_validation_and_sync_policies(tmp_path: Path, sync: str) -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path, sync=sync, fsync_interval=0.01))
    hub.put(rows(0, 3))
    hub.close()
    again = flowrl.Hub(config=config(tmp_path))
    assert again.statistics().live == 3
    again.close()
    for bad in ({"path": ""}, {"path": "x", "sync": "never"}, {"path": "x", "fsync_interval": 0}):
        with pytest.raises(ConfigError, match="JournalConfig"):
            JournalConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="journal"):
        HubConfig(journal="/tmp/x")  # type: ignore[arg-type]


# -- storage units -----------------------------------------------------------------------
def test_segments_are_deleted_once_every_chunk_in_them_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(persist, "SEGMENT_BYTES", 1)  # a new segment for every chunk
    hub = flowrl.Hub(COLS, tasks={"train": ["ids", "reward"]}, config=config(tmp_path))
    for k in range(4):
        hub.put(rows(2 * k, 2))
    unit_dir = tmp_path / "unit0"
    assert len(persist.segment_files(str(unit_dir))) == 8  # 4 puts x 2 columns
    hub.ack(hub.claim("train", 4, timeout=1))  # evicts the first two puts
    names = [p for _, _, p in persist.segment_files(str(unit_dir))]
    assert len(names) == 4  # the two puts left (the last is also the current segment)
    hub.close()
    again = flowrl.Hub(config=config(tmp_path))
    batch = again.get(again.claim("train", 4, timeout=1))
    assert batch["reward"].tolist() == [4.0, 5.0, 6.0, 7.0]
    again.close()


def test_a_stream_of_small_puts_keeps_few_chunks_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted unit reads back every chunk of its segment files, evicted ones too, so
    its restart time follows what the files hold. A segment used to end only at 64 MiB:
    a stream of one-sample puts left one chunk per put there (10,000 puts: 20,000 chunks,
    5.7 s to reopen on a loaded machine; 64 MiB of them, minutes). A segment now ends
    after ``SEGMENT_CHUNKS`` chunks too, and is deleted once they are all evicted."""
    monkeypatch.setattr(persist, "SEGMENT_CHUNKS", 8)
    hub = flowrl.Hub(COLS, tasks={"train": ["ids", "reward"]}, config=config(tmp_path))
    for k in range(60):  # each put consumed before the next: at most one sample live
        hub.put(rows(k, 1))
        hub.ack(hub.claim("train", 1, timeout=1))
    hub.put(rows(60, 2))  # live across the restart
    hub.close()
    chunks = Counter[str]()
    for column, _, path in persist.segment_files(str(tmp_path / "unit0")):
        loaded = persist.load_column(path)
        assert loaded is not None
        chunks[column] += sum(1 for _ in loaded[1])
    assert set(chunks) == {"ids", "reward"}
    assert max(chunks.values()) <= 2 * 8, chunks  # the live put's segment and the current
    again = flowrl.Hub(config=config(tmp_path))
    batch = again.get(again.claim("train", 2, timeout=1))
    assert batch["reward"].tolist() == [60.0, 61.0]
    again.close()


def test_the_eviction_log_keeps_only_what_the_files_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eviction log grew by every evicted index until the unit restarted (about 200
    bytes per eviction message, for ever in a long run); it is rewritten without the
    indices no segment file holds any more, and a restart still brings back exactly what
    was live."""
    import pyarrow as pa

    monkeypatch.setattr(persist, "SEGMENT_CHUNKS", 8)
    monkeypatch.setattr(persist, "EVICTED_REWRITE", 4096)  # bytes: about 20 appends
    col = Column.scalar("r", "int64")
    unit = StorageUnit(0, 16, folder=str(tmp_path))
    for i in range(400):  # one sample per chunk, evicted once the next two are written
        unit.write(np.array([i]), {"r": pa.array([i])}, {"r": col})
        if i >= 2:
            unit.evict(np.array([i - 2]))
    evicted = persist.load_evicted(str(tmp_path))
    assert 0 < evicted.size < 100, evicted.size  # (it held all 398)
    unit.abandon()  # -- crash --
    again = StorageUnit(0, 16, folder=str(tmp_path))
    assert again.read(np.array([398, 399]), ("r",))["r"].to_pylist() == [398, 399]
    for gone in (0, 390, 397):
        with pytest.raises(flowrl.errors.UnknownIndexError):
            again.read(np.array([gone]), ("r",))
    again.close()


def test_a_unit_restarted_alone_holds_what_it_held(tmp_path: Path) -> None:
    col = Column.tensor("x", "float32", (2, 3))
    unit = StorageUnit(0, 16, folder=str(tmp_path))
    values = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    import pyarrow as pa

    arr = pa.FixedShapeTensorArray.from_numpy_ndarray(values)
    unit.write(np.arange(4), {"x": arr}, {"x": col})
    unit.write(np.array([1]), {"x": pa.FixedShapeTensorArray.from_numpy_ndarray(values[3:])})
    unit.evict(np.array([2]))
    unit.abandon()  # -- crash --
    again = StorageUnit(0, 16, folder=str(tmp_path))
    assert again.declared == {"x": col}
    got = again.read(np.array([0, 1, 3]), ("x",))["x"].to_numpy_ndarray()
    np.testing.assert_array_equal(got, values[[0, 3, 3]])
    with pytest.raises(flowrl.errors.UnknownIndexError):
        again.read(np.array([2]), ("x",))
    again.write(np.array([18]), {"x": arr.slice(0, 1)})  # slot 2 reused by a newer sample
    again.close()
    third = StorageUnit(0, 16, folder=str(tmp_path))
    with pytest.raises(flowrl.errors.UnknownIndexError, match="evicted"):
        third.write(np.array([2]), {"x": arr.slice(0, 1)})  # stale: slot 2 holds 18 now
    np.testing.assert_array_equal(
        third.read(np.array([18]), ("x",))["x"].to_numpy_ndarray(), values[:1]
    )
    third.close()


def test_retain_never_drops_samples_put_after_the_recovery(tmp_path: Path) -> None:
    """The recovered controller's live set may reach a unit after new puts did."""
    import pyarrow as pa

    unit = StorageUnit(0, 16, folder=str(tmp_path))
    col = Column.scalar("r", "int64")
    unit.write(np.arange(4), {"r": pa.array([0, 1, 2, 3])}, {"r": col})  # 2, 3: uncommitted
    unit.write(np.array([9]), {"r": pa.array([9])}, {"r": col})  # put after the recovery
    unit.retain(np.array([0, 1]), below=8)
    assert unit.read(np.array([0, 1, 9]), ("r",))["r"].to_pylist() == [0, 1, 9]
    with pytest.raises(flowrl.errors.UnknownIndexError):
        unit.read(np.array([2]), ("r",))
    unit.close()


def test_a_torn_segment_tail_is_ignored(tmp_path: Path) -> None:
    unit = StorageUnit(0, 16, folder=str(tmp_path))
    col = Column.scalar("r", "int64")
    import pyarrow as pa

    unit.write(np.arange(3), {"r": pa.array([10, 11, 12])}, {"r": col})
    unit.write(np.arange(3, 5), {"r": pa.array([13, 14])}, {"r": col})
    ((_, _, path),) = persist.segment_files(str(tmp_path))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 20)  # tear the second batch
    unit.abandon()
    again = StorageUnit(0, 16, folder=str(tmp_path))
    assert again.read(np.arange(3), ("r",))["r"].to_pylist() == [10, 11, 12]
    with pytest.raises(flowrl.errors.UnknownIndexError):
        again.read(np.array([3]), ("r",))
    again.close()


def test_a_persistent_unit_needs_declarations(tmp_path: Path) -> None:
    import pyarrow as pa

    unit = StorageUnit(0, 16, folder=str(tmp_path))
    with pytest.raises(flowrl.errors.SchemaError, match="declaration"):
        unit.write(np.arange(2), {"r": pa.array([1, 2])})
    assert unit.statistics().samples == 0
    unit.close()


# -- balanced rounds ---------------------------------------------------------------------
def test_balanced_rounds_recover_with_their_reserved_parts() -> None:
    ctl = Controller(16, lease_timeout=1e6)
    journal: list[bytes] = []
    ctl.log.sinks.append(lambda e: journal.append(event_encoder.encode(e)))
    ctl.add_columns((Column.scalar("x", "int64"),))
    ctl.register_task("t", ("x",))
    sampler = BalancedSampler(dp_size=3)
    with ctl.cond:
        idx, _ = ctl.reserve(6)
        ctl.commit(
            Commit(indices=idx, cells={"x": Cell(np.full(6, 8))}, new=True, tokens=np.arange(1, 7))
        )
        first = ctl.try_claim(Claim(task="t", n=2, dp_rank=0), sampler)
        assert first is not None
        second = ctl.try_claim(Claim(task="t", n=2, dp_rank=1), sampler)  # takes its reserved part
        assert second is not None
    twin = Controller(16, lease_timeout=1e6)
    twin.recover(event_decoder.decode(b) for b in journal)
    with twin.cond:
        third = twin.try_claim(
            Claim(task="t", n=2, dp_rank=2), sampler
        )  # its part survived recovery
        again = twin.try_claim(Claim(task="t", n=2, dp_rank=1), sampler)  # rank 1's part was taken
    assert third is not None
    taken = set(first.indices.tolist()) | set(second.indices.tolist())
    assert set(third.indices.tolist()) == set(range(6)) - taken
    assert again is None
    assert third.lease == max(first.lease, second.lease) + 1


def test_a_second_hub_on_a_journal_folder_is_refused_while_the_first_holds_it(
    tmp_path: Path,
) -> None:
    # issue 16: two openers of one journal each delivered its samples
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    hub.put(rows(0, 2))
    events = (tmp_path / EVENTS_FILE).read_bytes()
    units = sorted(p.name for p in (tmp_path / "unit0").iterdir())
    with pytest.raises(JournalError, match=rf"{tmp_path}.*in use by process {os.getpid()}"):
        flowrl.Hub(config=config(tmp_path))
    # refused before anything in the folder was read or rewritten
    assert (tmp_path / EVENTS_FILE).read_bytes() == events
    assert sorted(p.name for p in (tmp_path / "unit0").iterdir()) == units
    meta = hub.claim("train", 2, timeout=1)  # the first hub is unharmed
    hub.ack(meta)
    hub.close()
    again = flowrl.Hub(config=config(tmp_path))  # closed: the folder is free again
    assert again.statistics().tasks["train"].consumed == 2
    again.close()


def test_a_second_process_on_a_journal_folder_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    cfg = f"HubConfig(capacity=64, journal=JournalConfig(path={str(tmp_path)!r}))"
    code = (
        "import sys, flowrl\n"
        "from flowrl import HubConfig, JournalConfig\n"
        "try:\n"
        f"    flowrl.Hub(config={cfg})\n"
        "except flowrl.errors.JournalError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert f"in use by process {os.getpid()}" in out.stdout
    hub.close()


def test_a_closed_journal_never_writes_again(tmp_path: Path) -> None:
    # F6 (issue 16): a late ack on a closed hub wrote journal records into whatever file
    # had reused the journal's descriptor
    hub = flowrl.Hub(COLS, tasks=TASKS, config=config(tmp_path))
    hub.put(rows(0, 2))
    meta = hub.claim("train", 2, timeout=1)
    hub.close()
    size = (tmp_path / EVENTS_FILE).stat().st_size
    other = tmp_path / "other.bin"
    with open(other, "wb") as f:  # likely reuses the journal's descriptor number
        with pytest.raises(flowrl.errors.HubClosed):
            hub.ack(meta)
        f.flush()
    assert other.read_bytes() == b""
    assert (tmp_path / EVENTS_FILE).stat().st_size == size


# -- compaction (F8, issue 16) --------------------------------------------------------------
def _random_run(seed: int, steps: int) -> tuple[Controller, list[bytes], list[tuple[int, bytes]]]:
    """A controller driven by random operations; its journal, and snapshots taken between
    operations as (number of events so far, snapshot)."""
    rng = np.random.default_rng(seed)
    ctl = Controller(32, lease_timeout=1e6)
    journal: list[bytes] = []
    ctl.log.sinks.append(lambda e: journal.append(event_encoder.encode(e)))
    snaps: list[tuple[int, bytes]] = []
    with ctl.cond:
        ctl.add_columns((Column.scalar("x", "int64"), Column.scalar("y", "int64")))
        ctl.register_task("a", ("x",))
        ctl.register_task("b", ("x", "y"))
        leases: list[tuple[str, int, np.ndarray]] = []
        for _ in range(steps):
            op = rng.integers(9)
            if op <= 1 and ctl.table.free_slots() >= 4:
                idx, _ = ctl.reserve(4)
                if rng.random() < 0.2:
                    continue  # left reserved: not journaled state
                cells = {"x": Cell(np.full(4, 8))}
                ctl.commit(
                    Commit(indices=idx, cells=cells, new=True, groups=idx // 2, partition=f"p{op}")
                )
            elif op == 2:
                live = ctl.live_indices()
                live = live[ctl.table.committed[live % 32]]
                if live.size:
                    pick = rng.choice(live, size=min(3, live.size), replace=False)
                    with contextlib.suppress(flowrl.errors.FlowRLError):
                        ctl.commit(
                            Commit(
                                indices=pick, cells={"y": Cell(np.full(pick.size, 8))}, new=False
                            )
                        )
            elif op <= 4:
                task = "abc"[int(rng.integers(3 if "c" in ctl.tasks else 2))]
                sampler = BalancedSampler(dp_size=2) if rng.random() < 0.3 else FifoSampler()
                rank = int(rng.integers(2))  # (a dp_rank needs a BalancedSampler)
                rank = rank if isinstance(sampler, BalancedSampler) else 0
                with contextlib.suppress(flowrl.errors.FlowRLError):
                    meta = ctl.try_claim(Claim(task=task, n=2, dp_rank=rank), sampler)
                    if meta is not None:
                        leases.append((task, meta.lease, meta.indices))
            elif op == 5 and leases:
                task, lease, idx = leases.pop(int(rng.integers(len(leases))))
                how = rng.integers(3)
                with contextlib.suppress(flowrl.errors.FlowRLError):
                    if how == 0:
                        ctl.release(task, lease)
                    else:
                        ctl.ack(task, lease, idx[:1] if how == 1 else None, drop=rng.random() < 0.2)
            elif op == 6:
                ctl.publish_version(ctl.version + 1)
            elif op == 8:  # a task scoped to one partition comes and goes
                if "c" not in ctl.tasks:
                    ctl.register_task("c", ("x",), partition=f"p{int(rng.integers(2))}")
                else:
                    with contextlib.suppress(flowrl.errors.LeaseError):
                        ctl.unregister_task("c")
                        leases = [lease for lease in leases if lease[0] != "c"]
            else:
                snaps.append((len(journal), snapshot.snapshot_of(ctl)))
    return ctl, journal, snaps


def _state(ctl: Controller) -> object:
    """Everything recovery must rebuild (creation times aside: replay stamps its own)."""
    snap = msgspec.msgpack.decode(snapshot.snapshot_of(ctl), type=snapshot.Snapshot)
    return msgspec.structs.replace(snap, table={**snap.table, "created": b""})


@pytest.mark.parametrize("seed", range(4))
def test_a_snapshot_plus_the_events_after_it_rebuilds_what_the_whole_journal_does(
    seed: int,
) -> None:
    _, journal, snaps = _random_run(seed, 300)
    assert snaps
    for count, data in snaps[:: max(1, len(snaps) // 5)]:
        whole = Controller(32, lease_timeout=1e6)
        whole.recover(event_decoder.decode(b) for b in journal)
        twin = Controller(32, lease_timeout=1e6)
        seq = snapshot.restore(twin, data, "test")
        assert seq == count  # every event so far is in it
        twin.recover(event_decoder.decode(b) for b in journal[count:])
        assert _state(twin) == _state(whole)
        with twin.cond, whole.cond:  # and they go on alike
            for task in ("a", "b", "c") if "c" in twin.tasks else ("a", "b"):
                for rank in (0, 1):
                    mine, theirs = (
                        c.try_claim(Claim(task=task, n=3, dp_rank=rank), BalancedSampler(dp_size=2))
                        for c in (twin, whole)
                    )
                    assert (mine is None) == (theirs is None)
                    if mine is not None and theirs is not None:
                        assert mine.indices.tolist() == theirs.indices.tolist()


def _stream(hub: flowrl.Hub, batches: int, live: int = 0) -> None:
    """Put batches of 8 through ``hub``, consumed by both tasks; ``live`` more stay."""
    for k in range(live // 8):
        hub.put(rows(8 * k, 8))
    for k in range(batches):
        hub.put(rows(8 * k, 8))
        for task in ("train", "score"):
            hub.ack(hub.claim(task, 8, timeout=1))


def test_the_default_journal_compacts_long_before_replay_takes_a_second(tmp_path: Path) -> None:
    # Replay runs at about 1 MiB/s (benchmarks/journal.py restart): the default keeps the
    # log a fraction of that. (It was 64 MiB: a 90 s soak replayed 19.8 MB for 7.3 s.)
    journal = JournalConfig(path=str(tmp_path), persist_data=False)
    assert journal.compact_bytes <= 256 << 10
    hub = flowrl.Hub(COLS, tasks=TASKS, config=HubConfig(capacity=256, journal=journal))
    _stream(hub, 1_000)  # about 600 KiB of events
    assert hub._journal is not None and hub._journal.compactions >= 2
    assert (tmp_path / EVENTS_FILE).stat().st_size < journal.compact_bytes + 1024
    abandon(hub)


def test_a_big_snapshot_lets_the_log_grow_to_an_eighth_of_it(tmp_path: Path) -> None:
    journal = JournalConfig(path=str(tmp_path), persist_data=False, compact_bytes=1)
    hub = flowrl.Hub(COLS, tasks=TASKS, config=HubConfig(capacity=4096, journal=journal))
    _stream(hub, 0, live=2048)  # a snapshot of about 100 KiB
    logs, snapshots = [], []
    for _ in range(150):
        _stream(hub, 1)
        logs.append((tmp_path / EVENTS_FILE).stat().st_size)
        snapshots.append((tmp_path / "snapshot.msgpack").stat().st_size)
    # (it was twice the snapshot: a log that replays for seconds)
    assert max(logs) < max(snapshots) // 8 + 1024
    assert hub._journal is not None and hub._journal.compactions >= 3
    abandon(hub)


def test_a_compacted_journal_stays_small_and_recovers(tmp_path: Path) -> None:
    cfg = HubConfig(capacity=64, journal=JournalConfig(path=str(tmp_path), compact_bytes=4096))
    hub = flowrl.Hub(COLS, tasks=TASKS, config=cfg)
    for k in range(60):  # 480 samples through a hub of 64: the log would keep growing
        hub.put(rows(8 * k, 8), groups=np.full(8, k))
        for task in ("train", "score"):
            hub.ack(hub.claim(task, 8, timeout=1))
    hub.put(rows(480, 4))
    held = hub.claim("score", 2, timeout=1)
    hub.ack(hub.claim("train", 1, timeout=1))
    hub.publish_version(7)
    assert hub._journal is not None and hub._journal.compactions >= 5
    assert (tmp_path / EVENTS_FILE).stat().st_size < 3 * 4096
    before = hub.statistics()
    abandon(hub)
    again = flowrl.Hub(config=config(tmp_path))
    after = again.statistics()
    # (one more event: the held lease expired, its holder having died)
    assert (after.live, after.version, after.events) == (before.live, 7, before.events + 1)
    assert after.tasks["train"].consumed == before.tasks["train"].consumed == 481
    assert after.tasks["score"].ready == 4  # the lease holder died: its samples came back
    meta = again.claim("score", 4, timeout=1)
    assert meta.indices.tolist()[:2] == held.indices.tolist()  # first in line
    batch = again.get(meta, ["reward"])
    assert sorted(batch["reward"].tolist()) == [480.0, 481.0, 482.0, 483.0]
    again.close()

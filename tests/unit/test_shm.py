"""The storage units' shared-memory arena and the client's mappings of it."""

from __future__ import annotations

import gc
import os
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import flowrl
from flowrl import Column, HubConfig
from flowrl._client.batch import LazyColumn
from flowrl._store import shm
from flowrl._store.shm import SHM_PREFIX, ShmArena, ShmMaps, ShmUnavailable, _Segment
from flowrl._transport import wire
from flowrl.errors import TransportError, UnknownIndexError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")


@pytest.fixture
def arena() -> Iterator[ShmArena]:
    a = ShmArena(f"{SHM_PREFIX}test-{secrets.token_hex(4)}", 1 << 20, 1 << 20)
    yield a
    a.close()
    assert not os.path.exists(a.folder)


def segments_in(folder: str) -> list[str]:
    """The segment files of an arena (its owner file aside)."""
    return sorted(f for f in os.listdir(folder) if f != shm.OWNER_FILE)


def stored(arena: ShmArena, value: int, size: int = 300_000) -> pa.Buffer:
    placed = arena.copy_in(np.full(size, value, dtype=np.uint8))
    assert placed is not None
    buf = pa.py_buffer(placed.view)
    assert arena.locate(buf.address, size) == (placed.path, placed.offset)
    return buf


def test_a_segment_lives_as_long_as_arrays_use_it(arena: ShmArena) -> None:
    bufs = [stored(arena, i) for i in range(5)]  # three fit in a 1 MiB segment
    segments = segments_in(arena.folder)
    assert len(segments) == 2
    where = [arena.locate(b.address, b.size) for b in bufs]
    assert [w[0] for w in where if w] == [f"{arena.folder}/{s}" for s in segments[:1]] * 3 + [
        f"{arena.folder}/{segments[1]}"
    ] * 2
    assert where[1] is not None and where[1][1] % 64 == 0  # aligned
    assert arena.locate(pa.py_buffer(b"x" * 10).address, 10) is None  # not in the arena
    full = os.stat(f"{arena.folder}/{segments[0]}").st_ino
    del bufs[:3]
    gc.collect()
    # the full one was retired with its arrays: renamed (no client opens it by its old
    # name) and kept to be reused
    left = segments_in(arena.folder)
    assert segments[0] not in left and segments[1] in left
    (free,) = [f for f in left if f.startswith("free-")]
    assert os.stat(f"{arena.folder}/{free}").st_ino == full
    assert np.frombuffer(bufs[0], dtype=np.uint8)[:2].tolist() == [3, 3]


def fill(arena: ShmArena, value: int) -> list[pa.Buffer]:
    """A segment's worth of stored buffers (three of 300 KB in a 1 MiB segment)."""
    return [stored(arena, value) for _ in range(3)]


def inode(path: str) -> int:
    return os.stat(path).st_ino


def test_a_retired_segment_is_reused_under_a_new_name_when_no_client_maps_it(
    arena: ShmArena,
) -> None:
    first = fill(arena, 1)
    old_path = where(arena, first)
    old_inode = inode(old_path)
    kept = fill(arena, 2)  # the next segment
    del first
    gc.collect()
    again = fill(arena, 3)  # a third segment's worth: the retired one, renamed
    new_path = where(arena, again)
    assert new_path != old_path and not os.path.exists(old_path)
    assert inode(new_path) == old_inode
    assert [np.frombuffer(b, np.uint8)[[0, -1]].tolist() for b in kept + again] == [[2, 2]] * 3 + [
        [3, 3]
    ] * 3  # the live arrays' bytes did not change
    assert not [f for f in segments_in(arena.folder) if f.startswith("free-")]


def test_a_segment_a_client_maps_is_not_reused_until_the_client_lets_go(
    arena: ShmArena,
) -> None:
    first = fill(arena, 1)
    path, offset = arena.locate(first[0].address, 10) or ("", 0)
    retired = inode(path)
    maps = ShmMaps()
    (read,) = maps.buffers([wire.ShmRef(path, offset, 300_000)], [], unit=0)
    lane = shm.lock_lent(path)  # a producer's lane over the same segment (its lock)
    held = [fill(arena, 2)]  # (held: the only segment retired is the first)
    del first
    gc.collect()  # retired; the reader's array and the lane still map it
    for client in ("lane", "reader"):
        held.append(fill(arena, 3))  # a new segment: the retired one is locked
        assert inode(where(arena, held[-1])) != retired
        assert np.frombuffer(read, np.uint8)[[0, -1]].tolist() == [1, 1]  # unchanged
        if client == "lane":
            os.close(lane)
        else:
            del read
            maps.buffers([], [], unit=0)  # a read forgets retired segments: the lock goes
    assert inode(where(arena, fill(arena, 4))) == retired  # reused at last


def where(arena: ShmArena, bufs: list[pa.Buffer]) -> str:
    """The path of the segment holding ``bufs``."""
    found = arena.locate(bufs[0].address, 10)
    assert found is not None
    return found[0]


def test_a_client_that_opened_a_segment_before_it_was_reused_reads_it_as_evicted(
    arena: ShmArena,
) -> None:
    first = fill(arena, 1)
    path = where(arena, first)
    fd = os.open(path, os.O_RDONLY)  # opened, not yet locked: then the unit moves on
    try:
        fill(arena, 2)
        del first
        gc.collect()
        reused = fill(arena, 3)
        assert inode(where(arena, reused)) == os.fstat(fd).st_ino
        with pytest.raises(shm.SegmentGone):
            shm._lock_named(fd, path)  # the name no longer means the file it opened
    finally:
        os.close(fd)
    with pytest.raises(shm.SegmentGone):
        shm.lock_lent(path)  # a lane asking for a grant's segment retired meanwhile


def test_free_segments_beyond_the_arenas_budget_are_deleted() -> None:
    arena = ShmArena(
        f"{SHM_PREFIX}test-{secrets.token_hex(4)}", 1 << 20, 1 << 20, free_bytes=2 << 20
    )
    try:
        held = [fill(arena, i) for i in range(5)]
        current = fill(arena, 9)  # (held) the five above are full
        del held
        gc.collect()  # five retired: renamed at once, filed when the next segment is due
        assert len([f for f in segments_in(arena.folder) if f.startswith("free-")]) == 5
        fill(arena, 8)  # the next segment: two of the five kept, one of them reused
        assert len([f for f in segments_in(arena.folder) if f.startswith("free-")]) == 1
        assert len(segments_in(arena.folder)) == 3 and current
    finally:
        arena.close()
    assert not os.path.exists(arena.folder)


def test_without_room_bytes_stay_where_they_are(
    arena: ShmArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert arena.copy_in(np.zeros(1000, dtype=np.uint8)) is None
    assert segments_in(arena.folder) == []


def test_a_client_reads_in_place_and_refuses_what_is_not_a_segment(arena: ShmArena) -> None:
    buf = stored(arena, 7)
    path, offset = arena.locate(buf.address, buf.size) or ("", 0)
    maps = ShmMaps()
    got = maps.buffers([wire.ShmRef(path, offset, buf.size), None], [_Frame(b"abc")], unit=0)
    assert np.frombuffer(got[0], dtype=np.uint8)[[0, -1]].tolist() == [7, 7]
    assert bytes(got[1]) == b"abc"
    for bad in [
        wire.ShmRef("/etc/passwd", 0, 1),
        wire.ShmRef(f"{SHM_PREFIX}x/../../etc/passwd", 0, 1),
        wire.ShmRef(path, offset, 1 << 30),  # past the end of the segment
    ]:
        with pytest.raises(TransportError):
            maps.buffers([bad], [], unit=0)
    with pytest.raises(TransportError, match="fewer frames"):
        maps.buffers([None], [], unit=0)
    with pytest.raises(TransportError, match="more frames"):
        maps.buffers([], [_Frame(b"x")], unit=0)
    with pytest.raises(UnknownIndexError, match="evicted"):  # the segment is gone
        maps.buffers([wire.ShmRef(f"{arena.folder}/gone", 0, 1)], [], unit=0)
    with pytest.raises(ShmUnavailable):  # not this machine's /dev/shm: read over zmq
        maps.buffers([wire.ShmRef(f"{SHM_PREFIX}elsewhere/seg", 0, 1)], [], unit=0)


def test_another_users_segments_are_read_over_zmq(
    arena: ShmArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = stored(arena, 1)
    path, offset = arena.locate(buf.address, buf.size) or ("", 0)

    def denied(*args: Any) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(shm.os, "open", denied)
    with pytest.raises(ShmUnavailable):
        ShmMaps().buffers([wire.ShmRef(path, offset, buf.size)], [], unit=0)


def test_a_multi_process_hub_reads_in_place_and_leaves_no_shared_memory() -> None:
    cols = [Column.ragged("ids", "int64"), Column.scalar("r", "float32")]
    hub = flowrl.launch_hub(cols, tasks={"t": ["ids", "r"]}, config=HubConfig(n_units=2))
    try:
        name = os.path.basename(hub.address.removeprefix("ipc://").rsplit("/", 1)[0])
        arenas = [f"{SHM_PREFIX}{name.removeprefix('flowrl-')}-unit{u}" for u in range(2)]
        ids = [np.arange(20_000) + i for i in range(8)]  # 160 KB a sample: read in place
        hub.put({"ids": ids, "r": np.arange(8, dtype=np.float32)})
        assert any(segments_in(a) for a in arenas)
        in_place: list[int] = []
        read = hub._data._shm_maps.buffers

        def counted(refs: list[Any], *args: Any) -> list[Any]:
            in_place.append(sum(r is not None for r in refs))
            return read(refs, *args)

        hub._data._shm_maps.buffers = counted  # type: ignore[method-assign]
        meta = hub.claim("t", 8, timeout=5)
        batch = hub.get(meta)
        # rows one put wrote: the unit names the whole chunk (all 3 buffers) in place
        assert in_place == [3]
        assert [s.tolist() for s in batch.ragged("ids")] == [s.tolist() for s in ids]
        assert batch["r"].tolist() == list(range(8))
        part = hub.get(meta.subset(np.array([6, 1, 2, 3])))  # not a run: a gather (a copy)
        assert in_place == [3, 0]  # whose bytes come as frames
        assert [s.tolist() for s in part.ragged("ids")] == [ids[i].tolist() for i in (6, 1, 2, 3)]
        assert part["r"].tolist() == [6, 1, 2, 3]
        window = hub.get(meta.subset(np.arange(2, 5)))  # a run inside the chunk: sliced there
        assert in_place == [3, 0, 3]
        assert [s.tolist() for s in window.ragged("ids")] == [ids[i].tolist() for i in (2, 3, 4)]
        assert window["r"].tolist() == [2, 3, 4]
    finally:
        hub.close()
    assert not any(os.path.exists(a) for a in arenas)


class _Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_a_client_that_cannot_map_a_units_segments_reads_over_zmq() -> None:
    hub = flowrl.launch_hub([Column.ragged("ids", "int64")], tasks={"t": ["ids"]})
    try:
        ids = [np.arange(20_000) + i for i in range(4)]
        hub.put({"ids": ids})

        def unavailable(path: str, unit: int) -> Any:
            raise ShmUnavailable(path)

        hub._data._shm_maps._open = unavailable  # type: ignore[method-assign]
        batch = hub.get(hub.claim("t", 4, timeout=5))
        assert [s.tolist() for s in batch.ragged("ids")] == [s.tolist() for s in ids]
        assert hub._data._shm == [False]  # that unit's reads go over zmq from now on
    finally:
        hub.close()


@pytest.mark.parametrize("starts", [[1], [0, 0]], ids=["past-the-chunk", "too-many"])
def test_a_reply_naming_rows_outside_its_chunk_is_refused(starts: list[int]) -> None:
    hub = flowrl.launch_hub([Column.ragged("ids", "int64")], tasks={"t": ["ids"]})
    try:
        ids = [np.arange(20_000) + i for i in range(4)]
        hub.put({"ids": ids})
        meta = hub.claim("t", 4, timeout=5)
        recv = hub._session.recv

        def tampered(*args: Any, **kw: Any) -> Any:
            reply, frames = recv(*args, **kw)
            assert reply.starts == [0]  # the whole chunk, read from its first row
            return wire.Arrays(arrays=reply.arrays, refs=reply.refs, starts=starts), frames

        hub._session.recv = tampered  # type: ignore[method-assign]
        with pytest.raises(TransportError, match="storage unit 0"):
            hub.get(meta)
        hub._session.recv = recv  # type: ignore[method-assign]
        assert [s.tolist() for s in hub.get(meta).ragged("ids")] == [s.tolist() for s in ids]
    finally:
        hub.close()


def test_an_in_place_read_hands_numpy_views_over_and_builds_arrow_on_demand() -> None:
    cols = [
        Column.ragged("ids", "int64"),
        Column.ragged("mask", "bool"),
        Column.tensor("pix", "float32", (2, 3)),
        Column.scalar("r", "float32"),
        Column.scalar("ok", "bool"),
        Column.string("text"),
    ]
    hub = flowrl.launch_hub(cols, tasks={"t": [c.name for c in cols]})
    try:
        n = 6
        ids = [np.arange(5_000 + i) + i for i in range(n)]  # 40 KB a sample: read in place
        data = {
            "ids": ids,
            "mask": [np.arange(i + 1) % 2 == 0 for i in range(n)],
            "pix": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3),
            "r": np.arange(n, dtype=np.float32),
            "ok": np.arange(n) % 3 == 0,
            "text": [f"s{i}" for i in range(n)],
        }
        hub.put(data)
        meta = hub.claim("t", n, timeout=5)
        window = meta.subset(np.arange(1, 5))  # rows 1..4 of the put's chunk
        for m, rows in ((meta, range(n)), (window, range(1, 5))):
            batch = hub.get(m)
            lazy = [c for c in batch._arrays if isinstance(batch._arrays[c], LazyColumn)]
            assert sorted(lazy) == ["ids", "pix", "r"]  # bools and strings go through Arrow
            assert [s.tolist() for s in batch.ragged("ids")] == [ids[i].tolist() for i in rows]
            assert [s.tolist() for s in batch.ragged("mask")] == [
                data["mask"][i].tolist() for i in rows
            ]
            assert batch["pix"].tolist() == data["pix"][list(rows)].tolist()
            assert batch["r"].tolist() == [float(i) for i in rows]
            assert batch["ok"].tolist() == [i % 3 == 0 for i in rows]
            assert batch["text"] == [f"s{i}" for i in rows]
            assert not batch.ragged("ids").values.flags.writeable
            assert not batch["pix"].flags.writeable
            # Arrow on demand: the same rows, and the batch keeps what it built
            assert batch.arrow("ids").to_pylist() == [ids[i].tolist() for i in rows]
            assert batch.arrow("pix").to_pylist() == [data["pix"][i].ravel().tolist() for i in rows]
            assert batch.arrow("r").to_pylist() == [float(i) for i in rows]
            assert batch.arrow("ids") is batch.arrow("ids")
    finally:
        hub.close()


def test_a_chunk_read_with_offsets_out_of_order_is_refused() -> None:
    hub = flowrl.launch_hub([Column.ragged("ids", "int64")], tasks={"t": ["ids"]})
    try:
        ids = [np.arange(20_000) + i for i in range(4)]
        hub.put({"ids": ids})
        meta = hub.claim("t", 4, timeout=5)
        read = hub._data._shm_maps.buffers

        def tampered(refs: list[Any], *args: Any) -> list[Any]:
            bufs = read(refs, *args)
            offsets = np.frombuffer(bufs[0], dtype=np.int64).copy()
            offsets[2] = offsets[3] + 1  # row 1 ends after row 2
            return [offsets.data, *bufs[1:]]

        hub._data._shm_maps.buffers = tampered  # type: ignore[method-assign]
        with pytest.raises(TransportError, match="malformed offsets"):
            hub.get(meta)
    finally:
        hub.close()


def test_arenas_of_dead_owners_are_swept_when_an_arena_starts() -> None:
    # F9 (issue 16): a SIGKILLed unit's arena stayed in /dev/shm for ever
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f"{SHM_PREFIX}test-dead-{secrets.token_hex(4)}"
    reused = f"{SHM_PREFIX}test-reused-{secrets.token_hex(4)}"
    alive = f"{SHM_PREFIX}test-alive-{secrets.token_hex(4)}"
    for folder, owner in (
        (dead, f"{gone.pid} 1"),
        (reused, f"{os.getpid()} 1"),  # this pid, but another process's start time
        (alive, f"{os.getpid()} {shm._start_time(os.getpid())}"),
    ):
        os.makedirs(folder)
        with open(f"{folder}/{shm.OWNER_FILE}", "w") as f:
            f.write(owner)
        with open(f"{folder}/seg-1", "wb") as f:
            f.write(b"x" * 1000)
    fresh = ShmArena(f"{SHM_PREFIX}test-{secrets.token_hex(4)}", 1 << 20, 1 << 20)
    try:
        assert not os.path.exists(dead) and not os.path.exists(reused)
        assert os.path.exists(f"{alive}/seg-1")  # its owner lives: untouched
        with open(f"{fresh.folder}/{shm.OWNER_FILE}") as f:
            assert f.read().split()[0] == str(os.getpid())
    finally:
        fresh.close()
        import shutil

        shutil.rmtree(alive, ignore_errors=True)


def test_a_units_next_segment_is_made_ahead_by_a_thread() -> None:
    """Making a segment inside a put stalled it for 80-340 ms on a loaded machine: with
    ``spare`` the arena makes the next one while the current fills, and takes it then."""
    arena = ShmArena(f"{SHM_PREFIX}test-{secrets.token_hex(4)}", 1 << 20, 1 << 20, spare=True)
    try:
        first = arena.copy_in(np.ones(600_000, dtype=np.uint8))
        spare = arena._spare
        assert first is not None and spare is not None and spare._thread is not None
        spare._thread.join()
        assert spare._made is not None and os.path.exists(spare._made.path)
        made = spare._made.path
        second = arena.copy_in(np.full(600_000, 2, dtype=np.uint8))  # does not fit the first
        assert second is not None and second.path == made  # the spare became current
        assert np.frombuffer(second.view, dtype=np.uint8)[:3].tolist() == [2, 2, 2]
        assert arena.locate(np.frombuffer(second.view, np.uint8).ctypes.data, 10) == (made, 0)
    finally:
        arena.close()


def test_segments_retired_by_other_threads_are_reused_with_their_readers_bytes_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Epochs end in whatever thread drops their last array (zmq's, a gc pass): retiring
    takes no lock the arena's thread holds, and what any thread still holds never changes."""
    import queue
    import threading

    made = []
    monkeypatch.setattr(shm, "_Segment", lambda *a: made.append(a) or _Segment(*a))
    arena = ShmArena(f"{SHM_PREFIX}test-{secrets.token_hex(4)}", 1 << 20, 1 << 20)
    handed: queue.Queue[list[pa.Buffer] | None] = queue.Queue(maxsize=8)
    bad: list[int] = []

    def dropper() -> None:  # holds each batch a while, checks it, then drops it here
        while (bufs := handed.get()) is not None:
            value = np.frombuffer(bufs[0], np.uint8)[0]
            if any((np.frombuffer(b, np.uint8) != value).any() for b in bufs):
                bad.append(int(value))
            del bufs

    thread = threading.Thread(target=dropper)
    thread.start()
    try:
        for i in range(300):
            handed.put([stored(arena, i % 251) for _ in range(2)])
    finally:
        handed.put(None)
        thread.join()
        arena.close()
    assert bad == []
    assert 0 < len(made) < 20, len(made)  # of ~200 segments filled: the rest were reused
    assert not os.path.exists(arena.folder)


def test_a_kept_write_mapping_does_not_hold_its_segment_against_reuse(arena: ShmArena) -> None:
    """Put lanes keep their mappings beyond the grant (mapping 64 MiB again cost 8-15 ms);
    only the lane's lock keeps the unit from reusing the segment."""
    from flowrl._transport.lanes import _WriteMaps

    first = fill(arena, 1)
    path = where(arena, first)
    maps = _WriteMaps()
    lock = shm.lock_lent(path)
    mapped = maps.of(lock)
    assert maps.of(lock) is mapped  # the same file: the same mapping
    held = [fill(arena, 2)]  # (held: the only segment retired is the first)
    del first
    gc.collect()  # retired while the lane still holds its lock
    held.append(fill(arena, 3))
    assert inode(where(arena, held[-1])) != inode(f"/proc/self/fd/{lock}")
    retired = os.fstat(lock).st_ino
    os.close(lock)  # the lane ends; its mapping stays
    assert inode(where(arena, fill(arena, 4))) == retired  # reused all the same
    again = shm.lock_lent(arena._live[arena._bases[-1]][0])  # a later grant there
    assert maps.of(again) is mapped  # under its new name: the mapping kept
    os.close(again)
    maps.close()


def test_write_mappings_of_files_the_unit_deleted_are_let_go(arena: ShmArena) -> None:
    from flowrl._transport.lanes import _WriteMaps

    first = fill(arena, 1)
    maps = _WriteMaps()
    lock = shm.lock_lent(where(arena, first))
    maps.of(lock)
    os.close(lock)
    arena.free_bytes = 0  # retired segments are deleted, not kept
    fill(arena, 2)
    del first
    gc.collect()
    fill(arena, 3)  # the next segment: the retired one is deleted
    later = fill(arena, 4)
    lock = shm.lock_lent(where(arena, later))
    maps.of(lock)
    os.close(lock)
    assert len(maps._maps) == 1  # the deleted file's mapping went
    maps.close()


def test_a_reader_holds_only_the_segments_its_arrays_use_and_its_latest(
    arena: ShmArena,
) -> None:
    """A trainer idle between reads must not keep every segment it ever read from being
    reused: a mapping goes with its last array, but for the one opened last."""
    import fcntl

    older, latest = fill(arena, 1), fill(arena, 2)
    maps = ShmMaps()

    def locked(bufs: list[pa.Buffer]) -> bool:
        fd = os.open(where(arena, bufs), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def read(bufs: list[pa.Buffer]) -> memoryview:
        path, offset = arena.locate(bufs[0].address, 10) or ("", 0)
        return maps.buffers([wire.ShmRef(path, offset, 300_000)], [], unit=0)[0]

    kept = read(older)
    read(latest)  # (its array dropped at once)
    assert locked(older) and locked(latest)  # an array uses the older; the latest is kept
    del kept
    gc.collect()
    assert not locked(older) and locked(latest)
    maps.clear()
    assert not locked(latest)

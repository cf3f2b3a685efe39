"""A shared-memory weight channel's files are private to the user (issue 26, item 2):
per-user names, mode 0600, one live publisher per channel, and a planted, foreign or
malformed header is refused with a typed error instead of being loaded. Killed
publishers' leftovers: tests/integration/test_engines_weight_sync.py."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator

import msgspec
import pytest
import torch

import flowrl
from flowrl._weights.shm_files import ChannelFiles
from flowrl._weights.sync import TensorEntry, WeightHeader
from flowrl.errors import ConfigError, TransportError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")

OTHER_UID = 4242  # a user that is not us, for files "another user" planted


@pytest.fixture
def channel() -> Iterator[str]:
    name = f"test-{secrets.token_hex(4)}"
    yield name
    for entry in os.scandir("/dev/shm"):  # what a test planted, whoever owns it now
        if name in entry.name:
            os.unlink(entry.path)


def _files(channel: str) -> list[str]:
    return sorted(e.name for e in os.scandir("/dev/shm") if channel in e.name)


def _plant(path: str, data: bytes, *, uid: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    if uid is not None:
        os.chown(path, uid, -1)


def _header(segment: str, entries: tuple[TensorEntry, ...] = ()) -> bytes:
    return msgspec.msgpack.encode(WeightHeader(7, segment, entries))


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("planting a file of another user needs root (chown)")


def test_names_carry_the_user_and_files_are_private(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel)
    try:
        pub.publish([("w", torch.ones(4))], version=1)
        names = _files(channel)
        assert names and all(n.startswith(f"flowrl-weights-u{os.geteuid()}-") for n in names)
        # the second arena is made by a background thread after the first publish
        kinds = sorted({n.rsplit(".", 1)[1] for n in names})
        assert kinds == ["arena", "header", "lock"]
        for n in names:
            info = os.stat(f"/dev/shm/{n}")
            assert stat.S_IMODE(info.st_mode) == 0o600, n
            assert info.st_uid == os.geteuid()
    finally:
        pub.close()
    assert _files(channel) == []


def test_one_live_publisher_per_channel(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel)
    try:
        with pytest.raises(ConfigError, match=rf"already has a live publisher \(pid {os.getpid()}"):
            flowrl.WeightPublisher(channel)
    finally:
        pub.close()
    flowrl.WeightPublisher(channel).close()  # once closed, the channel is free again


def test_a_header_naming_a_file_outside_its_channel_is_refused(channel: str) -> None:
    files = ChannelFiles(channel, "/dev/shm")
    other = ChannelFiles(f"{channel}-other", "/dev/shm").arena("00ff", 1)
    for segment in ("/etc/passwd", other, files.arena("00ff", 1) + ".x", "relative.arena"):
        _plant(files.header, _header(segment))
        sub = flowrl.WeightSubscriber(channel)
        with pytest.raises(TransportError, match="expected an arena of channel"):
            sub.poll()
        sub.close()


def test_a_malformed_header_is_refused_and_a_new_publisher_replaces_it(channel: str) -> None:
    files = ChannelFiles(channel, "/dev/shm")
    _plant(files.header, b"\x93not a header")
    sub = flowrl.WeightSubscriber(channel)
    try:
        with pytest.raises(TransportError, match="is malformed"):
            sub.poll()
        pub = flowrl.WeightPublisher(channel)  # our own broken header: removed at start
        assert sub.poll() is None
        pub.publish([("w", torch.ones(4))], version=1)
        assert sub.poll().version == 1
        sub.release()
        pub.close()
    finally:
        sub.close()


def test_tensors_outside_the_arena_are_refused(channel: str) -> None:
    files = ChannelFiles(channel, "/dev/shm")
    arena = files.arena("00ff", 1)
    _plant(arena, bytes(64))
    bad = [
        TensorEntry("w", "float32", (32,), 0, 128),  # past the arena's end
        TensorEntry("w", "float32", (4,), 0, 64),  # nbytes disagrees with the shape
        TensorEntry("w", "__class__", (4,), 0, 16),  # not a torch dtype
        TensorEntry("w", "float32", (4,), -16, 16),
    ]
    sub = flowrl.WeightSubscriber(channel)
    try:
        for entry in bad:
            _plant(files.header, _header(arena, (entry,)))
            with pytest.raises(TransportError, match="does not fit"):
                sub.poll()
        _plant(files.header, _header(arena, (TensorEntry("w", "float32", (4,), 0, 16),)))
        with sub.poll() as snap:  # the same arena, described right: loads
            assert dict(snap.tensors())["w"].tolist() == [0.0] * 4
    finally:
        sub.close()


def test_a_link_at_the_header_is_refused(channel: str, tmp_path) -> None:
    files = ChannelFiles(channel, "/dev/shm")
    target = tmp_path / "elsewhere"
    target.write_bytes(_header(files.arena("00ff", 1)))
    os.symlink(target, files.header)
    sub = flowrl.WeightSubscriber(channel)
    with pytest.raises(TransportError, match="cannot be opened"):
        sub.poll()
    sub.close()


def test_a_header_another_user_planted_is_never_loaded(channel: str) -> None:
    """Another user plants a header naming their own arena, whose tensors a subscriber
    would load, at the name our channel uses: subscribers and a new publisher refuse it
    with a typed error naming the file and its owner (before: subscribers loaded the
    planted tensors and the trainer's publish failed with an untyped PermissionError)."""
    _needs_root()
    files = ChannelFiles(channel, "/dev/shm")
    arena = files.arena("00ff", 1)  # their file, under a name our channel would use
    _plant(arena, torch.full((4,), 66.0).numpy().tobytes(), uid=OTHER_UID)
    entry = TensorEntry("w", "float32", (4,), 0, 16)
    _plant(files.header, _header(arena, (entry,)), uid=OTHER_UID)
    sub = flowrl.WeightSubscriber(channel)
    try:
        with pytest.raises(TransportError, match=f"belongs to uid {OTHER_UID}"):
            sub.poll()
        with pytest.raises(TransportError, match=f"belongs to uid {OTHER_UID}"):
            flowrl.WeightPublisher(channel)
        os.chown(files.header, os.geteuid(), -1)  # our header, naming their arena
        with pytest.raises(TransportError, match=f"arena .* belongs to uid {OTHER_UID}"):
            sub.poll()
    finally:
        sub.close()


def test_a_lock_file_another_user_planted_is_refused(channel: str) -> None:
    _needs_root()
    files = ChannelFiles(channel, "/dev/shm")
    _plant(files.lock, b"", uid=OTHER_UID)
    with pytest.raises(TransportError, match=f"lock file .* belongs to uid {OTHER_UID}"):
        flowrl.WeightPublisher(channel)

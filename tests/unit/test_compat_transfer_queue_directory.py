"""The compat client's key directory: the same answers in-process and through its zmq server
(msgpack messages), errors crossing back as TransportError."""

from __future__ import annotations

import pytest

from flowrl import Column
from flowrl.compat.transfer_queue._directory import DirectoryServer, KeyDirectory, RemoteDirectory
from flowrl.errors import TransportError, UnknownTaskError


@pytest.fixture(params=["local", "served"])
def directory(request, tmp_path):
    local = KeyDirectory()
    if request.param == "local":
        yield local
        return
    server = DirectoryServer(local, f"ipc://{tmp_path}/directory")
    remote = RemoteDirectory(server.address)
    yield remote
    remote.close()
    server.close()


def test_keys_tags_fields_and_columns(directory) -> None:
    assert directory.lookup("train", ["a", "b"]) == [-1, -1]
    assert directory.bind("train", ["a", "b"], [10, 11]) == [10, 11]
    assert directory.bind("train", ["b", "c"], [20, 21]) == [11, 21]  # b keeps its sample
    directory.update("train", [10, 11], [{"s": 1}, {"s": 2}], ["ids"])
    directory.update("train", [11], [{"t": 3}], ["response"])
    assert directory.describe([10, 11]) == ([{"s": 1}, {"s": 2, "t": 3}], ["ids"])
    assert directory.describe([11]) == ([{"s": 2, "t": 3}], ["ids", "response"])
    assert directory.listing(None) == {"train": {"a": {"s": 1}, "b": {"s": 2, "t": 3}, "c": {}}}
    assert directory.listing("val") == {}
    assert directory.remove("train", ["a", "zz"]) == [10]
    assert list(directory.listing("train")["train"]) == ["b", "c"]
    directory.bind("train", ["d"], [30])
    directory.forget([30, 99])  # by index: an unknown one is ignored
    assert list(directory.listing("train")["train"]) == ["b", "c"]
    directory.remove_partition("train")
    assert directory.listing(None) == {}
    ids = Column.ragged("ids", "int64")
    directory.declare([ids, Column.scalar("r", "float32")])
    directory.declare([Column.scalar("ids", "int64")])  # the first declaration stays
    assert directory.columns(["ids", "nope"]) == [ids]


def test_a_refused_request_raises_transport_error(tmp_path) -> None:
    server = DirectoryServer(KeyDirectory(), f"ipc://{tmp_path}/directory")
    remote = RemoteDirectory(server.address)
    try:
        with pytest.raises(TransportError, match="bind"):
            remote.bind("p", ["a", "b"], [1])  # lengths differ: refused by the server
        assert remote.lookup("p", ["a"]) == [-1]  # the server still answers
    finally:
        remote.close()
        server.close()


def test_wait_changed_wakes_on_a_tag_change(directory) -> None:
    """A waiter sleeps until keys or tags change (a replay buffer's wake-up), not longer."""
    import threading
    import time

    start = directory.generation()
    assert directory.wait_changed(start, 0.01) == start  # nothing changed: times out
    directory.bind("train", ["a"], [1])
    bound = directory.generation()
    assert bound != start and directory.wait_changed(start, 5.0) == bound  # already moved

    timer = threading.Timer(0.05, directory.update, ("train", [1], [{"status": "finished"}], []))
    timer.start()
    began = time.monotonic()
    woke = directory.wait_changed(bound, 30.0)
    timer.join()
    assert woke != bound and time.monotonic() - began < 30.0
    assert directory.listing("train") == {"train": {"a": {"status": "finished"}}}
    before = directory.generation()
    directory.lookup("train", ["a"])
    directory.describe([1])
    assert directory.generation() == before  # reads are not changes


def test_a_sampler_task_that_is_gone_crosses_back_as_unknown_task_error(tmp_path) -> None:
    """Another process's clear_partition unregistered the task: the caller learns it as
    UnknownTaskError (and registers the task again), not as a TransportError."""
    pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
    from flowrl import Hub
    from flowrl.compat.transfer_queue._sampling import SamplerRunner
    from flowrl.compat.transfer_queue.sampler import GRPOGroupNSampler

    hub = Hub([Column.scalar("x", "int64")])
    server = DirectoryServer(
        KeyDirectory(), f"ipc://{tmp_path}/directory", SamplerRunner(hub, GRPOGroupNSampler())
    )
    remote = RemoteDirectory(server.address)
    try:
        with pytest.raises(UnknownTaskError, match="'tq:t:p:x' is not registered"):
            remote.sample("tq:t:p:x", "t", "p", 2, {})
        hub.register_task("tq:t:p:x", ["x"], partition="p")
        assert remote.sample("tq:t:p:x", "t", "p", 2, {}) == []  # nothing put yet
    finally:
        remote.close()
        server.close()
        hub.close()

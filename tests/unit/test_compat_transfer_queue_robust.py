"""flowrl.compat.transfer_queue under bad input and a full hub (issue 24, item 7): a tag
msgpack cannot encode is refused at the caller, a malformed request to the key directory
is answered with an error and the directory keeps serving, and a put that finds the hub
full raises flowrl's Timeout instead of blocking forever; each leaves the hub unchanged."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import zmq

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402
from flowrl import Hub, HubConfig  # noqa: E402
from flowrl.compat.transfer_queue._directory import (  # noqa: E402
    DirectoryServer,
    KeyDirectory,
    RemoteDirectory,
)
from flowrl.errors import ConfigError, SchemaError, Timeout  # noqa: E402

TensorDict = tensordict.TensorDict


@pytest.fixture(params=["local", "served"])
def client(request, tmp_path):
    """A client whose key directory is in this process, or served over zmq."""
    hub = Hub(config=HubConfig(capacity=2))
    local = KeyDirectory()
    if request.param == "local":
        yield tq.TransferQueueClient(hub, local, put_timeout=0.1)
    else:
        server = DirectoryServer(local, f"ipc://{tmp_path}/directory")
        c = tq.TransferQueueClient(hub, RemoteDirectory(server.address), put_timeout=0.1)
        yield c
        c.close()
        server.close()
    hub.close()


def _ids(*rows: list[int]) -> TensorDict:
    return TensorDict({"ids": torch.tensor(rows)}, batch_size=len(rows))


def test_a_tag_msgpack_cannot_encode_is_refused_before_anything_changes(client) -> None:
    client.kv_batch_put(["a"], "p", _ids([1, 2]), [{"s": 1}])
    with pytest.raises(SchemaError, match="msgpack"):
        client.kv_put(
            "b", "p", TensorDict({"ids": torch.tensor([[3, 4]])}, batch_size=1), tag={"o": object()}
        )
    with pytest.raises(SchemaError, match="tag 1"):
        client.kv_batch_put(["a", "c"], "p", None, [{"s": 2}, {"f": [object()]}])
    assert client.kv_list("p") == {"p": {"a": {"s": 1}}}
    assert client.hub.statistics().live == 1
    meta = client.get_meta(["ids"], 1, "p", task_name="t")
    meta.update_custom_meta([{"bad": object()}])
    with pytest.raises(SchemaError, match="msgpack"):
        client.set_custom_meta(meta)
    # numpy scalars (a dataset's index) are stored as the Python numbers they hold
    client.kv_put("a", "p", tag={"index": np.int64(7)})
    assert client.kv_list("p")["p"]["a"] == {"s": 1, "index": 7}
    assert client.kv_batch_get(["a"], "p")["ids"].values().tolist() == [1, 2]


def test_a_put_into_a_full_hub_times_out_and_changes_nothing(client) -> None:
    client.kv_batch_put(["a", "b"], "p", _ids([1], [2]), [{}, {}])  # capacity 2: full
    with pytest.raises(Timeout, match=r"no room for 1 new samples.*total_storage_size"):
        client.kv_put("c", "p", TensorDict({"ids": torch.tensor([[3]])}, batch_size=1))
    with pytest.raises(Timeout):  # a key that exists and a new one: the old keeps its value
        client.kv_batch_put(["a", "d"], "p", _ids([9], [9]), [{"s": 1}, {"s": 1}], timeout=0.05)
    with pytest.raises(Timeout):
        client.put(_ids([5]), partition_id="q", timeout=0)
    assert client.kv_list("p") == {"p": {"a": {}, "b": {}}}
    assert client.kv_batch_get(["a", "b"], "p")["ids"].values().tolist() == [1, 2]
    assert client.hub.statistics().live == 2
    client.kv_clear(["b"], "p")  # room again
    client.kv_put("c", "p", TensorDict({"ids": torch.tensor([[3]])}, batch_size=1))
    assert sorted(client.kv_list("p")["p"]) == ["a", "c"]


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, "1", True])
def test_timeouts_must_be_finite_seconds(client, bad) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        client.kv_put("a", "p", tag={}, timeout=bad)
    with pytest.raises(ConfigError, match="put_timeout"):
        tq.init({"flowrl": {"put_timeout": bad}})


def test_the_default_put_timeout_is_finite_and_configurable() -> None:
    config = tq.init(
        {"backend": {"SimpleStorage": {"total_storage_size": 1}}, "flowrl": {"put_timeout": 0.05}}
    )
    try:
        assert config["flowrl"]["put_timeout"] == 0.05
        tq.kv_put("a", "p", tag={"x": 1})
        with pytest.raises(Timeout):
            tq.kv_batch_put(["b"], "p", tags=[{}])
    finally:
        tq.close()
    assert math.isfinite(tq.init()["flowrl"]["put_timeout"])
    tq.close()


@pytest.mark.parametrize(
    "frames",
    [
        [b"a", b"b"],
        [b"not msgpack"],
        [msgspec.msgpack.encode({"method": "nope", "args": []})],
        [msgspec.msgpack.encode({"method": "lookup", "args": []})],
    ],
)
def test_the_directory_answers_a_malformed_request_and_keeps_serving(tmp_path, frames) -> None:
    server = DirectoryServer(KeyDirectory(), f"ipc://{tmp_path}/directory")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    remote = RemoteDirectory(server.address)
    try:
        raw.send_multipart(frames)
        assert raw.poll(10_000), "the directory did not answer a malformed request"
        reply = msgspec.msgpack.decode(raw.recv())
        assert reply["error"]
        assert remote.bind("p", ["a"], [3]) == [3]  # still serving
        assert remote.lookup("p", ["a"]) == [3]
    finally:
        raw.close()
        remote.close()
        server.close()

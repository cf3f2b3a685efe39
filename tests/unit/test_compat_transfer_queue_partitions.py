"""flowrl.compat.transfer_queue with one partition per step, as verl's TransferQueue trainer
runs (``train_0``, ``train_1``, ..., each cleared after its step): a cleared partition
leaves nothing in the hub, so the hub's tasks and columns stay as many however many steps
ran (they grew by a task and a column a partition, and every call slowed down with them)."""

from __future__ import annotations

import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402

TensorDict = tensordict.TensorDict
STEPS = 12


@pytest.fixture(params=["inproc", "zmq"])
def client(request):
    tq.init({"flowrl": {"placement": request.param, "fetch_timeout": 5.0}})
    yield tq.get_client()
    tq.close()


def _batch(n: int = 4, start: int = 0) -> TensorDict:
    return TensorDict(
        {"ids": torch.arange(start, start + n * 3).reshape(n, 3), "r": torch.ones(n)}, [n]
    )


def _firsts(rows) -> list[int]:
    return [int(row[0]) for row in rows.unbind(0)]


def _footprint(client) -> tuple[set[str], set[str], dict[str, int], int]:
    stats = client.hub.statistics()
    return set(stats.tasks), set(client.hub.schema.by_name), stats.partitions, stats.live


def _step(client, partition: str) -> None:
    client.put(data=_batch(), partition_id=partition)
    meta = client.get_meta(["ids", "r"], 4, partition, task_name="actor")
    client.get_data(meta)
    written = client.put(TensorDict({"adv": torch.zeros(4)}, [4]), metadata=meta)
    assert client.get_meta(["adv", "ids"], 4, partition, task_name="update").size == 4
    assert written.size == 4
    tq.kv_batch_put(keys=["a", "b"], partition_id=partition, fields=_batch(2))
    assert tq.kv_batch_get(keys=["a", "b"], partition_id=partition)["r"].shape == (2,)
    client.clear_partition(partition)


def test_a_cleared_partition_leaves_nothing_in_the_hub(client) -> None:
    _step(client, "train_0")
    first = _footprint(client)
    assert first[2:] == ({}, 0)  # no sample left, no partition
    for step in range(1, STEPS):
        _step(client, f"train_{step}")
        assert _footprint(client) == first
    assert first[0] == {"_tq_clear"}  # the one task that holds samples until cleared
    assert first[1] == {"ids", "r", "adv", "_tq_in", "_tq_clear"}
    assert client.get_partition_list() == []


def test_status_after_clear_partition_is_transferqueues(client) -> None:
    """As TransferQueue: a cleared partition is not listed and nothing of it is consumed;
    it can be filled again under the same name."""
    client.put(data=_batch(), partition_id="p")
    client.put(data=_batch(2), partition_id="q")
    assert not client.check_consumption_status("actor", "p")  # never fetched
    client.get_meta(["ids"], 4, "p", task_name="actor")
    assert client.check_consumption_status("actor", "p")
    assert client.get_partition_list() == ["p", "q"]
    client.clear_partition("p")
    assert client.get_partition_list() == ["q"]
    assert not client.check_consumption_status("actor", "p")
    client.put(data=_batch(2, 100), partition_id="p")
    assert client.get_partition_list() == ["p", "q"]
    assert not client.check_consumption_status("actor", "p")  # the new samples are not
    again = client.get_meta(["ids"], 2, "p", task_name="actor")
    assert _firsts(client.get_data(again)["ids"]) == [100, 103]
    assert client.check_consumption_status("actor", "p")


def test_a_task_name_that_ends_like_another_is_another_task(client) -> None:
    """check_consumption_status('a', p) counts task 'a' only, not a task named 'a:p'."""
    client.put(data=_batch(), partition_id="p")
    client.get_meta(["ids"], 4, "p", task_name="a")
    client.get_meta(["ids"], 2, "p", task_name="a:p")  # its hub task: tq:a:p:p:ids
    assert client.check_consumption_status("a", "p")
    assert not client.check_consumption_status("a:p", "p")


def test_another_client_fetches_from_a_partition_cleared_and_filled_again(client) -> None:
    """A client that fetched from a partition before another client cleared it registers
    its consumer task again (the clear unregistered it) and reads the new samples."""
    other = tq.TransferQueueClient(client.hub, client.directory, fetch_timeout=5.0)
    client.put(data=_batch(), partition_id="p")
    assert other.get_meta(["ids"], 4, "p", task_name="actor").size == 4
    client.clear_partition("p")
    assert "tq:actor:p:ids" not in client.hub.statistics().tasks
    client.put(data=_batch(3, 100), partition_id="p")
    meta = other.get_meta(["ids"], 3, "p", task_name="actor")
    assert _firsts(other.get_data(meta)["ids"]) == [100, 103, 106]
    client.clear_partition("p")
    assert _footprint(client)[2:] == ({}, 0)

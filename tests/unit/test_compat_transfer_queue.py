"""flowrl.compat.transfer_queue in-process: programs written as TransferQueue's tutorials
(tutorial/02_kv_interface.py, 01/03 for the client, 06 for the dataloader) and verl V1's
trainer / agent loop / replay buffer use TransferQueue, with ``import transfer_queue as tq``
replaced by the compat module."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402
from flowrl.errors import ConfigError, SchemaError, UnknownColumnError  # noqa: E402

TensorDict = tensordict.TensorDict
NonTensorStack = tensordict.NonTensorStack


@pytest.fixture
def q():
    tq.init({"flowrl": {"placement": "inproc", "fetch_timeout": 0.2}})
    yield tq
    tq.close()


def live(q) -> int:
    return q.get_client().hub.statistics().live


def test_kv_tutorial_flow(q) -> None:
    """tutorial/02_kv_interface.py, step by step."""
    one = TensorDict(
        {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3)},
        batch_size=1,
    )
    q.kv_put(
        key="0_0", partition_id="Train", fields=one, tag={"global_steps": 0, "status": "running"}
    )
    ids = torch.tensor([[4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]])
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=4)
    keys = ["1_0", "1_1", "1_2", "2_0"]
    meta = q.kv_batch_put(
        keys=keys, partition_id="Train", fields=batch, tags=[{"status": "running"}] * 4
    )
    assert meta.keys == keys and sorted(meta.fields) == ["attention_mask", "input_ids"]
    response = TensorDict({"response": torch.tensor([[4, 5, 6], [7, 8, 9]])}, batch_size=2)
    q.kv_batch_put(
        keys=["1_1", "2_0"], partition_id="Train", fields=response, tags=[{"status": "finish"}] * 2
    )
    q.kv_put(key="0_0", partition_id="Train", fields=None, tag={"status": "finish"})

    listed = q.kv_list()
    assert list(listed) == ["Train"]
    assert listed["Train"]["0_0"] == {"global_steps": 0, "status": "finish"}  # tags merge
    assert [listed["Train"][k]["status"] for k in keys] == [
        "running",
        "finish",
        "running",
        "finish",
    ]

    all_keys = list(listed["Train"])
    got = q.kv_batch_get(keys=all_keys, partition_id="Train", select_fields="input_ids")
    assert list(got.keys()) == ["input_ids"]
    rows = got["input_ids"].unbind(0)
    assert [r.tolist() for r in rows] == [[1, 2, 3], *ids.tolist()]
    everything = q.kv_batch_get(keys=all_keys, partition_id="Train")
    assert sorted(everything.keys()) == ["attention_mask", "input_ids"]  # common fields only
    answered = q.kv_batch_get(keys=["1_1", "2_0"], partition_id="Train")
    assert [r.tolist() for r in answered["response"].unbind(0)] == [[4, 5, 6], [7, 8, 9]]
    with pytest.raises(ConfigError, match="not ready"):
        q.kv_batch_get(keys=all_keys, partition_id="Train", select_fields=["response"])

    # fields never put are left out, as TransferQueue does (verl V1 asks for ref_log_prob
    # and values when it runs with no reference policy or critic)
    asked = ["input_ids", "ref_log_prob", "values"]
    assert list(q.kv_batch_get(keys=keys, partition_id="Train", select_fields=asked).keys()) == [
        "input_ids"
    ]
    with pytest.raises(UnknownColumnError, match=r"none of the fields \['values'\]"):
        q.kv_batch_get(keys=keys, partition_id="Train", select_fields=["values"])

    before = live(q)
    q.kv_clear(keys=all_keys[:2], partition_id="Train")
    assert list(q.kv_list(partition_id="Train")["Train"]) == all_keys[2:]
    assert live(q) == before - 2  # the cleared samples were evicted


def test_kv_put_dict_of_one_sample_and_value_kinds(q) -> None:
    nested = torch.nested.nested_tensor_from_jagged(
        torch.arange(6, dtype=torch.int64), offsets=torch.tensor([0, 1, 6])
    )
    fields = TensorDict(
        {
            "reward": torch.tensor([0.5, -1.0]),
            "tokens": nested,
            "image": torch.arange(2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 3),
            "prompt": NonTensorStack("a", "bc"),
            "extra": NonTensorStack({"k": 1}, {"k": 2}),
            # numpy scalars, as a dataset's index and verl's per-sample metadata carry them
            "index": NonTensorStack(np.int64(7), {"steps": np.int32(3), "w": [np.float32(0.5)]}),
        },
        batch_size=2,
    )
    q.kv_batch_put(keys=["a", "b"], partition_id="p", fields=fields)
    q.kv_put(key="c", partition_id="q", fields={"reward": torch.tensor(2.0), "prompt": "x"})
    got = q.kv_batch_get(keys=["a", "b"], partition_id="p")
    assert torch.equal(got["reward"], torch.tensor([0.5, -1.0]))
    assert [t.tolist() for t in got["tokens"].unbind(0)] == [[0], [1, 2, 3, 4, 5]]
    assert [t.shape for t in got["image"].unbind(0)] == [(2, 3), (2, 3)]
    assert torch.equal(got["image"].values().reshape(2, 2, 3), fields["image"])
    assert got["prompt"] == ["a", "bc"]
    assert got["extra"] == [{"k": 1}, {"k": 2}]
    assert got["index"] == [7, {"steps": 3, "w": [0.5]}]
    single = q.kv_batch_get(keys="c", partition_id="q")
    assert single["reward"].tolist() == [2.0] and single["prompt"] == ["x"]
    got["reward"][0] = 9.0  # reads are the caller's copies
    assert (
        q.kv_batch_get(keys="a", partition_id="p", select_fields="reward")["reward"].item() == 0.5
    )


def test_client_put_get_meta_get_data_per_task_and_partition(q) -> None:
    """tutorial/01 and 03: insert, fetch by task, write back, fetch the new field."""
    client = q.get_client()
    prompts = torch.arange(8 * 4).reshape(8, 4)
    inserted = client.put(
        data=TensorDict({"prompts": prompts}, batch_size=8), partition_id="train_0"
    )
    client.put(data=TensorDict({"prompts": prompts[:2]}, batch_size=2), partition_id="train_1")
    assert inserted.size == 8 and inserted.field_names == ["prompts"]
    assert torch.equal(client.get_data(inserted)["prompts"].values().reshape(8, 4), prompts)

    meta = client.get_meta(
        data_fields=["prompts"], batch_size=4, partition_id="train_0", task_name="generate"
    )
    assert meta.size == 4 and meta.is_ready and meta.partition_ids == ["train_0"] * 4
    data = client.get_data(meta)
    rows = {tuple(r.tolist()) for r in data["prompts"].unbind(0)}
    rest = client.get_meta(
        data_fields=["prompts"], batch_size=4, partition_id="train_0", task_name="generate"
    )
    assert not set(rest.global_indexes) & set(meta.global_indexes)  # consumed per task
    with pytest.raises(TimeoutError):  # all 8 consumed; train_1's 2 are another partition
        client.get_meta(["prompts"], batch_size=1, partition_id="train_0", task_name="generate")
    again = client.get_meta(["prompts"], batch_size=8, partition_id="train_0", task_name="other")
    assert sorted(again.global_indexes) == sorted(inserted.global_indexes)  # another task

    responses = TensorDict({"responses": torch.ones(4, 3, dtype=torch.int64)}, batch_size=4)
    written = client.put(data=responses, metadata=meta)
    assert written.field_names == ["prompts", "responses"]
    trained = client.get_meta(
        ["prompts", "responses"], batch_size=4, partition_id="train_0", task_name="train"
    )
    assert sorted(trained.global_indexes) == sorted(meta.global_indexes)
    assert {tuple(r.tolist()) for r in client.get_data(trained)["prompts"].unbind(0)} == rows

    before = live(q)
    client.clear_partition("train_0")
    assert live(q) == before - 8
    assert client.get_partition_list() == ["train_1"]


def test_custom_meta_and_polling_mode() -> None:
    tq.init({"controller": {"polling_mode": True}})
    try:
        client = tq.get_client()
        empty = client.get_meta(["x"], batch_size=2, partition_id="p", task_name="t")
        assert empty.size == 0  # polling: nothing put yet, no wait
        client.put(TensorDict({"x": torch.arange(3)}, batch_size=3), partition_id="p")
        meta = client.get_meta(["x"], batch_size=2, partition_id="p", task_name="t")
        meta.update_custom_meta([{"score": 1}, {"score": 2}])
        client.set_custom_meta(meta)
        again = client.get_meta(["x"], batch_size=2, partition_id="p", task_name="u")
        assert again.get_all_custom_meta() == [{"score": 1}, {"score": 2}]
        assert client.get_meta(["x"], batch_size=2, partition_id="p", task_name="t").size == 0
        first, second = again.chunk(2)
        assert first.size == second.size == 1 and first.custom_meta == [{"score": 1}]
    finally:
        tq.close()


def test_async_api(q) -> None:
    async def main() -> list:
        fields = TensorDict({"ids": torch.arange(6).reshape(3, 2)}, batch_size=3)
        await q.async_kv_batch_put(keys=["x", "y", "z"], partition_id="s", fields=fields)
        await q.async_kv_put(key="x", partition_id="s", tag={"status": "done"})
        listed = await q.async_kv_list("s")
        got = await q.async_kv_batch_get(keys=["x", "z"], partition_id="s")
        await q.async_kv_clear(keys="y", partition_id="s")
        client = q.get_client()
        await client.async_put(TensorDict({"v": torch.ones(2)}, batch_size=2), partition_id="w")
        meta = await client.async_get_meta(["v"], 2, "w", task_name="t")
        data = await client.async_get_data(meta)
        return [listed, got, data, await q.async_kv_list("s")]

    listed, got, data, after = asyncio.run(main())
    assert listed["s"]["x"] == {"status": "done"}
    assert [r.tolist() for r in got["ids"].unbind(0)] == [[0, 1], [4, 5]]
    assert data["v"].tolist() == [1.0, 1.0]
    assert list(after["s"]) == ["x", "z"]


def test_streaming_dataloader_finite_mode(q) -> None:
    """tutorial/06: a producer fills a partition, a trainer iterates micro-batches."""
    client = q.get_client()
    client.put(TensorDict({"ids": torch.arange(12)}, batch_size=12), partition_id="train")
    dataset = q.StreamingDataset(
        config=None,
        batch_size=4,
        micro_batch_size=2,
        data_fields=["ids"],
        partition_id="train",
        task_name="update_actor",
        dp_rank=0,
        should_check_consumption_status=True,
    )
    seen = []
    for batch, meta in q.StreamingDataLoader(dataset, num_workers=0):
        assert batch.batch_size[0] == meta.size == 2
        seen += batch["ids"].tolist()
    assert sorted(seen) == list(range(12))


def test_verl_v1_replay_buffer_flow(q) -> None:
    """verl V1: the trainer registers prompts, agent loops update their status and write
    trajectories, the replay buffer polls kv_list, reads rm_scores and clears groups."""
    uids = ["u0", "u1"]
    prompts = TensorDict({"input_ids": torch.arange(6).reshape(2, 3)}, batch_size=2)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": 3} for _ in uids]
    q.kv_batch_put(keys=uids, partition_id="train", tags=tags, fields=prompts)

    async def agent_loop(uid: str, n: int) -> None:
        await q.async_kv_put(key=uid, partition_id="train", tag={"status": "running"})
        keys = [f"{uid}_{i}" for i in range(n)]
        lengths = [i + 1 for i in range(n)]
        scores = torch.nested.as_nested_tensor(
            [torch.full((m,), float(m)) for m in lengths], layout=torch.jagged
        )
        fields = TensorDict({"rm_scores": scores}, batch_size=n)
        await q.async_kv_batch_put(
            keys=keys, partition_id="train", fields=fields, tags=[{"uid": uid}] * n
        )
        await q.async_kv_put(key=uid, partition_id="train", tag={"status": "finished"})

    async def generate() -> None:
        await asyncio.gather(agent_loop("u0", 2), agent_loop("u1", 3))

    asyncio.run(generate())
    listed = q.kv_list()["train"]
    finished = [k for k, t in listed.items() if t.get("is_prompt") and t["status"] == "finished"]
    assert finished == uids and listed["u0"]["global_steps"] == 3
    trajectories = sorted(k for k in listed if "_" in k)  # the two loops ran concurrently
    assert trajectories == ["u0_0", "u0_1", "u1_0", "u1_1", "u1_2"]
    assert [listed[k]["uid"] for k in trajectories] == ["u0", "u0", "u1", "u1", "u1"]
    data = q.kv_batch_get(keys=trajectories, partition_id="train", select_fields=["rm_scores"])
    sums = [float(s.sum()) for s in data["rm_scores"]]
    assert sums == [1.0, 4.0, 1.0, 4.0, 9.0]  # trajectory i has i + 1 scores of i + 1
    q.kv_clear(partition_id="train", keys=[*uids, *trajectories])
    assert q.kv_list("train") == {"train": {}}
    assert live(q) == 0


def test_bad_input_is_refused_and_changes_nothing(q) -> None:
    fields = TensorDict({"x": torch.arange(3)}, batch_size=3)
    q.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)
    before = (q.kv_list(), live(q))
    with pytest.raises(ConfigError, match="tags must be a list of 2"):
        q.kv_batch_put(keys=["d", "e"], partition_id="p", tags=[{}])
    with pytest.raises(SchemaError, match="batch size 3"):
        q.kv_batch_put(keys=["d", "e"], partition_id="p", fields=fields)
    with pytest.raises(SchemaError, match="bfloat16"):
        q.kv_batch_put(
            keys=["d"], partition_id="p", fields=TensorDict({"y": torch.ones(1, 2).bfloat16()}, [1])
        )
    with pytest.raises(SchemaError, match="keeps the kind"):  # x is a scalar column
        q.kv_batch_put(
            keys=["d"], partition_id="p", fields=TensorDict({"x": torch.ones(1, 2)}, [1])
        )
    with pytest.raises(SchemaError, match="reserved"):
        q.kv_batch_put(
            keys=["d"], partition_id="p", fields=TensorDict({"_tq_x": torch.ones(1)}, [1])
        )
    with pytest.raises(ConfigError, match="distinct"):
        q.kv_batch_put(keys=["d", "d"], partition_id="p", tags=[{}, {}])
    with pytest.raises(ConfigError, match="neither"):
        q.kv_batch_put(keys=["d"], partition_id="p")
    with pytest.raises(ConfigError, match=r"\['zz'\] are not in partition 'p'"):
        q.kv_batch_get(keys=["a", "zz"], partition_id="p")
    assert (q.kv_list(), live(q)) == before
    client = q.get_client()
    with pytest.raises(ConfigError, match="task_name"):
        client.get_meta(["x"], batch_size=1, partition_id="p")
    with pytest.raises(ConfigError, match="'fetch' only"):
        client.get_meta(["x"], batch_size=1, partition_id="p", mode="insert", task_name="t")
    with pytest.raises(ConfigError, match="positive int"):
        client.get_meta(["x"], batch_size=0, partition_id="p", task_name="t")
    with pytest.raises(ConfigError, match="partition_id must be a str"):
        client.put(fields, partition_id=None)
    with pytest.raises(SchemaError, match="TensorDict"):
        client.put({"x": torch.arange(3)}, partition_id="p")
    assert (q.kv_list(), live(q)) == before


def test_init_refuses_unsupported_config() -> None:
    with pytest.raises(ConfigError, match="names no sampler"):
        tq.init({"controller": {"sampler": "FancySampler"}})
    with pytest.raises(ConfigError, match="must be a sampler"):
        tq.init({"controller": {"sampler": 3}})
    with pytest.raises(ConfigError, match="placement"):
        tq.init({"flowrl": {"placement": "k8s"}})
    with pytest.raises(ConfigError, match="num_data_storage_units"):
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 0}}})
    with pytest.raises(ConfigError, match="not initialised"):
        tq.get_client()


def test_two_clients_name_the_same_fields_in_another_order(q) -> None:
    """Regression: a consumer task's columns were registered in the caller's field order, so
    a second client asking for the same fields in another order was refused."""
    first = q.get_client()
    first.put(TensorDict({"a": torch.arange(4), "b": torch.arange(4)}, [4]), partition_id="p")
    second = q.TransferQueueClient(first.hub, first.directory, fetch_timeout=0.2)
    assert first.get_meta(["a", "b"], 2, "p", task_name="t").size == 2
    rest = second.get_meta(["b", "a"], 2, "p", task_name="t")  # the same consumer
    assert rest.size == 2 and rest.field_names == ["a", "b"]


def test_clear_samples_forgets_their_keys(q) -> None:
    """Regression: clear_samples evicted keyed samples but kv_list still listed their keys."""
    fields = TensorDict({"x": torch.arange(3)}, batch_size=3)
    q.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)
    client = q.get_client()
    meta = client.get_meta(["x"], 2, "p", task_name="t")
    client.clear_samples(meta)
    assert len(q.kv_list("p")["p"]) == 1 and live(q) == 1
    left = next(iter(q.kv_list("p")["p"]))
    assert q.kv_batch_get(keys=left, partition_id="p")["x"].shape == (1,)


def test_dataloader_workers_need_a_hub_they_can_join(q) -> None:
    q.get_client().put(TensorDict({"ids": torch.arange(4)}, [4]), partition_id="train")
    dataset = q.StreamingDataset(None, 2, 2, ["ids"], "train", "t", 0, True)
    with pytest.raises(ConfigError, match="placement"):
        list(q.StreamingDataLoader(dataset, num_workers=1))


def test_batch_meta_pickles_without_its_client(q) -> None:
    """Regression: a BatchMeta held its client (zmq sockets), so a DataLoader worker could
    not hand it to its parent (torch pickles what workers yield)."""
    import pickle

    client = q.get_client()
    client.put(TensorDict({"x": torch.arange(2)}, [2]), partition_id="p")
    meta = client.get_meta(["x"], 2, "p", task_name="t")
    meta.update_custom_meta([{"a": 1}, {"a": 2}])
    client.set_custom_meta(meta)
    fresh = client.get_meta(["x"], 2, "p", task_name="u")
    copy = pickle.loads(pickle.dumps(fresh))
    assert copy.global_indexes == fresh.global_indexes and copy.field_names == ["x"]
    assert copy.custom_meta == [{"a": 1}, {"a": 2}]  # fetched through this process's client
    assert client.get_data(copy)["x"].tolist() == client.get_data(fresh)["x"].tolist()

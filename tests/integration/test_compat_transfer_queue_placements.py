"""flowrl.compat.transfer_queue across processes: the zmq placement (a second process joins
with a bare ``tq.init()``, as TransferQueue's second process finds its controller) and the
Ray placement (a Ray task joins through the named actor)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402

pytestmark = pytest.mark.integration

TensorDict = tensordict.TensorDict

WORKER = textwrap.dedent(
    """
    import torch
    from tensordict import TensorDict
    import flowrl.compat.transfer_queue as tq

    tq.init()  # joins the parent's hub through FLOWRL_TQ_ADDRESS
    client = tq.get_client()
    meta = client.get_meta(["prompts"], 4, "train", task_name="generate")
    prompts = client.get_data(meta)["prompts"]
    responses = [p * 10 for p in prompts.unbind(0)]
    out = TensorDict(
        {"responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged)},
        batch_size=4,
    )
    client.put(out, metadata=meta)
    tags = [{"status": "done", "index": i} for i in meta.global_indexes]
    tq.kv_batch_put(keys=[f"k{i}" for i in meta.global_indexes], partition_id="kv",
                    fields=TensorDict({"score": torch.ones(4)}, batch_size=4), tags=tags)
    tq.close()
    """
)


def test_zmq_placement_second_process_joins() -> None:
    tq.init({"flowrl": {"placement": "zmq", "fetch_timeout": 60.0}})
    try:
        client = tq.get_client()
        prompts = TensorDict({"prompts": torch.arange(12).reshape(4, 3)}, batch_size=4)
        client.put(prompts, partition_id="train")
        subprocess.run([sys.executable, "-c", WORKER], check=True, timeout=120)

        meta = client.get_meta(["prompts", "responses"], 4, "train", task_name="train")
        data = client.get_data(meta)
        for p, r in zip(data["prompts"].unbind(0), data["responses"].unbind(0), strict=True):
            assert torch.equal(r, p * 10)  # the worker's field, declared in its process
        listed = tq.kv_list("kv")["kv"]
        assert sorted(listed) == sorted(f"k{i}" for i in meta.global_indexes)
        assert all(t["status"] == "done" for t in listed.values())
        scores = tq.kv_batch_get(keys=list(listed), partition_id="kv")
        assert scores["score"].tolist() == [1.0] * 4
        tq.kv_clear(keys=list(listed), partition_id="kv")
        client.clear_partition("train")
        assert client.hub.statistics().live == 0
    finally:
        tq.close()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_placement_task_joins(ray_runtime) -> None:
    ray = pytest.importorskip("ray")
    ray_runtime.single()
    try:
        tq.init({"flowrl": {"placement": "ray"}})

        @ray.remote(num_cpus=0)
        def producer() -> list[str]:
            import flowrl.compat.transfer_queue as joined

            joined.init()
            fields = TensorDict({"x": torch.arange(3)}, batch_size=3)
            meta = joined.kv_batch_put(keys=["a", "b", "c"], partition_id="p", fields=fields)
            joined.close()
            return meta.keys

        assert ray.get(producer.remote()) == ["a", "b", "c"]
        got = tq.kv_batch_get(keys=["c", "a"], partition_id="p")
        assert got["x"].tolist() == [2, 0]
    finally:
        tq.close()


RANK = textwrap.dedent(
    """
    import json, sys
    import flowrl.compat.transfer_queue as tq

    tq.init()  # joins; the hub's sampler is the parent's RankAwareSampler
    client = tq.get_client()
    config = {"dp_rank": int(sys.argv[1]), "batch_index": 0}
    meta = client.get_meta(["x"], 3, "train", task_name="actor", sampling_config=config)
    print(json.dumps(client.get_data(meta)["x"].tolist()))
    tq.close()
    """
)


def test_zmq_ranks_of_a_group_in_other_processes_get_the_same_batch() -> None:
    """Issue 24, item 5: the hub's sampler runs in the process that called init, so ranks
    in other processes share its cache, as TransferQueue's controller-side sampler."""
    tq.init({"controller": {"sampler": "RankAwareSampler"},
             "flowrl": {"placement": "zmq", "fetch_timeout": 60.0}})  # fmt: skip
    try:
        tq.get_client().put(TensorDict({"x": torch.arange(9)}, batch_size=9), partition_id="train")

        def rank(dp_rank: int) -> list[int]:
            run = [sys.executable, "-c", RANK, str(dp_rank)]
            out = subprocess.run(run, check=True, timeout=120, capture_output=True, text=True)
            return json.loads(out.stdout.strip().splitlines()[-1])

        group0 = [rank(0), rank(0)]
        group1 = rank(1)
        assert group0[0] == group0[1] and len(group0[0]) == 3
        assert not set(group0[0]) & set(group1)
        config = {"dp_rank": 1, "batch_index": 0}
        here = tq.get_client().get_meta(["x"], 3, "train", task_name="actor",
                                        sampling_config=config)  # fmt: skip
        assert tq.get_client().get_data(here)["x"].tolist() == group1
    finally:
        tq.close()


@pytest.mark.ray
@pytest.mark.slow
def test_a_ray_worker_with_no_hub_to_join_fails_at_once(ray_runtime) -> None:
    """Issue 24, item 6: the driver's hub is in-process, so a worker's bare ``tq.init()``
    has nothing to join; it raises (saying how to join) instead of starting a private hub
    whose puts the driver would never see."""
    ray = pytest.importorskip("ray")
    from flowrl.errors import ConfigError

    ray_runtime.single()
    tq.init()  # the default: in-process, in the driver only
    try:

        @ray.remote(num_cpus=0)
        def worker(conf: dict | None) -> str:
            import flowrl.compat.transfer_queue as joined

            joined.init(conf)
            try:
                return joined.get_client().hub.__class__.__name__
            finally:
                joined.close()

        with pytest.raises(ConfigError, match=r"Ray worker found no TransferQueue hub.*'ray'"):
            ray.get(worker.remote(None))
        # a hub of the worker's own, asked for by name, is the worker's to have
        assert ray.get(worker.remote({"flowrl": {"placement": "inproc"}})) == "Hub"
    finally:
        tq.close()


@pytest.mark.parametrize("where", ["inproc", "zmq"])
def test_compat_benchmark_runs_and_checks_what_it_read(where: str) -> None:
    """The --peer benchmark's compat side at a tiny size (it compares every sample read
    with what was put, and fails otherwise)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "_transferqueue_peer.py"
    args = ["--client", "compat", "--placement", where]
    args += ["--samples", "64", "--seq-len", "16", "--batch", "8", "--serve"]
    out = subprocess.run(
        [sys.executable, str(script), *args],
        input="round\nround\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    info, *rounds = (json.loads(line) for line in out.stdout.splitlines())
    assert info["placement"] == where and info["samples"] == 64
    assert len(rounds) == 2  # one per 'round' line, the client started once
    assert all(r["put_samples_per_s"] > 0 and r["get_samples_per_s"] > 0 for r in rounds)
    calls = ("put", "get_meta", "get_data", "kv_batch_put", "kv_batch_get")  # each timed apart
    assert all(r[f"{call}_s"] > 0 for r in rounds for call in calls)


def test_zmq_streaming_dataloader_worker_process_joins() -> None:
    """A DataLoader worker (a forked process) joins the hub instead of using the parent's
    sockets, and the parent's iteration sees every sample once."""
    tq.init({"flowrl": {"placement": "zmq", "fetch_timeout": 30.0}})
    try:
        tq.get_client().put(TensorDict({"ids": torch.arange(12)}, [12]), partition_id="train")
        dataset = tq.StreamingDataset(
            config=None,
            batch_size=4,
            micro_batch_size=2,
            data_fields=["ids"],
            partition_id="train",
            task_name="update_actor",
            dp_rank=0,
            should_check_consumption_status=True,
        )
        seen = [
            i
            for batch, _ in tq.StreamingDataLoader(dataset, num_workers=1)
            for i in batch["ids"].tolist()
        ]
        assert sorted(seen) == list(range(12))
    finally:
        tq.close()

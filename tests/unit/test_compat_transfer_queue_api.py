"""TransferQueue's public modules under flowrl.compat.transfer_queue (issue 24, item 5):
``metadata`` (a program builds ``BatchMeta`` itself and reads it with ``get_data``) and
``sampler`` (samplers passed to ``tq.init``, the rank-aware one giving every rank of a
data-parallel group the same batch). Written from TransferQueue's documented behaviour;
where TransferQueue is installed (the ``peer`` extra) the records and samplers are also
compared with its own on the same calls."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

tensordict = pytest.importorskip("tensordict", reason="needs the compat extra (tensordict)")
torch = pytest.importorskip("torch")

import flowrl.compat.transfer_queue as tq  # noqa: E402
from flowrl.compat.transfer_queue import metadata, sampler  # noqa: E402
from flowrl.errors import ConfigError  # noqa: E402

TensorDict = tensordict.TensorDict


def _real(module: str):
    return pytest.importorskip(f"transfer_queue.{module}", reason="TransferQueue not installed")


# -- metadata --------------------------------------------------------------------------------
def _schema():
    return {
        "ids": {"dtype": torch.int64, "shape": None, "is_nested": True, "is_non_tensor": False,
                "per_sample_shapes": [(3,), (1,), (4,), (2,), (5,)]},
        "reward": {"dtype": torch.float32, "shape": (), "is_nested": False,
                   "is_non_tensor": False},
    }  # fmt: skip


def _build(module, **extra):
    return module.BatchMeta(
        global_indexes=[10, 11, 12, 13, 14],
        partition_ids=["a", "a", "b", "a", "b"],
        field_schema=_schema(),
        production_status=np.array([1, 1, 1, 0, 1]),
        extra_info={"step": 3},
        custom_meta=[{"k": i} for i in range(5)],
        **extra,
    )


def _view(meta) -> tuple:
    """What a program reads of a BatchMeta."""
    return (
        meta.size,
        len(meta),
        list(meta.global_indexes),
        list(meta.partition_ids),
        meta.field_names,
        meta.production_status.tolist(),
        meta.is_ready,
        meta.get_all_custom_meta(),
        meta.get_all_extra_info(),
        {f: meta.get_shapes(f) for f in meta.field_names},
        {f: meta.get_dtypes(f) for f in meta.field_names},
    )


def _operations(module) -> list[tuple]:
    """The same calls on a BatchMeta of ``module``; what each gives."""
    meta = _build(module)
    out = [_view(meta)]
    out += [_view(part) for part in meta.chunk(3)]
    out += [_view(part) for part in meta.chunk_by_partition()]
    out.append(_view(meta.select_samples([4, 0])))
    out.append(_view(meta.select_fields(["reward", "nope"])))
    out.append(_view(meta[1:4]))
    out.append(_view(meta[-1]))
    out.append(_view(module.BatchMeta.concat([meta[:2], module.BatchMeta.empty(), meta[2:]])))
    other = meta.select_fields(["reward"])
    other.update_custom_meta([{"x": 1}] * 5)
    out.append(_view(meta.union(other)))
    moved = meta.copy()
    moved.reorder([4, 3, 2, 1, 0])
    out.append(_view(moved))
    added = module.BatchMeta([1, 2], ["p", "p"])
    added.add_fields(TensorDict({"m": torch.zeros(2, 3)}, batch_size=2))
    out.append((_view(added), added.field_schema["m"]["shape"]))
    out.append(_view(module.BatchMeta.empty(extra_info={"e": 1})))
    return out


def test_batchmeta_methods_give_what_transferqueue_documents() -> None:
    meta = _build(metadata)
    assert meta.field_names == ["ids", "reward"] and not meta.is_ready  # sample 13 unproduced
    assert [len(p) for p in meta.chunk(3)] == [2, 2, 1]
    assert [p.global_indexes for p in meta.chunk_by_partition()] == [[10, 11, 13], [12, 14]]
    assert meta[1:3].get_shapes("ids") == [(1,), (4,)]
    assert meta[1:3].get_all_custom_meta() == [{"k": 1}, {"k": 2}]
    merged = metadata.BatchMeta.concat([meta[:2], meta[2:]])
    assert _view(merged) == _view(meta)
    with pytest.raises(ConfigError, match="extra_info 'step'"):
        other = meta[2:]
        other.set_extra_info("step", 4)
        metadata.BatchMeta.concat([meta[:2], other])
    with pytest.raises(ValueError, match="global_indexes"):  # ConfigError is a ValueError
        metadata.BatchMeta([1, 2], ["p"])
    with pytest.raises(ValueError, match="permutation"):
        meta.reorder([0, 0, 1, 2, 3])


def test_batchmeta_matches_transferqueues() -> None:
    real = _real("metadata")
    assert _operations(metadata) == _operations(real)


def test_a_batchmeta_built_by_hand_reads_its_samples() -> None:
    tq.init({"flowrl": {"fetch_timeout": 0.2}})
    try:
        client = tq.get_client()
        rows = [torch.arange(n) for n in (3, 1, 4, 2)]
        data = TensorDict(
            {"ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
             "reward": torch.arange(4.0)},
            batch_size=4,
        )  # fmt: skip
        put = client.put(data, partition_id="p")
        assert put.field_names == ["ids", "reward"] and put.is_ready
        assert put.field_schema["reward"]["dtype"] == torch.float32
        picked = [put.global_indexes[2], put.global_indexes[0]]
        mine = metadata.BatchMeta(picked, ["p", "p"], field_schema={"ids": {}, "reward": {}})
        got = client.get_data(mine)
        assert [r.tolist() for r in got["ids"].unbind(0)] == [[0, 1, 2, 3], [0, 1, 2]]
        assert got["reward"].tolist() == [2.0, 0.0]
        only = client.get_data(mine.select_fields(["reward"]))
        assert list(only.keys()) == ["reward"]
    finally:
        tq.close()


# -- samplers, called directly -----------------------------------------------------------------
def _rank_aware_calls(module) -> list:
    s = module.RankAwareSampler()
    ready = list(range(10))
    calls = []
    for dp_rank, batch_index, n in [(0, 0, 4), (0, 0, 4), (1, 0, 4), (0, 1, 8), (1, 0, 4)]:
        got = s.sample(ready, n, dp_rank=dp_rank, batch_index=batch_index, task_name="t",
                       partition_id="p")  # fmt: skip
        ready = [i for i in ready if i not in got[1]]
        config = {"dp_rank": dp_rank, "batch_index": batch_index}
        calls.append((got, s.has_cached_result("p", "t", config)))
    s.clear_cache("p")
    calls.append(s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0}))
    return calls


def _grpo_calls(module) -> list:
    rng = random.Random(7)
    s = module.GRPOGroupNSampler(n_samples_per_prompt=3)
    calls = []
    for batch_index in range(6):
        ready = sorted(rng.sample(range(30), rng.randint(0, 30)))
        calls.append(s.sample(ready, 6, task_name="t", partition_id="p", dp_rank=batch_index % 2,
                              batch_index=batch_index // 2))  # fmt: skip
    calls.append(s.sample([0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6))
    return calls


def test_samplers_follow_transferqueues_documentation() -> None:
    calls = _rank_aware_calls(sampler)
    assert calls[0] == (([0, 1, 2, 3], [0, 1, 2, 3]), True)
    assert calls[1] == calls[0]  # the second rank of group 0: the same batch
    assert calls[2] == (([4, 5, 6, 7], [4, 5, 6, 7]), True)  # group 1: other samples
    assert calls[3] == (([], []), False)  # only 2 left for a batch of 8
    assert calls[-1] is False  # the partition's cache cleared
    assert _grpo_calls(sampler)[-1] == ([3, 4, 5, 9, 10, 11], [3, 4, 5, 9, 10, 11])
    assert sampler.SequentialSampler().sample([5, 3, 9], 2) == ([5, 3], [5, 3])
    with pytest.raises(ValueError, match="multiple"):
        sampler.GRPOGroupNSampler(4).sample(list(range(8)), 6)


def test_samplers_match_transferqueues() -> None:
    real = _real("sampler")
    assert _rank_aware_calls(sampler) == _rank_aware_calls(real)
    assert _grpo_calls(sampler) == _grpo_calls(real)
    ready = list(range(20, 5, -1))
    assert sampler.SequentialSampler()(ready, 4) == real.SequentialSampler()(ready, 4)


# -- samplers through tq.init ------------------------------------------------------------------
@pytest.fixture(params=["name", "class", "instance"])
def rank_aware(request):
    given = {"name": "RankAwareSampler", "class": sampler.RankAwareSampler,
             "instance": sampler.RankAwareSampler()}[request.param]  # fmt: skip
    tq.init({"controller": {"sampler": given}, "flowrl": {"fetch_timeout": 0.5}})
    client = tq.get_client()
    client.put(TensorDict({"x": torch.arange(16)}, batch_size=16), partition_id="train")
    yield client
    tq.close()


def _fetch(client, dp_rank: int, batch_index: int, batch: int = 4) -> list[int]:
    config = {"dp_rank": dp_rank, "batch_index": batch_index}
    meta = client.get_meta(["x"], batch, "train", task_name="actor", sampling_config=config)
    return client.get_data(meta)["x"].tolist()


def test_ranks_of_a_group_get_the_same_batch(rank_aware) -> None:
    """Two data-parallel groups of two ranks each (threads), two batches each."""
    got: dict[tuple[int, int], list[list[int]]] = {}

    def rank(group: int, member: int) -> None:
        got[group, member] = [_fetch(rank_aware, group, b) for b in range(2)]

    threads = [threading.Thread(target=rank, args=(g, m)) for g in (0, 1) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0, 0] == got[0, 1] and got[1, 0] == got[1, 1]
    handed = [x for g in (0, 1) for batch in got[g, 0] for x in batch]
    assert sorted(handed) == list(range(16))  # the groups split the samples, none twice
    with pytest.raises(TimeoutError):  # all consumed: a new batch index waits, then times out
        _fetch(rank_aware, 0, 2)
    assert _fetch(rank_aware, 1, 1) == got[1, 0][1]  # a late rank still gets its group's batch
    rank_aware.clear_partition("train")


class NewestFirst(sampler.BaseSampler):
    """A user's sampler: newest samples first; marks only even ones consumed."""

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        taken = sorted(ready_indexes, reverse=True)[:batch_size]
        return taken, [i for i in taken if i % 2 == 0]


def test_a_users_sampler_chooses_and_marks_consumed() -> None:
    tq.init({"controller": {"sampler": NewestFirst()}, "flowrl": {"fetch_timeout": 0.3}})
    try:
        client = tq.get_client()
        put = client.put(TensorDict({"x": torch.arange(6)}, batch_size=6), partition_id="p")
        first = client.get_meta(["x"], 2, "p", task_name="t")
        assert first.global_indexes == sorted(put.global_indexes, reverse=True)[:2]
        second = client.get_meta(["x"], 2, "p", task_name="t")
        consumed_first = [i for i in first.global_indexes if i % 2 == 0]
        assert not set(consumed_first) & set(second.global_indexes)
        odd_of_first = [i for i in first.global_indexes if i % 2]
        assert set(odd_of_first) <= set(second.global_indexes)  # not consumed: handed again
    finally:
        tq.close()


def test_grpo_sampler_hands_out_whole_groups_only() -> None:
    tq.init({"controller": {"sampler": sampler.GRPOGroupNSampler(n_samples_per_prompt=2)},
             "flowrl": {"fetch_timeout": 0.2, "placement": "inproc"}})  # fmt: skip
    try:
        client = tq.get_client()
        client.put(TensorDict({"x": torch.arange(6)}, batch_size=6), partition_id="p")
        first = client.get_meta(["x"], 6, "p", task_name="gen")
        done = first.select_samples([0, 1, 3])  # responses: group 0 whole, group 1 half
        client.put(TensorDict({"r": torch.ones(3)}, batch_size=3), metadata=done)
        with pytest.raises(TimeoutError):
            client.get_meta(["x", "r"], 4, "p", task_name="train")
        got = client.get_meta(["x", "r"], 2, "p", task_name="train")
        assert got.global_indexes == first.global_indexes[:2]
    finally:
        tq.close()


def test_streaming_loaders_of_one_group_yield_the_same_batches(rank_aware) -> None:
    """TransferQueue's tutorial 06 with dp ranks: loaders with the same ``dp_rank`` (two
    ranks of one group) yield the same micro-batches; another group's yield others."""

    def first_two(dp_rank: int) -> list[list[int]]:
        dataset = tq.StreamingDataset(config=None, batch_size=4, micro_batch_size=4,
                                      data_fields=["x"], partition_id="train",
                                      task_name="actor", dp_rank=dp_rank)  # fmt: skip
        loader = iter(tq.StreamingDataLoader(dataset))
        return [next(loader)[0]["x"].tolist() for _ in range(2)]

    rank0, rank0_again, rank1 = first_two(0), first_two(0), first_two(1)
    assert rank0 == rank0_again
    assert not {*rank0[0], *rank0[1]} & {*rank1[0], *rank1[1]}


def test_kvbatchmeta_owns_copies_of_its_tags() -> None:
    """Tags are copied deeply (empty ones included): changing the caller's dicts later
    changes nothing in the meta, as in TransferQueue."""
    tags = [{}, {"turns": [1, 2]}, {}]
    meta = metadata.KVBatchMeta(keys=["a", "b", "c"], tags=tags, partition_id="p")
    tags[0]["late"] = True
    tags[1]["turns"].append(3)
    assert meta.tags == [{}, {"turns": [1, 2]}, {}]
    assert all(mine is not theirs for mine, theirs in zip(meta.tags, tags, strict=True))
    real = pytest.importorskip("transfer_queue.metadata", reason="TransferQueue not installed")
    theirs = real.KVBatchMeta(keys=["a", "b", "c"], tags=[{}, {"turns": [1, 2]}, {}])
    assert theirs.tags == meta.tags

"""flowrl.integrations.verl against the real verl 0.9.1 (skipped where verl is absent).

CI runs these in a second venv with verl installed (.ci/run, ``pytest -m verl``).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError, SchemaError

pytestmark = pytest.mark.verl

verl = pytest.importorskip("verl", reason="verl==0.9.1 is not installed (see docs/verl.md)")
torch = pytest.importorskip("torch")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from flowrl.integrations.verl import (  # noqa: E402
    DataProtoLoader,
    HubAgentLoopManager,
    from_dataproto,
    require_verl,
    to_dataproto,
)

ALL = ["prompt_ids", "response_ids", "logp", "reward", "emb", "text", "extra", "other"]


def _rich_hub(n: int = 8, seed: int = 0) -> flowrl.Hub:
    hub = flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int32"),
            Column.ragged("logp", "float32"),
            Column.scalar("reward", "float32"),
            Column.tensor("emb", "float16", (2, 3)),
            Column.string("text"),
            Column.object("extra"),
            Column.ragged("other", "int8"),
        ]
    )
    hub.register_task("t", ALL)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n)
    hub.put(
        {
            "prompt_ids": [np.arange(rng.integers(1, 5)) + 7 for _ in range(n)],
            "response_ids": [np.arange(k, dtype=np.int32) + 100 for k in lengths],
            "logp": [rng.standard_normal(k).astype(np.float32) for k in lengths],
            "reward": rng.random(n).astype(np.float32),
            "emb": rng.random((n, 2, 3)).astype(np.float16),
            "text": [f"t{i}" for i in range(n)],
            "extra": [{"i": i, "tags": ["a", "b"][: i % 3]} for i in range(n)],
            "other": [np.arange(i % 3, dtype=np.int8) for i in range(n)],
        },
        groups=np.repeat(np.arange(n // 4), 4),
        version=3,
    )
    return hub


def _assert_same(a: flowrl.Batch, b: flowrl.Batch) -> None:
    assert a.columns == b.columns
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.meta.groups, b.meta.groups)
    np.testing.assert_array_equal(a.meta.versions, b.meta.versions)
    for name in a.columns:
        x, y = a[name], b[name]
        assert a.column(name) == b.column(name)
        if isinstance(x, flowrl.RaggedArray):
            assert x == y and x.dtype == y.dtype, name
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("layout", ["padded", "nopad"])
def test_round_trip_is_lossless_and_consistent(layout: str) -> None:
    hub = _rich_hub()
    batch = hub.get(hub.claim("t", 8))
    dp = to_dataproto(batch, layout=layout, meta_info={"temperature": 0.7})
    dp.check_consistency()
    assert dp.meta_info["temperature"] == 0.7
    assert list(dp.non_tensor_batch["uid"]) == [str(g) for g in batch.meta.groups]
    back = from_dataproto(dp)
    _assert_same(batch, back)
    half = dp.chunk(2)[1]  # verl's data-parallel split keeps every field
    _assert_same(hub.get(batch.meta.subset(np.arange(4, 8))), from_dataproto(half))
    hub.ack(back.meta)  # the rebuilt handle acks the original lease
    assert hub.statistics().tasks["t"].consumed == 8
    hub.close()


def test_padded_layout_is_what_verl_workers_expect() -> None:
    hub = _rich_hub()
    batch = hub.get(hub.claim("t", 8))
    dp = to_dataproto(batch, pad_token_id=-1, prompt_length=6, response_length=9)
    p, r = batch.ragged("prompt_ids"), batch.ragged("response_ids")
    assert dp.batch["prompts"].shape == (8, 6) and dp.batch["responses"].shape == (8, 9)
    assert torch.equal(
        dp.batch["input_ids"], torch.cat([dp.batch["prompts"], dp.batch["responses"]], 1)
    )
    for i in range(8):
        pl, rl = len(p[i]), len(r[i])
        assert dp.batch["prompts"][i, 6 - pl :].tolist() == p[i].tolist()  # left-padded
        assert (dp.batch["prompts"][i, : 6 - pl] == -1).all()
        assert dp.batch["responses"][i, :rl].tolist() == r[i].tolist()  # right-padded
        assert dp.batch["response_mask"][i].tolist() == [1] * rl + [0] * (9 - rl)
        assert dp.batch["attention_mask"][i].sum() == pl + rl
        # positions count real tokens only (verl's compute_position_id_with_mask)
        assert dp.batch["position_ids"][i, 6 - pl : 6 + rl].tolist() == list(range(pl + rl))
        assert dp.batch["logp"][i, :rl].tolist() == batch.ragged("logp")[i].tolist()
    assert isinstance(dp.non_tensor_batch["other"][0], np.ndarray)  # not token-aligned
    with pytest.raises(SchemaError, match="response_length=2 is shorter"):
        to_dataproto(batch, response_length=2)
    hub.close()


def test_bad_input_is_refused_with_a_clear_error() -> None:
    hub = flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.scalar("attention_mask", "int64"),
        ]
    )
    hub.register_task("t", ["prompt_ids", "response_ids", "attention_mask"])
    hub.put({"prompt_ids": [np.arange(3)], "response_ids": [np.arange(2)],
             "attention_mask": np.ones(1, dtype=np.int64)})  # fmt: skip
    batch = hub.get(hub.claim("t", 1))
    with pytest.raises(SchemaError, match=r"columns \['attention_mask'\] would replace"):
        to_dataproto(batch)
    assert "attention_mask" in set(to_dataproto(batch, layout="nopad").batch.keys())
    with pytest.raises(ConfigError, match="layout must be"):
        to_dataproto(batch, layout="packed")  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match=r"non_tensor names \['nope'\]"):
        to_dataproto(batch, non_tensor=["nope"])
    rich = _rich_hub()
    dp = to_dataproto(rich.get(rich.claim("t", 8)))
    dp.pop(batch_keys=["logp", "flowrl:rows"], non_tensor_batch_keys=["text"])
    with pytest.raises(SchemaError, match=r"lacks \['flowrl:rows', 'logp', 'text'\]"):
        from_dataproto(dp)
    rich.close()
    with pytest.raises(ConfigError, match="expects a verl DataProto"):
        from_dataproto({"x": torch.zeros(2)})
    hub.close()


def test_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verl, "__version__", "0.8.0")
    with pytest.raises(ImportError, match=r"supports verl==0\.9\.1 only, found verl 0\.8\.0"):
        require_verl()


# -- whole groups, evenly divisible batches ------------------------------------------------
def _put_groups_interleaved(hub: flowrl.Hub, rewards: np.ndarray, lengths: np.ndarray) -> None:
    """Members of different groups arrive interleaved and one at a time (streaming)."""
    n_groups, g = rewards.shape
    order = np.random.default_rng(1).permutation(n_groups * g)
    for flat in order:
        grp, k = divmod(int(flat), g)
        hub.put(
            {
                "prompt_ids": [np.full(3, grp)],
                "response_ids": [np.arange(lengths[grp, k]) + 1],
                "score": np.array([rewards[grp, k]], dtype=np.float32),
            },
            groups=grp,
        )


def _grpo_hub() -> flowrl.Hub:
    return flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.scalar("score", "float32"),
        ]
    )


def _token_rewards(dp: DataProto) -> torch.Tensor:
    """verl's outcome reward: the score on the last response token."""
    mask = dp.batch["response_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    last = (mask.sum(-1) - 1).clamp(min=0)
    out[torch.arange(len(dp)), last] = dp.batch["score"]
    return out


def test_grpo_advantage_on_hub_batches_equals_monolithic() -> None:
    n_groups, g, dp_size = 6, 4, 8
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, (n_groups, g)).astype(np.float32)
    rewards[2] = 1.0  # a group with zero variance
    lengths = rng.integers(1, 7, (n_groups, g))
    hub = _grpo_hub()
    cols = ["prompt_ids", "response_ids", "score"]
    loader = DataProtoLoader(
        hub,
        task="train",
        columns=cols,
        groups_per_batch=2,
        group_size=g,
        dp_size=dp_size,
        to_dataproto={"response_length": 8},
    )
    _put_groups_interleaved(hub, rewards, lengths)
    hub.end_stream()
    for dp in loader:
        assert len(dp) % dp_size == 0
        dp.chunk(dp_size)  # never "only support equal chunk"
        adv, _ = compute_grpo_outcome_advantage(
            _token_rewards(dp), dp.batch["response_mask"], dp.non_tensor_batch["uid"]
        )
        _check_against_monolithic(dp, adv, rewards)
    assert loader.statistics().samples == n_groups * g
    assert loader.statistics().trimmed == 0
    loader.close()
    hub.close()


def _check_against_monolithic(dp: DataProto, adv: torch.Tensor, rewards: np.ndarray) -> None:
    """The same samples, grouped by hand from the raw rewards, through the same function."""
    n_groups, g = rewards.shape
    mono_rewards = torch.zeros(n_groups * g, 1)
    mono_rewards[:, 0] = torch.from_numpy(rewards.reshape(-1))
    mono_index = np.repeat(np.arange(n_groups), g).astype(object)
    mono, _ = compute_grpo_outcome_advantage(mono_rewards, torch.ones(n_groups * g, 1), mono_index)
    mono_by_group = mono[:, 0].reshape(n_groups, g)
    groups = from_dataproto(dp).meta.groups
    for i in range(len(dp)):
        grp = int(groups[i])
        score = float(dp.batch["score"][i])
        expected = {
            round(float(a), 5)
            for a, r in zip(mono_by_group[grp], rewards[grp], strict=True)
            if r == score
        }
        assert round(float(adv[i, 0]), 5) in expected
        # the advantage covers the whole response and nothing past it
        length = int(dp.batch["response_mask"][i].sum())
        assert torch.allclose(adv[i, :length], adv[i, 0].expand(length))
        assert (adv[i, length:] == 0).all()


def test_no_partial_group_is_ever_emitted() -> None:
    g, dp_size = 3, 2  # lcm 6: batches of an even number of groups
    hub = _grpo_hub()
    loader = DataProtoLoader(
        hub,
        task="train",
        columns=["prompt_ids", "response_ids", "score"],
        groups_per_batch=4,
        group_size=g,
        dp_size=dp_size,
    )
    rewards = np.ones((7, g), dtype=np.float32)  # 7 groups: the tail of 3 loses one group
    _put_groups_interleaved(hub, rewards, np.full((7, g), 2))
    # plus an incomplete group that never finishes
    hub.put(
        {
            "prompt_ids": [np.arange(2)] * 2,
            "response_ids": [np.arange(2)] * 2,
            "score": np.zeros(2, dtype=np.float32),
        },
        groups=99,
    )
    hub.end_stream()
    seen: list[int] = []
    for dp in loader:
        assert len(dp) % dp_size == 0
        groups, counts = np.unique(from_dataproto(dp).meta.groups, return_counts=True)
        assert (counts == g).all() and 99 not in groups
        assert len(set(dp.non_tensor_batch["uid"])) == len(groups)
        seen.extend(groups.tolist())
    assert len(seen) == len(set(seen)) == 6
    assert loader.statistics().trimmed == g
    loader.close()
    hub.close()


def test_indivisible_batch_config_is_refused() -> None:
    hub = _grpo_hub()
    with pytest.raises(ConfigError, match="use a multiple of 4 groups per batch"):
        DataProtoLoader(
            hub, task="t", columns=["prompt_ids"], groups_per_batch=2, group_size=2, dp_size=8
        )
    hub.close()


# -- agent-loop manager ----------------------------------------------------------------------
class _Responder(threading.Thread):
    """A rollout stage: answers each prompt with its reversal + 1, holding back the groups
    in ``hold`` until ``release`` is set."""

    def __init__(self, hub: flowrl.HubClient, hold: set[int]) -> None:
        super().__init__(daemon=True)
        self.hub, self.hold = hub, hold
        self.release, self.released, self.stop = (threading.Event() for _ in range(3))
        hub.register_task("rollout", ["prompt_ids"])

    def run(self) -> None:
        held: list = []
        while not self.stop.is_set():
            if self.release.is_set():
                for meta in held:
                    self._answer(meta)
                held = []
                self.released.set()
            try:
                meta = self.hub.claim("rollout", 64, min_n=1, timeout=0.05)
            except flowrl.errors.Timeout:
                continue
            mine = np.isin(meta.groups, list(self.hold))
            if mine.any():
                held.append(meta.subset(np.flatnonzero(mine)))
            if (~mine).any():
                self._answer(meta.subset(np.flatnonzero(~mine)))

    def _answer(self, meta: flowrl.BatchMeta) -> None:
        prompts = self.hub.get(meta, ["prompt_ids"]).ragged("prompt_ids")
        # the response and the ack in one step: a sample the manager consumed is evicted
        # at once (a separate ack let a test see it live for a moment under load)
        self.hub.put({"response_ids": [p[::-1] + 1 for p in prompts]}, indices=meta, ack=meta)


def _config(**flowrl_settings: object) -> dict:
    return {
        "actor_rollout_ref": {"rollout": {"n": 2, "response_length": 6}},
        "data": {"max_prompt_length": 5},
        "flowrl": {"timeout": 30, **flowrl_settings},
    }


def _manager(hub: flowrl.Hub, config: dict) -> HubAgentLoopManager:
    class InProcessManager(HubAgentLoopManager):
        def open_hub(self) -> flowrl.HubClient:
            return hub

    return InProcessManager.create(config=config, llm_client=None)


def _prompts(uids: list[str], base: int) -> DataProto:
    """verl's gen batch: left-padded prompts, each uid repeated rollout.n=2 times."""
    rows = [np.arange(i % 3 + 1) + base + 3 * i for i in range(len(uids))]
    ids = torch.zeros(len(uids) * 2, 5, dtype=torch.long)
    mask = torch.zeros(len(uids) * 2, 5, dtype=torch.long)
    for i, row in enumerate(rows):
        for j in (2 * i, 2 * i + 1):
            ids[j, 5 - len(row) :] = torch.from_numpy(row)
            mask[j, 5 - len(row) :] = 1
    uid = np.array([u for u in uids for _ in range(2)], dtype=object)
    src = np.array([f"src-{u}" for u in uid], dtype=object)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask},
        non_tensors={"uid": uid, "data_source": src},
        meta_info={"global_steps": 1},
    )


def _check_served(out: DataProto) -> None:
    out.check_consistency()
    _, counts = np.unique(out.non_tensor_batch["uid"], return_counts=True)
    assert (counts == 2).all()  # whole groups only
    _check_responses(out)


def _check_responses(out: DataProto) -> None:
    resp = from_dataproto(out)
    for p, r in zip(resp.ragged("prompt_ids"), resp.ragged("response_ids"), strict=True):
        assert r.tolist() == (p[::-1] + 1).tolist()  # each response belongs to its prompt


def _manager_hub() -> flowrl.Hub:
    return flowrl.Hub(
        [
            Column.ragged("prompt_ids", "int64"),
            Column.ragged("response_ids", "int64"),
            Column.string("data_source"),
        ]
    )


def test_agent_loop_manager_serves_the_asked_groups_in_order() -> None:
    hub = _manager_hub()
    manager = _manager(hub, _config(columns=["data_source"]))
    responder = _Responder(hub, hold=set())
    responder.start()
    prompts = _prompts(["a", "b", "c"], base=10)
    out = manager.generate_sequences(prompts)
    _check_served(out)
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    assert list(out.non_tensor_batch["data_source"]) == list(
        prompts.non_tensor_batch["data_source"]
    )
    assert out.batch["responses"].shape == (6, 6) and out.batch["prompts"].shape == (6, 5)
    assert "timing" in out.meta_info and out.meta_info["global_steps"] == 1
    # verl's RayPPOTrainer unions the output with the rest of the step's batch
    rest = DataProto.from_dict(
        tensors={"row": torch.arange(6)},
        non_tensors={k: prompts.non_tensor_batch[k] for k in ("uid", "data_source")},
    )
    assert rest.union(out).batch["row"].tolist() == list(range(6))
    responder.stop.set()
    responder.join()
    hub.close()


def test_agent_loop_manager_carries_unfinished_groups_over() -> None:
    """serve=ready: the oldest complete groups, whoever's (for trainers that take the
    output as it comes; RayPPOTrainer's union needs serve=asked, the default)."""
    hub = _manager_hub()
    manager = _manager(hub, _config(serve="ready"))
    responder = _Responder(hub, hold={1})  # the second group fed (uid "b") straggles
    responder.start()
    # a group the hub already holds (the hub's own prompt source), complete
    hub.put(
        {"prompt_ids": [np.arange(3)] * 2, "response_ids": [np.arange(3)[::-1] + 1] * 2},
        groups=1000,
    )
    first = manager.generate_sequences(_prompts(["a", "b"], base=10))
    _check_served(first)
    assert sorted(set(first.non_tensor_batch["uid"])) == ["1000", "a"]  # "b" carried over
    responder.release.set()
    assert responder.released.wait(10)  # "b" completes before the next step's prompts
    second = manager.generate_sequences(_prompts(["c", "d"], base=20))
    _check_served(second)
    served = list(dict.fromkeys(second.non_tensor_batch["uid"]))
    assert served[0] == "b" and len(served) == 2  # the carried group is served first
    leftover = hub.statistics().tasks[manager.task]
    assert leftover.ready + leftover.leased <= 2  # one of c/d waits for the next call
    responder.stop.set()
    responder.join()
    hub.close()


def test_agent_loop_manager_refuses_bad_config() -> None:
    with pytest.raises(ConfigError, match=r"set flowrl\.address"):
        HubAgentLoopManager(config=_config())
    hub = _manager_hub()
    manager = _manager(hub, _config())
    bad = _prompts(["a"], base=1)[:1]
    with pytest.raises(ConfigError, match=r"every uid must appear rollout\.n=2 times"):
        manager.generate_sequences(bad)
    assert hub.statistics().live == 0 and manager._uid_of == {}  # nothing changed
    with pytest.raises(ConfigError, match="use serve=ready"):
        _manager(hub, _config(feed_prompts=False, serve="asked"))
    with pytest.raises(ConfigError, match="serve must be one of"):
        _manager(hub, _config(serve="oldest"))
    hub.close()


def _union_with_trainer_batch(prompts: DataProto, out: DataProto) -> DataProto:
    """What RayPPOTrainer does with the output: union with the rest of its batch (raises
    unless every row's uid and data_source line up)."""
    rest = DataProto.from_dict(
        tensors={"row": torch.arange(len(prompts))},
        non_tensors={k: prompts.non_tensor_batch[k] for k in ("uid", "data_source")},
    )
    return rest.union(out)


def test_asked_groups_keep_their_uids_while_others_wait() -> None:
    """serve=asked (default): a straggling group is waited for, a complete group the hub
    holds from elsewhere is not served (and stays claimable), and the output lines up row
    for row with the prompts, as RayPPOTrainer's union needs."""
    hub = _manager_hub()
    manager = _manager(hub, _config(columns=["data_source"]))
    responder = _Responder(hub, hold={1})  # the second group fed (uid "b") straggles
    responder.start()
    hub.put(
        {"prompt_ids": [np.arange(3)] * 2, "response_ids": [np.arange(3)[::-1] + 1] * 2,
         "data_source": ["other"] * 2},
        groups=1000,
    )  # fmt: skip
    threading.Timer(0.3, responder.release.set).start()
    prompts = _prompts(["a", "b"], base=10)
    out = manager.generate_sequences(prompts)
    _check_served(out)
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert _union_with_trainer_batch(prompts, out).batch["row"].tolist() == [0, 1, 2, 3]
    second = _prompts(["c"], base=20)
    assert list(manager.generate_sequences(second).non_tensor_batch["uid"]) == ["c", "c"]
    other = hub.claim("verl_rollout", 8, min_n=1, timeout=5)  # given back, still there
    assert other.groups.tolist() == [1000, 1000]
    hub.ack(other)
    assert hub.statistics().live == 0 and manager._uid_of == {}
    responder.stop.set()
    responder.join()
    hub.close()


def test_a_failed_call_leaves_nothing_behind() -> None:
    """A validation call that times out: its rows, answered later, are discarded by the
    next call (which serves its own groups) instead of lingering in the hub."""
    hub = _manager_hub()
    manager = _manager(hub, _config(timeout=0.5))
    responder = _Responder(hub, hold={-1})  # validation rows (no group) straggle
    responder.start()
    val = _prompts(["v"], base=30)
    val.meta_info["validate"] = True
    with pytest.raises(flowrl.errors.Timeout, match=r"2 not ready"):
        manager.generate_sequences(val)
    responder.release.set()
    assert responder.released.wait(10)
    manager.timeout = 30
    out = manager.generate_sequences(_prompts(["a"], base=10))
    assert list(out.non_tensor_batch["uid"]) == ["a", "a"]
    assert hub.statistics().live == 0 and not manager._abandoned
    responder.stop.set()
    responder.join()
    hub.close()


def test_validation_is_served_apart_from_training() -> None:
    """RayPPOTrainer's _validate: rows of val_kwargs.n=1 per uid, padded to the dp size by
    repeating rows; each row gets its own rollout in order, and validation samples never
    reach a training call, in either serve mode."""
    for serve in ("asked", "ready"):
        hub = _manager_hub()
        manager = _manager(hub, _config(columns=["data_source"], serve=serve))
        responder = _Responder(hub, hold=set())
        responder.start()
        train = _prompts(["a"], base=10)
        manager.generate_sequences(train)
        val = _prompts(["v", "w"], base=30)[[0, 2, 0, 2]]  # n=1, then two padding rows
        val.non_tensor_batch["uid"] = np.array(["v", "w", "v", "w"], dtype=object)
        val.meta_info["validate"] = True
        out = manager.generate_sequences(val)
        out.check_consistency()
        assert list(out.non_tensor_batch["uid"]) == ["v", "w", "v", "w"]
        assert torch.equal(out.batch["prompts"], val.batch["input_ids"])  # row for row
        _check_responses(out)
        assert _union_with_trainer_batch(val, out).batch["row"].tolist() == [0, 1, 2, 3]
        assert hub.statistics().live == 0  # validation samples consumed, none left over
        after = manager.generate_sequences(_prompts(["b", "c"], base=20))
        assert sorted(set(after.non_tensor_batch["uid"])) == ["b", "c"]
        responder.stop.set()
        responder.join()
        hub.close()


def test_example_runs() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "verl_grpo_step.py"
    spec = importlib.util.spec_from_file_location("verl_grpo_step", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 4


def test_docs_page_runs() -> None:
    """docs/verl.md's blocks carry '# doc: skip' for the main venv; they run here."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
    namespace: dict = {"__name__": "doc_verl"}
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        exec(compile(block, f"verl.md[block {i}]", "exec", dont_inherit=True), namespace)


def test_benchmark_runs_at_a_tiny_size() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "verl_dataproto.py"
    out = subprocess.run(
        [sys.executable, str(script), "--json", "--samples", "16", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["samples"] == 16 and report["to_dataproto_ms"] > 0

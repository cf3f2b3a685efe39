"""flowrl.integrations.slime with slime's Sample (flowrl.testing.slime's copy: slime is not on
PyPI), built the way slime's dataset, data source and generate functions build it."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import flowrl
from flowrl.errors import ConfigError, SchemaError
from flowrl.integrations.slime import (
    FEED_FIELDS,
    PROMPT_COLUMNS,
    RESULT_FIELDS,
    SAMPLE_FIELDS,
    HubDataSource,
    put_prompts,
    put_samples,
    rollout_function,
    sample_columns,
    sample_data,
    samples_from_batch,
)
from flowrl.testing.slime import Sample

#: slime/utils/types.py::Sample at THUDM/slime 624b824a (2026-08-21): every field, in
#: order, with its annotation as written there. flowrl.testing.slime's copy must match it.
SLIME_SAMPLE_FIELDS = (
    ("group_index", "int | None"),
    ("index", "int | None"),
    ("rollout_id", "int | None"),
    ("prompt", "str | list[dict[str, str]]"),
    ("tokens", "list[int]"),
    ("multimodal_inputs", "dict[str, Any] | None"),
    ("multimodal_train_inputs", "dict[str, Any] | None"),
    ("multimodal_train_input_id", "str | None"),
    ("apply_chat_template_kwargs", "dict"),
    ("response", "str"),
    ("response_length", "int"),
    ("label", "str | None"),
    ("reward", "float | dict[str, Any] | None"),
    ("loss_mask", "list[int] | None"),
    ("weight_versions", "list[str]"),
    ("rollout_log_probs", "list[float] | None"),
    ("rollout_top_p_token_ids", "list[int] | torch.Tensor | None"),
    ("rollout_top_p_token_offsets", "list[int] | torch.Tensor | None"),
    ("rollout_routed_experts", "list[list[int]] | torch.Tensor | None"),
    ("remove_sample", "bool"),
    ("teacher_log_probs", "list[float] | None"),
    ("status", "Status"),
    ("metadata", "dict"),
    ("generate_function_path", "str | None"),
    ("custom_rm_path", "str | None"),
    ("train_metadata", "dict | None"),
    ("session_id", "str | None"),
    ("non_generation_time", "float"),
    ("spec_info", "SpecInfo"),
    ("prefix_cache_info", "PrefixCacheInfo"),
)


def test_the_mirror_is_slimes_sample() -> None:
    assert [(f.name, f.type) for f in dataclasses.fields(Sample)] == list(SLIME_SAMPLE_FIELDS)
    assert len(SLIME_SAMPLE_FIELDS) == 30
    assert [s.value for s in Sample.Status] == [
        "pending",
        "completed",
        "truncated",
        "aborted",
        "failed",
    ]
    assert [f.name for f in dataclasses.fields(Sample.SpecInfo)] == [
        "spec_accept_token_num",
        "spec_draft_token_num",
        "spec_verify_ct",
        "completion_token_num",
    ]
    assert [f.name for f in dataclasses.fields(Sample.PrefixCacheInfo)] == [
        "cached_tokens",
        "total_prompt_tokens",
    ]


def test_every_field_but_the_group_is_a_column() -> None:
    names = [name for name, _ in SLIME_SAMPLE_FIELDS if name != "group_index"]
    assert sorted(SAMPLE_FIELDS) == sorted(names)
    assert sorted(FEED_FIELDS + RESULT_FIELDS) == sorted(names)
    declared = {c.name for c in sample_columns()}
    assert set(names) <= declared


def _prompt(i: int) -> Sample:
    """A prompt as slime's Dataset builds it (a VLM prompt: messages plus PIL images)."""
    image = Image.new("RGB", (3, 2), (i, 2 * i, 3))
    return Sample(
        prompt=[{"role": "user", "content": f"what is {i}+{i}?"}],
        label=str(2 * i),
        metadata={"tools": [{"name": "calc"}], "source": ("gsm8k", i)},
        multimodal_inputs={"images": [image], "videos": None},
    )


def _groups(n_groups: int, size: int) -> list[list[Sample]]:
    """Groups as slime's RolloutDataSource makes them: a deep copy of the prompt per sample."""
    groups, index = [], 0
    for g in range(n_groups):
        group = []
        for _ in range(size):
            sample = copy.deepcopy(_prompt(g))
            sample.group_index, sample.index = g, index
            index += 1
            group.append(sample)
        groups.append(group)
    return groups


def _generate(sample: Sample, k: int) -> None:
    """What slime's generate functions set: sglang's meta_info decoded as slime decodes it
    (int32 buffers for top-p replay and routed experts), OPD, VLM train inputs, stats."""
    n, layers, topk = 3 + k, 2, 2
    sample.rollout_id = sample.index // 2
    sample.tokens = [1, 2, 3, *range(10, 10 + n)]
    sample.multimodal_train_inputs = {
        "pixel_values": torch.randn(4, 6),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }
    sample.multimodal_train_input_id = f"mm-{sample.index}"
    sample.apply_chat_template_kwargs = {"enable_thinking": bool(k % 2)}
    sample.response, sample.response_length = "x" * n, n
    sample.reward = {"acc": 1.0, "fmt": -0.5} if k else 0.25
    sample.loss_mask = [1] * (n - 1) + [0]  # a tool token
    sample.weight_versions.append(str(k))
    sample.rollout_log_probs = [-0.1 * (t + 1) for t in range(n)]
    kept = np.arange(2 * n, dtype=np.int32)
    sample.rollout_top_p_token_ids = torch.frombuffer(bytearray(kept.tobytes()), dtype=torch.int32)
    sample.rollout_top_p_token_offsets = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
    rows = len(sample.tokens) - 1
    experts = np.arange(rows * layers * topk, dtype=np.int32) % 8
    sample.rollout_routed_experts = torch.from_numpy(experts).reshape(rows, layers, topk)
    sample.remove_sample = k == 1
    sample.teacher_log_probs = [-0.3] * n if k else None
    sample.status = Sample.Status.TRUNCATED if k else Sample.Status.COMPLETED
    sample.generate_function_path = "my.generate"
    sample.custom_rm_path = None if k else "my.rm"
    sample.train_metadata = {"loss": "sft"} if k else None
    sample.session_id = f"s{sample.group_index}"
    sample.non_generation_time = 0.125 * k
    meta_info = {"spec_accept_token_num": 3, "spec_draft_token_num": 4, "spec_verify_ct": 2}
    sample.spec_info.add({**meta_info, "completion_tokens": n})
    sample.prefix_cache_info.add({"cached_tokens": 2, "prompt_tokens": 3})


def _assert_same(got: Any, want: Any, where: str) -> None:
    """Equal values of the same types (tensors: dtype, shape and values; images: pixels)."""
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, Image.Image):
        assert (got.mode, got.size, got.tobytes()) == (want.mode, want.size, want.tobytes())
        assert got.getpalette() == want.getpalette(), where
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif dataclasses.is_dataclass(want):
        _assert_same(dataclasses.asdict(got), dataclasses.asdict(want), where)
    else:
        assert got == want, where


def _assert_samples(got: list[list[Sample]], want: list[list[Sample]]) -> None:
    assert [len(g) for g in got] == [len(g) for g in want]
    for gg, wg in zip(got, want, strict=True):
        for a, b in zip(gg, wg, strict=True):
            for name, _ in SLIME_SAMPLE_FIELDS:
                _assert_same(getattr(a, name), getattr(b, name), f"sample {b.index} {name}")


def test_every_field_round_trips_through_the_hub() -> None:
    hub = flowrl.Hub(sample_columns())
    hub.register_task("t", [c.name for c in sample_columns()])
    groups = _groups(3, 2)
    for group in groups[:2]:
        for k, sample in enumerate(group):
            _generate(sample, k)
    lists = groups[1][1]  # the list forms slime's types allow
    lists.rollout_top_p_token_ids = [5, 6]
    lists.rollout_top_p_token_offsets = [0, 1] + [2] * (lists.response_length - 1)
    lists.rollout_routed_experts = [[1, 2], [3, 4]]
    lists.metadata["scores"] = np.array([[0.5, 1.5]], dtype=np.float32)
    lists.metadata["top"] = np.int16(7)
    lists.metadata["raw"] = b"\x00\xff"
    lists.multimodal_inputs["images"].append(Image.new("P", (2, 2), 1))
    lists.multimodal_inputs["images"][-1].putpalette([9, 8, 7] * 256)
    lists.multimodal_inputs["videos"] = [torch.zeros(2, 3, 1, 1, dtype=torch.bfloat16)]
    # groups[2] keeps slime's defaults: None tensors, empty lists, PENDING
    put_samples(hub, groups[:1], fields=SAMPLE_FIELDS)
    ids = put_samples(hub, groups[1:], fields=FEED_FIELDS)
    hub.put(sample_data([s for g in groups[1:] for s in g]), indices=ids)
    back = samples_from_batch(hub.get(hub.claim("t", 6)), Sample)
    _assert_samples(back, groups)
    hub.close()


def test_refusals_name_the_field() -> None:
    hub = flowrl.Hub(sample_columns())
    with pytest.raises(ConfigError, match="same group_index"):
        put_samples(hub, [[_finished(1, 0), _finished(2, 0)]])
    with pytest.raises(ConfigError, match="Sample-like object with a 'index'"):
        put_samples(hub, [[SimpleNamespace(group_index=1)]])
    bad = [
        ("metadata", {"when": threading.Event()}, "'metadata'.*threading.Event"),
        ("rollout_routed_experts", [[1, 2], [3]], "rectangular"),
        ("loss_mask", [2**40], "int32"),
        ("teacher_log_probs", "abc", "expects a list"),
    ]
    for name, value, match in bad:
        sample = _finished(1, 0)
        setattr(sample, name, value)
        with pytest.raises(SchemaError, match=match):
            put_samples(hub, [[sample]], fields=SAMPLE_FIELDS)
    assert hub.statistics().live == 0  # nothing was put
    hub.register_task("t", ["loss_mask"])
    put_samples(hub, [[_finished(1, 0)]], fields=["loss_mask"])
    with pytest.raises(SchemaError, match="loss_mask_layout"):
        samples_from_batch(hub.get(hub.claim("t", 1)), Sample)

    @dataclass
    class Newer(Sample):
        new_field: int = 0

    with pytest.raises(ConfigError, match="new_field"):
        rollout_function(hub, sample_type=Newer)
    hub.close()


def _finished(group: int, k: int) -> Sample:
    sample = Sample(group_index=group, index=group * 10 + k, prompt="q")
    _generate(sample, k)
    return sample


def test_hub_data_source(tmp_path: Path) -> None:
    hub = flowrl.Hub(list(PROMPT_COLUMNS))
    source = HubDataSource(hub, sample_type=Sample, n_samples_per_prompt=2, save_dir=tmp_path)
    put_prompts(hub, [_prompt(i) for i in range(5)])
    assert len(source) == 5
    first = source.get_samples(2)
    assert [[(s.group_index, s.index, s.label) for s in g] for g in first] == [
        [(0, 0, "0"), (0, 1, "0")],
        [(1, 2, "2"), (1, 3, "2")],
    ]
    want = [
        [dataclasses.replace(_prompt(g), group_index=g, index=i) for i in (2 * g, 2 * g + 1)]
        for g in (0, 1)
    ]
    _assert_samples(first, want)  # messages, tools, tuples and PIL images come back
    first[0][0].metadata["tools"].append("x")  # each sample is its own copy, as in slime
    assert first[0][1].metadata["tools"] == [{"name": "calc"}]
    _generate(first[1][0], 1)
    first[1][0].status = Sample.Status.ABORTED
    source.add_samples([first[1]])  # an aborted partial rollout goes back, served first
    source.save(1)
    again = source.get_samples(2)
    assert all(a is b for a, b in zip(again[0], first[1], strict=True))
    assert again[1][0].label == "4"
    restored = HubDataSource(
        hub, sample_type=Sample, n_samples_per_prompt=2, save_dir=tmp_path, task="other"
    )
    restored.load(1)
    _assert_samples(restored.buffer, [first[1]])  # every field, tensors included
    assert restored.sample_index == 4
    with pytest.raises(ConfigError, match="n_samples_per_prompt=2"):
        source.add_samples([[first[0][0]]])
    hub.close()


class _RolloutStage(threading.Thread):
    """The hub's generation + reward stages: answers each fed sample; holds back ``hold``."""

    def __init__(self, hub: flowrl.Hub, hold: set[int]) -> None:
        super().__init__(daemon=True)
        self.hub, self.hold = hub, hold
        self.release, self.released, self.stop = (threading.Event() for _ in range(3))
        hub.register_task("generate", ["tokens", "prompt"])

    def run(self) -> None:
        held: list = []
        while not self.stop.is_set():
            if self.release.is_set() and not self.released.is_set():
                for meta in held:
                    self._answer(meta)
                self.released.set()
            try:
                meta = self.hub.claim("generate", 64, min_n=1, timeout=0.05)
            except flowrl.errors.Timeout:
                continue
            mine = np.isin(meta.groups, list(self.hold))
            if mine.any():
                held.append(meta.subset(np.flatnonzero(mine)))
            if (~mine).any():
                self._answer(meta.subset(np.flatnonzero(~mine)))

    def _answer(self, meta: flowrl.BatchMeta) -> None:
        tokens = self.hub.get(meta, ["tokens"]).ragged("tokens")
        samples = [
            Sample(
                tokens=[*t.tolist(), 9, 9],
                response="ok",
                response_length=2,
                reward=float(len(t)),
                loss_mask=[1, 1],
                rollout_log_probs=[-0.5, -0.5],
                weight_versions=["0"],
                status=Sample.Status.COMPLETED,
            )
            for t in tokens
        ]
        self.hub.put(sample_data(samples, ("tokens", *RESULT_FIELDS)), indices=meta, ack=meta)


def test_rollout_function_drains_completed_groups_and_carries_the_rest() -> None:
    prompts = flowrl.Hub(list(PROMPT_COLUMNS))
    source = HubDataSource(prompts, sample_type=Sample, n_samples_per_prompt=3)
    put_prompts(prompts, [Sample(prompt="ab" * (i + 1)) for i in range(6)])
    hub = flowrl.Hub(sample_columns())
    stage = _RolloutStage(hub, hold={1})  # group 1 straggles
    stage.start()
    generate_rollout = rollout_function(
        hub, sample_type=Sample, tokenize=lambda p: [ord(c) for c in p], timeout=30
    )
    args = SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=3)
    # a completed group left from before (the hub persists across steps)
    put_samples(hub, [[_finished(100, k) for k in range(3)]], fields=SAMPLE_FIELDS)
    first = generate_rollout(args, 0, source)
    assert sorted(g[0].group_index for g in first) == [0, 100]  # group 1 is carried over
    stage.release.set()
    assert stage.released.wait(10)
    second = generate_rollout(args, 1, source)
    assert second[0][0].group_index == 1  # the carried group comes first
    for group in first + second:
        assert len(group) == 3 and len({s.group_index for s in group}) == 1  # whole groups
        for s in group:
            assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    fresh = [s for g in first + second for s in g if s.group_index != 100]
    assert all(s.tokens[-2:] == [9, 9] and s.reward == len(s.tokens) - 2 for s in fresh)
    with pytest.raises(ConfigError, match="training rollouts only"):
        generate_rollout(args, 2, source, evaluation=True)
    stage.stop.set()
    stage.join()
    hub.close()
    prompts.close()


def test_example_runs() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "slime_rollout.py"
    spec = importlib.util.spec_from_file_location("slime_rollout", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        assert module.main() == 6  # 3 rollouts of 2 groups
    finally:
        del sys.modules[spec.name]


def test_integrations_import_neither_verl_nor_slime() -> None:
    """`import flowrl.integrations.*` stays light: verl is imported only when used."""
    import subprocess

    code = (
        "import sys, flowrl, flowrl.integrations.verl as v, flowrl.integrations.slime as s\n"
        "assert 'verl' not in sys.modules and 'slime' not in sys.modules\n"
        "for m in (v, s):\n"
        "    assert all(hasattr(m, n) for n in m.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

"""flowrl.integrations.slime with a Sample dataclass mirroring slime's (slime is not on PyPI)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.errors import ConfigError
from flowrl.integrations.slime import (
    PROMPT_COLUMNS,
    RESULT_FIELDS,
    HubDataSource,
    put_prompts,
    put_samples,
    rollout_function,
    sample_columns,
    samples_from_batch,
)


@dataclass
class Sample:
    """The fields of slime/utils/types.py::Sample (the ones a rollout touches)."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)


def _finished(group: int, k: int) -> Sample:
    return Sample(
        group_index=group,
        index=group * 10 + k,
        prompt=[{"role": "user", "content": f"q{group}"}],
        tokens=[1, 2, 3 + k],
        response=f"r{k}",
        response_length=1,
        label=None if k else "4",
        reward={"acc": 1.0} if k else 0.5,
        loss_mask=[1],
        weight_versions=["3"],
        rollout_log_probs=[-0.25],
        status=Sample.Status.TRUNCATED,
        metadata={"k": k},
    )


def test_samples_round_trip_through_the_hub() -> None:
    hub = flowrl.Hub(sample_columns())
    hub.register_task("t", [c.name for c in sample_columns()])
    groups = [[_finished(g, k) for k in range(3)] for g in (7, 2)]
    put_samples(hub, groups, fields=[c.name for c in sample_columns()])
    back = samples_from_batch(hub.get(hub.claim("t", 6)), Sample)
    assert back == groups
    with pytest.raises(ConfigError, match="same group_index"):
        put_samples(hub, [[_finished(1, 0), _finished(2, 0)]])
    with pytest.raises(ConfigError, match="Sample-like object with a 'index'"):
        put_samples(hub, [[SimpleNamespace(group_index=1)]])
    hub.close()


def test_hub_data_source(tmp_path: Path) -> None:
    hub = flowrl.Hub(list(PROMPT_COLUMNS))
    source = HubDataSource(hub, sample_type=Sample, n_samples_per_prompt=2, save_dir=tmp_path)
    put_prompts(hub, [SimpleNamespace(prompt=f"p{i}", label=str(i), metadata={}) for i in range(5)])
    assert len(source) == 5
    first = source.get_samples(2)
    assert [[(s.group_index, s.index, s.prompt) for s in g] for g in first] == [
        [(0, 0, "p0"), (0, 1, "p0")],
        [(1, 2, "p1"), (1, 3, "p1")],
    ]
    first[1][0].status = Sample.Status.ABORTED
    source.add_samples([first[1]])  # an aborted partial rollout goes back, served first
    source.save(1)
    again = source.get_samples(2)
    assert again[0] == first[1] and again[1][0].prompt == "p2"
    restored = HubDataSource(
        hub, sample_type=Sample, n_samples_per_prompt=2, save_dir=tmp_path, task="other"
    )
    restored.load(1)
    assert restored.buffer == [first[1]] and restored.sample_index == 4
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
        n = len(meta)
        self.hub.put(
            {
                "tokens": [np.append(t, [9, 9]) for t in tokens],
                "response": ["ok"] * n,
                "response_length": np.full(n, 2),
                "reward": [float(len(t)) for t in tokens],
                "loss_mask": [[1, 1]] * n,
                "rollout_log_probs": [[-0.5, -0.5]] * n,
                "weight_versions": [["0"]] * n,
                "status": ["completed"] * n,
            },
            indices=meta,
        )
        self.hub.ack(meta, meta.indices)


def test_rollout_function_drains_completed_groups_and_carries_the_rest() -> None:
    prompts = flowrl.Hub(list(PROMPT_COLUMNS))
    source = HubDataSource(prompts, sample_type=Sample, n_samples_per_prompt=3)
    put_prompts(
        prompts, [SimpleNamespace(prompt="ab" * (i + 1), label=None, metadata={}) for i in range(6)]
    )
    hub = flowrl.Hub(sample_columns())
    stage = _RolloutStage(hub, hold={1})  # group 1 straggles
    stage.start()
    generate_rollout = rollout_function(
        hub, sample_type=Sample, tokenize=lambda p: [ord(c) for c in p], timeout=30
    )
    args = SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=3)
    # a completed group left from before (the hub persists across steps)
    put_samples(
        hub, [[_finished(100, k) for k in range(3)]], fields=[c.name for c in sample_columns()]
    )
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
            assert set(RESULT_FIELDS) <= set(vars(s))
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

"""How ``--placement`` splits the machine's cores: halves when generation and training
overlap, every core for each phase when they cannot (a synchronous run), and a refusal
where there is only one core."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError
from flowrl.recipes.grpo_config import GRPOConfig
from flowrl.recipes.grpo_placement import Cores, plan_cores


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3, 0, 2, 1})


@pytest.mark.usefixtures("four_cores")
def test_streaming_splits_the_cores_and_synchronous_gives_each_phase_all() -> None:
    assert plan_cores(GRPOConfig()) is None  # colocated: one process, as before
    split = GRPOConfig(placement="disaggregated", max_staleness=1)
    assert plan_cores(split) == Cores((0, 1), (2, 3))
    sync = GRPOConfig(placement="disaggregated", max_staleness=0, torch_threads=1)
    assert plan_cores(sync) == Cores((0, 1, 2, 3), (0, 1, 2, 3), threads=1)


def test_one_core_cannot_hold_a_disaggregated_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5})
    with pytest.raises(ConfigError, match=r"--placement disaggregated: expected at least 2"):
        plan_cores(GRPOConfig(placement="disaggregated"))


def test_placement_task_and_threads_are_checked() -> None:
    with pytest.raises(ConfigError, match="--placement 'remote': expected one of colocated"):
        GRPOConfig(placement="remote")
    with pytest.raises(ConfigError, match="--task 'sort': expected one of arith, chain"):
        GRPOConfig(task="sort")
    with pytest.raises(ConfigError, match="--torch-threads -1: expected an int >= 0"):
        GRPOConfig(torch_threads=-1)

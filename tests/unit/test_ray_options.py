"""Options of the Ray placement that are checked before anything starts (no Ray runtime)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import flowrl
from flowrl import Column, Pipeline, RayExecutor, stage
from flowrl.errors import ConfigError

X = Column.scalar("x", "int64")


def test_stage_resources_default_to_one_cpu_and_are_kept_in_the_spec() -> None:
    @stage(outputs=[X], batch_size=2)
    def plain():
        return None

    @stage(outputs=[X], batch_size=2, num_cpus=0.5, num_gpus=4, placement_strategy="PACK")
    def engine():
        return None

    assert (plain.num_cpus, plain.num_gpus, plain.placement_strategy) == (1.0, 0.0, None)
    assert (engine.num_cpus, engine.num_gpus, engine.placement_strategy) == (0.5, 4.0, "PACK")


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"num_cpus": -1}, "num_cpus must be a number >= 0"),
        ({"num_cpus": "2"}, "num_cpus must be a number >= 0"),
        ({"num_gpus": float("nan")}, "num_gpus must be a number >= 0"),
        ({"num_gpus": True}, "num_gpus must be a number >= 0"),
        ({"num_gpus": 1.5}, "whole number of devices"),
        ({"num_gpus": 2, "placement_strategy": "pack"}, "placement_strategy must be one of"),
        ({"placement_strategy": "SPREAD"}, "num_gpus=0.0"),
        ({"num_gpus": 0.5, "placement_strategy": "SPREAD"}, "num_gpus=0.5"),
    ],
)
def test_bad_stage_resources_name_the_stage(options: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=r"stage 'src' at .*test_ray_options\.py") as info:

        @stage(outputs=[X], batch_size=2, name="src", **options)
        def fn():
            return None

    assert words in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"placement_timeout": 0}, "placement_timeout must be a positive number"),
        ({"max_restarts": -1}, "max_restarts must be an int >= 0"),
        ({"max_restarts": 1.0}, "max_restarts must be an int >= 0"),
        ({"timeout": -1}, "timeout must be a positive number"),
    ],
)
def test_bad_ray_executor_options(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        RayExecutor(**kwargs)


def test_ray_executor_needs_a_hub_its_workers_can_reach() -> None:
    @stage(outputs=[X], batch_size=2)
    def src():
        return {"x": np.arange(2)}

    with flowrl.Hub() as hub, pytest.raises(ConfigError, match="launch_ray_hub"):
        Pipeline([src]).run(hub, executor="ray")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"units_per_node": 0}, "units_per_node must be a positive int"),
        ({"units_per_node": True}, "units_per_node must be a positive int"),
        ({"config": {"n_units": 2}}, "config must be a HubConfig"),
    ],
)
def test_bad_ray_hub_options_fail_before_ray_starts(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        flowrl.launch_ray_hub([X], **kwargs)


def test_connect_checks_unit_nodes_before_connecting() -> None:
    with pytest.raises(ConfigError, match="unit_nodes must be a list of node ids"):
        flowrl.connect("ipc:///nowhere", unit_nodes="node-a")
    with pytest.raises(ConfigError, match="node must be a node id"):
        flowrl.connect("ipc:///nowhere", unit_nodes=["a"], node=3)  # type: ignore[arg-type]


def test_import_does_not_load_ray() -> None:
    code = "import sys, flowrl; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0

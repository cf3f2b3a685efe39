"""The process executor: one process per stage worker, each with its own hub client."""

from __future__ import annotations

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl._pipeline.admission import Staleness
from flowrl._pipeline.loader import Loader
from flowrl._pipeline.pipeline import Pipeline
from flowrl._pipeline.stage import stage
from flowrl.errors import ConfigError, StageError

pytestmark = pytest.mark.integration

X = Column.scalar("x", "int64")
Y = Column.scalar("y", "int64")
Z = Column.scalar("z", "float32")


@stage(outputs=[X], batch_size=4)
def numbers():
    for start in range(0, 24, 4):
        yield {"x": np.arange(start, start + 4)}


@stage(outputs=[X], batch_size=4)
def endless():
    return {"x": np.zeros(4, dtype=np.int64)}


@stage(inputs=["x"], outputs=[Y], batch_size=3, workers=2)
def double(batch):
    return {"y": batch.numpy("x") * 2}


@stage(inputs=["x", "y"], outputs=[Z], batch_size=5, min_batch=1)
def half(batch):
    return {"z": (batch.numpy("y") / 2).astype(np.float32)}


@stage(inputs=["x"], outputs=[Y], batch_size=4)
def fragile(batch):
    if (batch.numpy("x") >= 8).any():
        raise ValueError("bad sample")
    return {"y": batch.numpy("x")}


def test_three_stages_in_processes_deliver_every_sample_once() -> None:
    pipe = Pipeline([numbers, double, half])
    hub = flowrl.launch_hub(pipe.columns)
    try:
        loader = Loader(hub, task="check", columns=["x", "y", "z"], batch_size=4, timeout=60)
        with pipe.start(hub, executor="processes", timeout=120, loaders=[loader]) as run:
            seen = []
            for batch in loader:
                assert (batch.numpy("z") == batch.numpy("x")).all()
                seen.extend(batch.numpy("x").tolist())
        result = run.result()
        assert sorted(seen) == list(range(24))
        assert [s.samples for s in result.stages.values()] == [24, 24, 24]
        assert result.stages["double"].workers == 2 and result.completed
    finally:
        hub.close()


def test_a_failing_worker_process_surfaces_with_indices() -> None:
    hub = flowrl.launch_hub()
    try:
        with pytest.raises(StageError) as info:
            Pipeline([numbers, fragile]).run(hub, executor="processes", timeout=120)
        assert info.value.stage == "fragile" and min(info.value.indices) >= 8
        assert "ValueError: bad sample" in str(info.value.__cause__)
        assert hub.statistics().leases == 0
    finally:
        hub.close()


def test_staleness_and_max_samples_are_shared_by_source_processes() -> None:
    pipe = Pipeline([endless], staleness=Staleness(max_staleness=0, samples_per_version=8))
    hub = flowrl.launch_hub(pipe.columns)
    try:
        loader = Loader(hub, task="train", columns=["x"], batch_size=8, timeout=60)
        lags = []
        run = pipe.start(hub, executor="processes", max_samples=32, timeout=120, loaders=[loader])
        for step, batch in enumerate(loader, start=1):
            lags.extend((hub.version - batch.meta.versions).tolist())
            hub.publish_version(step)
        assert run.result().stages["endless"].samples == 32
        assert len(lags) == 32 and max(lags) == 0
    finally:
        hub.close()


def test_processes_need_a_multi_process_hub_and_importable_stages() -> None:
    with pytest.raises(ConfigError, match="launch_hub"):
        Pipeline([numbers]).run(flowrl.Hub(), executor="processes")

    @stage(outputs=[X], batch_size=1)
    def local():
        return None

    with pytest.raises(ConfigError, match="define the function or class at module level"):
        Pipeline([local]).run(executor="processes")

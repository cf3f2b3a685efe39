"""Pipelines: graph validation at construction, and runs on the thread executor."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from flowrl import BalancedSampler, Column, GroupSampler, Hub, HubConfig
from flowrl._pipeline.executors.driver import Restarts
from flowrl._pipeline.loader import Loader
from flowrl._pipeline.pipeline import Pipeline
from flowrl._pipeline.stage import Rows, StageContext, StageSpec, stage
from flowrl.errors import ConfigError, PipelineError, SchemaError, StageError, Timeout
from flowrl.events import StreamEnded

X = Column.scalar("x", "int64")
Y = Column.scalar("y", "int64")
Z = Column.scalar("z", "float32")


def counter_source(n: int, batch: int = 4, name: str = "numbers") -> StageSpec:
    """A source creating samples x = 0..n-1, ``batch`` per call."""
    starts = iter(range(0, n, batch))

    def numbers() -> dict | None:
        start = next(starts, None)
        if start is None:
            return None
        return {"x": np.arange(start, min(start + batch, n))}

    return stage(outputs=[X], batch_size=batch, name=name)(numbers)


# -- validation --------------------------------------------------------------------------------
def test_input_without_producer_names_stage_and_column() -> None:
    @stage(inputs=["x", "reward"], batch_size=2)
    def train(batch):
        return None

    with pytest.raises(PipelineError) as info:
        Pipeline([counter_source(4), train])
    text = str(info.value)
    assert "stage 'train' (" in text and __file__ in text
    assert "reads column 'reward', which no stage produces" in text
    assert "outputs=['reward']" in text  # the hint


def test_declared_column_without_producer_is_external() -> None:
    @stage(inputs=["prompt"], outputs=[Y], batch_size=2)
    def gen(batch):
        return {"y": np.zeros(len(batch), dtype=np.int64)}

    pipe = Pipeline([gen], columns=[Column.string("prompt")])
    assert pipe.external == ("prompt",)
    assert {c.name for c in pipe.columns} == {"prompt", "y"}


def test_untyped_output_and_conflicting_types() -> None:
    @stage(inputs=["x"], outputs=["y"], batch_size=2)
    def f(batch):
        return {}

    with pytest.raises(PipelineError, match="writes column 'y' without a type"):
        Pipeline([counter_source(4), f])
    with pytest.raises(PipelineError, match="declare it once"):
        Pipeline([counter_source(4), f], columns=[Column.scalar("x", "float32"), Y])
    assert Pipeline([counter_source(4), f], columns=[Y]).columns == (Y, X)


def test_cycle_is_named() -> None:
    @stage(inputs=["x", "c"], outputs=[Column.scalar("a", "int64")], batch_size=2)
    def first(batch):
        return {}

    @stage(inputs=["a"], outputs=[Column.scalar("b", "int64")], batch_size=2)
    def second(batch):
        return {}

    @stage(inputs=["b"], outputs=[Column.scalar("c", "int64")], batch_size=2)
    def third(batch):
        return {}

    with pytest.raises(PipelineError) as info:
        Pipeline([counter_source(4), first, second, third])
    text = str(info.value)
    assert "cycle: first -> second -> third -> first" in text
    assert "first writes ['a'] read by second" in text


def test_duplicate_names_producers_and_bad_stage_lists() -> None:
    @stage(inputs=["x"], outputs=[Y], batch_size=2)
    def f(batch):
        return {}

    @stage(inputs=["x"], outputs=[Y], batch_size=2, name="g")
    def other(batch):
        return {}

    with pytest.raises(PipelineError, match="two stages are named 'f'"):
        Pipeline([counter_source(4), f, f])
    with pytest.raises(PipelineError, match="column 'y' is written by both"):
        Pipeline([counter_source(4), f, other])
    with pytest.raises(PipelineError, match="non-empty list of stages"):
        Pipeline([])
    with pytest.raises(PipelineError, match=r"must be @flowrl\.stage specs"):
        Pipeline([lambda batch: {}])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="unknown executor"):
        Pipeline([counter_source(4)]).run(executor="dask")


def test_pipeline_is_frozen_data() -> None:
    pipe = Pipeline([counter_source(4)])
    assert isinstance(pipe.stages, tuple)
    with pytest.raises(AttributeError):
        pipe.stages = ()  # type: ignore[misc]


# -- running -----------------------------------------------------------------------------------
class Seen:
    """Thread-safe record of the sample indices each stage was called with."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_stage: dict[str, list[int]] = collections.defaultdict(list)

    def add(self, name: str, indices: np.ndarray) -> None:
        with self.lock:
            self.by_stage[name].extend(indices.tolist())


def three_stages(seen: Seen, n: int) -> list[StageSpec]:
    @stage(inputs=["x"], outputs=[Y], batch_size=3, workers=2)
    def double(batch):
        seen.add("double", batch.indices)
        return {"y": batch.numpy("x") * 2}

    @stage(inputs=["x", "y"], outputs=[Z], batch_size=5, workers=2, min_batch=1)
    def ratio(batch):
        seen.add("ratio", batch.indices)
        assert (batch.numpy("y") == 2 * batch.numpy("x")).all()
        return {"z": (batch.numpy("y") / 2).astype(np.float32)}

    @stage(inputs=["x", "z"], batch_size=4)
    def sink(batch):
        seen.add("sink", batch.indices)
        assert (batch.numpy("z") == batch.numpy("x")).all()

    return [counter_source(n), double, ratio, sink]


def test_three_stages_every_sample_through_each_stage_exactly_once(make_hub: Any) -> None:
    seen = Seen()
    hub = make_hub()
    result = Pipeline(three_stages(seen, 30)).run(hub, timeout=30)
    for name in ("double", "ratio", "sink"):
        assert sorted(seen.by_stage[name]) == list(range(30)), name
    assert result.completed
    assert [s.samples for s in result.stages.values()] == [30, 30, 30, 30]
    assert result.stages["numbers"].batches == 8  # ceil(30 / 4)
    assert result.stages["double"].workers == 2
    assert all(0.0 <= s.busy_fraction <= 1.0 for s in result.stages.values())
    stats = hub.statistics()
    assert stats.live == 0 and stats.leases == 0 and stats.ended


def test_run_without_hub_makes_one() -> None:
    seen = Seen()
    result = Pipeline(three_stages(seen, 7)).run(timeout=30)
    assert result.completed and sorted(seen.by_stage["sink"]) == list(range(7))


def test_raising_stage_surfaces_with_indices_and_leaves_no_lease(make_hub: Any) -> None:
    @stage(inputs=["x"], outputs=[Y], batch_size=4)
    def fragile(batch):
        if (batch.numpy("x") >= 8).any():
            raise ValueError("bad sample")
        return {"y": batch.numpy("x")}

    @stage(inputs=["y"], batch_size=2)
    def sink(batch):
        return None

    hub = make_hub()
    with pytest.raises(StageError) as info:
        Pipeline([counter_source(16), fragile, sink]).run(hub, timeout=30)
    err = info.value
    assert err.stage == "fragile"
    assert isinstance(err.__cause__, ValueError)
    assert len(err.indices) == 4 and min(err.indices) >= 8
    assert "stage 'fragile' (" in str(err) and "bad sample" in str(err)
    stats = hub.statistics()
    assert stats.leases == 0
    fragile_stats = stats.tasks["fragile"]
    assert fragile_stats.leased == 0
    assert fragile_stats.ready + fragile_stats.consumed == 16  # nothing lost


def test_wrong_output_columns_and_oversized_source_batches() -> None:
    @stage(inputs=["x"], outputs=[Y], batch_size=4)
    def forgetful(batch):
        return {"z": batch.numpy("x")}

    with pytest.raises(StageError) as info:
        Pipeline([counter_source(4), forgetful], columns=[Z]).run(timeout=30)
    assert isinstance(info.value.__cause__, SchemaError)
    assert "missing ['y'], undeclared ['z']" in str(info.value)

    @stage(outputs=[X], batch_size=2)
    def greedy():
        return {"x": np.arange(3)}

    with pytest.raises(StageError, match="more than its batch_size=2"):
        Pipeline([greedy]).run(timeout=30)


def test_filter_stage_is_one_function(make_hub: Any) -> None:
    seen = Seen()

    @stage(inputs=["x"], outputs=[Z], batch_size=4)
    def reward(batch):
        return {"z": batch.numpy("x").astype(np.float32)}

    # the inserted filter: drops odd x, passes the reward on under a new name
    @stage(inputs=["x", "z"], outputs=[Column.scalar("safe_z", "float32")], batch_size=3)
    def safety(batch):
        keep = batch.numpy("x") % 2 == 0
        return Rows({"safe_z": batch.numpy("z")[keep]}, keep=keep)

    @stage(inputs=["x", "safe_z"], batch_size=2, min_batch=1)
    def train(batch):
        seen.add("train", batch.indices)

    result = Pipeline([counter_source(20), reward, safety, train]).run(make_hub(), timeout=30)
    assert sorted(seen.by_stage["train"]) == list(range(0, 20, 2))
    assert result.stages["safety"].samples == 20 and result.stages["train"].samples == 10


@pytest.mark.parametrize("placement", ["zmq"], indirect=True)
def test_a_stage_writes_its_outputs_straight_to_their_units(
    make_hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stage's output goes to the claim's handle, which names the samples' units: no
    # check_update round trip to the controller first (filtered rounds included).
    from flowrl._transport.remote_control import RemoteControl

    def no_round_trip(self: Any, cmd: Any) -> Any:
        raise AssertionError("a stage's put asked the controller where its samples are")

    monkeypatch.setattr(RemoteControl, "check_update", no_round_trip)

    @stage(inputs=["x"], outputs=[Z], batch_size=4)
    def reward(batch):
        keep = batch.numpy("x") % 3 != 0
        return Rows({"z": batch.numpy("x")[keep].astype(np.float32)}, keep=keep)

    result = Pipeline([counter_source(20), reward]).run(make_hub(), timeout=30)
    assert result.completed and result.stages["reward"].samples == 20


def test_class_stages_get_setup_per_worker_and_generator_sources() -> None:
    workers: list[int] = []

    @stage(outputs=[X], batch_size=5)
    def numbers():
        for start in range(0, 20, 5):
            yield Rows({"x": np.arange(start, start + 5)}, groups=start // 5)

    @stage(inputs=["x"], outputs=[Y], batch_size=5, workers=2, sampler=GroupSampler(5))
    class Model:
        def setup(self, ctx: StageContext) -> None:
            workers.append(ctx.worker)
            self.offset = 100

        def __call__(self, batch):
            assert len(set(batch.meta.groups.tolist())) == 1  # one whole group
            return Rows({"y": batch.numpy("x") + self.offset}, version=7)

    @stage(inputs=["x", "y"], batch_size=10)
    def check(batch):
        assert (batch.numpy("y") == batch.numpy("x") + 100).all()
        assert (batch.meta.versions == 7).all()

    result = Pipeline([numbers, Model, check]).run(timeout=30)
    assert sorted(workers) == [0, 1]
    assert result.stages["check"].samples == 20


def test_balanced_stage_workers_are_dp_ranks() -> None:
    ranks: dict[int, list[int]] = collections.defaultdict(list)
    lock = threading.Lock()

    @stage(inputs=["x"], batch_size=2, workers=2, sampler=BalancedSampler(2))
    def train(batch):
        with lock:
            ranks[batch.meta.dp_rank].extend(batch.indices.tolist())

    Pipeline([counter_source(16), train]).run(timeout=30)
    assert sorted(ranks[0] + ranks[1]) == list(range(16))
    assert len(ranks[0]) == len(ranks[1]) == 8


def test_max_samples_stops_an_endless_source() -> None:
    @stage(outputs=[X], batch_size=4)
    def endless():
        return {"x": np.zeros(4, dtype=np.int64)}

    @stage(inputs=["x"], batch_size=4)
    def sink(batch):
        return None

    result = Pipeline([endless, sink]).run(max_samples=12, timeout=30)
    assert result.completed and result.stages["sink"].samples == 12


def test_timeout_stops_a_pipeline_that_cannot_finish() -> None:
    @stage(inputs=["prompt"], outputs=[X], batch_size=1)
    def waits(batch):
        return {}

    hub = Hub()
    with pytest.raises(Timeout, match=r"did not finish within timeout=0\.3s"):
        Pipeline([waits], columns=[Column.string("prompt")]).run(hub, timeout=0.3)
    assert hub.statistics().leases == 0


def test_start_feeds_a_loader_and_stop_ends_early() -> None:
    @stage(inputs=["x"], outputs=[Y], batch_size=4)
    def double(batch):
        return {"y": batch.numpy("x") * 2}

    pipe = Pipeline([counter_source(20), double])
    hub = Hub(pipe.columns)  # declared, so the trainer's task can be registered first
    loader = Loader(hub, task="train", columns=["x", "y"], batch_size=4, timeout=10)
    seen: list[int] = []
    with pipe.start(hub, loaders=[loader]) as run:
        for batch in loader:
            seen.extend(batch.indices.tolist())
    assert run.done() and run.result().completed
    assert sorted(seen) == list(range(20))

    @stage(outputs=[X], batch_size=4)
    def endless():
        return {"x": np.zeros(4, dtype=np.int64)}

    other = Hub()
    run = Pipeline([endless, double]).start(other)
    run.stop()
    assert not run.result(timeout=30).completed
    assert other.statistics().leases == 0


def test_a_failing_pipeline_raises_in_the_trainer_loop(make_hub: Any) -> None:
    @stage(inputs=["x"], outputs=[Y], batch_size=4)
    def broken(batch):
        raise RuntimeError("model exploded")

    pipe = Pipeline([counter_source(8), broken])
    hub = make_hub(pipe.columns)
    loader = Loader(hub, task="train", columns=["y"], batch_size=4, timeout=30)
    run = pipe.start(hub, loaders=[loader])
    with pytest.raises(StageError) as info:
        next(loader)
    assert info.value.stage == "broken" and len(info.value.indices) == 4
    assert isinstance(info.value.__cause__, StageError)
    with pytest.raises(StageError, match="model exploded"):
        run.result(timeout=30)


def test_the_restart_policy_replaces_dead_consumers_only_up_to_max_restarts() -> None:
    @stage(outputs=[Column.scalar("x", "int64")], batch_size=1)
    def source() -> None:
        return None

    @stage(inputs=["x"], batch_size=1)
    def sink(batch: Any) -> None:
        return None

    stop = threading.Event()
    policy = Restarts(2)
    assert policy.replace(sink, "w0", "was killed by SIGKILL", stop) is None
    assert policy.replace(sink, "w1", "was killed by SIGKILL", stop) is None
    err = policy.replace(sink, "w0", "was killed by SIGKILL", stop)
    assert isinstance(err, StageError) and err.stage == "sink"
    assert "no restart is left (2 dead worker(s) already replaced" in str(err)
    assert policy.by_stage == {"sink": 2}

    fresh = Restarts(5)
    err = fresh.replace(source, "w0", "exited with code 1", stop)
    assert isinstance(err, StageError) and "source worker is not restarted" in str(err)
    stop.set()
    err = fresh.replace(sink, "w0", "exited with code 1", stop)
    assert isinstance(err, StageError) and "while the run was stopping" in str(err)
    assert fresh.left == 5 and fresh.by_stage == {}
    with pytest.raises(ConfigError, match="max_restarts"):
        Restarts(True)  # type: ignore[arg-type]


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()`` (a hang guard, not a timing: it fails only if never)."""
    deadline = time.monotonic() + 60
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited 60 s for {what}")
        time.sleep(0.005)


def test_a_batch_whose_lease_expires_mid_stage_is_dropped_and_done_again() -> None:
    slow_once = threading.Event()
    written: collections.Counter[int] = collections.Counter()
    hub = Hub([X, Y])

    @stage(inputs=["x"], outputs=[Y], batch_size=4, lease_timeout=1.0)
    def double(batch):
        if not slow_once.is_set():
            slow_once.set()
            # outlive the lease (the sink's waiting claim expires it): the samples go back
            _wait_for(lambda: hub.statistics().tasks["double"].leased == 0, "the expiry")
        return {"y": 2 * batch["x"]}

    @stage(inputs=["y"], batch_size=4)
    def sink(batch):
        written.update(batch["y"].tolist())

    try:
        result = Pipeline([counter_source(8), double, sink]).run(hub, timeout=120)
    finally:
        hub.close()
    assert result.completed
    # (at least the slow batch's: a stalled machine may let another lease run out too)
    assert result.stages["double"].expired >= 1 and result.stages["double"].samples == 8
    assert written == collections.Counter(2 * i for i in range(8))  # each exactly once


@pytest.mark.parametrize("capacity", [1024, 4], ids=["room", "slots-reused"])
def test_a_straggler_returning_after_its_column_was_closed_is_dropped(
    make_hub, capacity: int
) -> None:
    # F2 (issue 16): the other worker finished the batch and closed "y" (end of stream);
    # the straggler's put then failed the run with "column 'y' closed by end_stream()".
    # With capacity 4 its samples were also evicted and their slots reused meanwhile.
    straggle = threading.Event()
    y_closed = threading.Event()
    written: collections.Counter[int] = collections.Counter()

    @stage(inputs=["x"], outputs=[Y], batch_size=4, workers=2, lease_timeout=1.0)
    def double(batch):
        if not straggle.is_set():
            straggle.set()
            # outlives the lease, until the other worker did the batch and closed "y"
            assert y_closed.wait(60), "the other worker never closed 'y'"
        return {"y": 2 * batch["x"]}

    @stage(inputs=["y"], batch_size=4)
    def sink(batch):
        written.update(batch["y"].tolist())

    def on_event(event: Any) -> None:
        if isinstance(event, StreamEnded) and "y" in event.columns:
            y_closed.set()

    hub = make_hub(columns=[X, Y], config=HubConfig(capacity=capacity))
    hub.subscribe(on_event)
    result = Pipeline([counter_source(8), double, sink]).run(hub, timeout=120)
    assert result.completed
    # (at least the straggler's: a stalled machine may let another lease run out too)
    assert result.stages["double"].expired >= 1 and result.stages["double"].samples == 8
    assert written == collections.Counter(2 * i for i in range(8))  # each exactly once

"""The process executor: one process per stage worker, each with its own hub client."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import flowrl
from flowrl import Column, RunResult
from flowrl._pipeline.admission import Staleness
from flowrl._pipeline.executors.processes import ProcessExecutor
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


#: Where the killing stages below keep their marks (an environment variable, so that the
#: spawned worker processes see it).
KILLS = "FLOWRL_TEST_KILLS"


def _mark(name: str, indices: np.ndarray, *, once: bool) -> bool:
    """Record a death about to happen; with ``once``, only the first caller anywhere dies."""
    folder = Path(os.environ[KILLS])
    path = folder / name if once else folder / f"{name}-{os.getpid()}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, ",".join(map(str, indices.tolist())).encode())
    os.close(fd)
    return True


@stage(outputs=[X], batch_size=4)
def forty():
    for start in range(0, 40, 4):
        yield {"x": np.arange(start, start + 4)}


@stage(inputs=["x"], outputs=[Y], batch_size=4, workers=2, lease_timeout=1.0)
def dies_once(batch):
    """The first call anywhere SIGKILLs its own process mid-batch, holding a lease."""
    if _mark("dies_once", batch.indices, once=True):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": batch.numpy("x") * 2}


@stage(inputs=["x"], outputs=[Y], batch_size=2, lease_timeout=1.0)
def dies_in_its_third_round(batch):
    """One worker's third round SIGKILLs its process: its second round's output may be in
    flight (put_async) and its fourth batch claimed and read ahead (pipelined rounds)."""
    rounds = int(os.environ.get("FLOWRL_TEST_ROUNDS", "0")) + 1
    os.environ["FLOWRL_TEST_ROUNDS"] = str(rounds)
    if rounds == 3 and _mark("third_round", batch.indices, once=True):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": batch.numpy("x") * 2}


@stage(inputs=["x"], outputs=[Y], batch_size=1, prefetch=4, lease_timeout=1.0)
def dies_with_rounds_in_flight(batch):
    """One worker's sixth round SIGKILLs its process: up to four outputs may be in flight
    and four batches claimed (in one request) and read ahead."""
    rounds = int(os.environ.get("FLOWRL_TEST_ROUNDS", "0")) + 1
    os.environ["FLOWRL_TEST_ROUNDS"] = str(rounds)
    if rounds == 6 and _mark("sixth_round", batch.indices, once=True):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": batch.numpy("x") * 2}


@stage(inputs=["x"], outputs=[Y], batch_size=4, lease_timeout=1.0)
def always_dies(batch):
    _mark("always_dies", batch.indices, once=False)
    os.kill(os.getpid(), signal.SIGKILL)


@stage(outputs=[X], batch_size=4)
def source_dies():
    os.kill(os.getpid(), signal.SIGKILL)


@stage(outputs=[X], batch_size=4)
def four():
    yield {"x": np.arange(4)}


@stage(inputs=["x"], outputs=[Y], batch_size=4, workers=2, lease_timeout=0.5)
def straggles_once(batch):
    """The first call anywhere outlives its lease until another worker has finished the
    batch and seen the end of the stream (closing ``y``)."""
    finished = Path(os.environ[KILLS]) / "finished"
    if _mark("straggles_once", batch.indices, once=True):
        deadline = time.monotonic() + 30
        while not finished.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    else:
        finished.touch()
    return {"y": batch.numpy("x") * 2}


def test_a_straggler_process_returning_after_the_end_of_stream_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F2 (issue 16): the straggler's put failed the run ("column 'y' closed by
    end_stream()"); it is dropped and counted as expired, and changes nothing."""
    monkeypatch.setenv(KILLS, str(tmp_path))
    pipe = Pipeline([four, straggles_once])
    hub = flowrl.launch_hub(pipe.columns)
    try:
        result = pipe.run(hub, executor=ProcessExecutor(timeout=120))
        assert result.completed
        assert result.stages["straggles_once"].expired == 1
        assert result.stages["straggles_once"].samples == 4
        stats = hub.statistics()
        assert stats.tasks["straggles_once"].consumed == 4 and stats.live == 0
    finally:
        hub.close()


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


@pytest.mark.parametrize("host", [None, "127.0.0.1"])  # on TCP, workers need the hub key
def test_staleness_and_max_samples_are_shared_by_source_processes(host: str | None) -> None:
    pipe = Pipeline([endless], staleness=Staleness(max_staleness=0, samples_per_version=8))
    hub = flowrl.launch_hub(pipe.columns, host=host)
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


def _forty_with_one_death(pipe: Pipeline, victim: str) -> RunResult:
    """Run ``pipe`` (forty samples, then ``victim``, whose worker dies once) under one
    restart, checking that a Loader saw each sample once (y = 2x), both tasks consumed all
    forty, nothing is left leased and the victim was restarted once; the run's result."""
    hub = flowrl.launch_hub(pipe.columns)
    try:
        loader = Loader(hub, task="check", columns=["x", "y"], batch_size=4, timeout=60)
        executor = ProcessExecutor(timeout=120, max_restarts=1)
        with pipe.start(hub, executor=executor, loaders=[loader]) as run:
            seen: list[int] = []
            for batch in loader:
                assert (batch.numpy("y") == 2 * batch.numpy("x")).all()
                seen.extend(batch.numpy("x").tolist())
        result = run.result()
        stats = hub.statistics()
        for task in (victim, "check"):
            assert stats.tasks[task].consumed == 40, task
            assert stats.tasks[task].ready == stats.tasks[task].leased == 0, task
        assert stats.live == 0 and stats.leases == 0
    finally:
        hub.close()
    assert Counter(seen) == Counter(range(40))  # none lost, none twice
    assert result.completed and result.stages[victim].restarts == 1
    return result


def test_a_killed_worker_is_replaced_and_its_batch_goes_to_another_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILLS, str(tmp_path))
    result = _forty_with_one_death(Pipeline([forty, dies_once]), "dies_once")
    killed = [int(i) for i in (tmp_path / "dies_once").read_text().split(",")]
    assert len(killed) == 4  # it died holding a lease on a whole batch
    assert result.stages["dies_once"].samples == 40  # the dead worker consumed nothing


def test_a_worker_killed_mid_round_loses_and_repeats_nothing_of_its_pipelined_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILLS, str(tmp_path))
    _forty_with_one_death(Pipeline([forty, dies_in_its_third_round]), "dies_in_its_third_round")
    assert (tmp_path / "third_round").exists()  # it did die mid-round


def test_a_worker_killed_with_rounds_prefetched_and_in_flight_loses_and_repeats_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILLS, str(tmp_path))
    pipe = Pipeline([forty, dies_with_rounds_in_flight])
    _forty_with_one_death(pipe, "dies_with_rounds_in_flight")
    assert (tmp_path / "sixth_round").exists()


def test_deaths_past_max_restarts_fail_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILLS, str(tmp_path))
    hub = flowrl.launch_hub()
    try:
        with pytest.raises(StageError, match="no restart is left") as info:
            Pipeline([forty, always_dies]).run(
                hub, executor=ProcessExecutor(timeout=120, max_restarts=1)
            )
        assert info.value.stage == "always_dies"
        assert "was killed by SIGKILL" in str(info.value)
        assert len(list(tmp_path.glob("always_dies-*"))) == 2  # the first and its replacement
    finally:
        hub.close()


def test_a_dead_source_worker_fails_the_run_and_a_bad_max_restarts_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_restarts"):
        ProcessExecutor(max_restarts=-1)
    hub = flowrl.launch_hub()
    try:
        with pytest.raises(StageError, match="source worker is not restarted") as info:
            Pipeline([source_dies]).run(hub, executor=ProcessExecutor(timeout=120))
        assert info.value.stage == "source_dies"
    finally:
        hub.close()

"""Metrics sinks (flowrl.tracking): what each backend wrote, read back with the backend's
own reader (TensorBoard's EventAccumulator, W&B's record protobuf), and the main job's
``--logger``."""

from __future__ import annotations

import glob
import json
import logging
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from flowrl.errors import ConfigError
from flowrl.tracking import (
    BACKENDS,
    ConsoleTracker,
    JsonlTracker,
    Tracker,
    Tracking,
    flatten,
    register_backend,
)

STEPS = [
    {"reward": 0.25 * s, "loss": 1.0 - s, "busy": {"rollout": 0.5}, "tag": "x"} for s in range(3)
]


def test_nested_metrics_flatten_with_slashes() -> None:
    assert flatten({"a": 1, "busy": {"rollout": 0.9, "deep": {"x": 2}}}) == {
        "a": 1,
        "busy/rollout": 0.9,
        "busy/deep/x": 2,
    }


def test_console_logs_every_nth_step_and_the_last(caplog: pytest.LogCaptureFixture) -> None:
    tracker = ConsoleTracker(every=2, last=5)
    with caplog.at_level(logging.INFO, logger="flowrl.tracking"):
        for step in range(1, 6):
            tracker.log({"reward": step / 10, "busy": {"rollout": 0.5}}, step)
    assert [r.getMessage() for r in caplog.records] == [
        "step 2  reward 0.2  busy/rollout 0.5",
        "step 4  reward 0.4  busy/rollout 0.5",
        "step 5  reward 0.5  busy/rollout 0.5",
    ]
    with pytest.raises(ConfigError, match="every=-1"):
        ConsoleTracker(every=-1)


def test_jsonl_writes_history_then_one_line_per_step(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path / "m.jsonl", history=[{"step": 0, "reward": 0.1}])
    tracker.log({"reward": 0.2}, step=1)
    tracker.write_line({"summary": {"steps": 2}})
    tracker.finish()
    lines = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 0, "reward": 0.1},
        {"step": 1, "reward": 0.2},
        {"summary": {"steps": 2}},
    ]


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = Tracking("tensorboard", run_dir=tmp_path)
    for step, m in enumerate(STEPS):
        tracking.log({**m, "bad": float("nan")}, step)
    tracking.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward", "loss", "busy/rollout"}  # numbers only
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [e.value for e in acc.Scalars("loss")] == [1.0, 0.0, -1.0]


def _wandb_records(path: str) -> Iterator[bytes]:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then the
    LevelDB log format (32 KiB blocks; per record crc32, length, type: full/first/middle/last)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def test_wandb_offline_run_files_read_back_with_wandbs_record_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = Tracking("wandb", run_dir=tmp_path / "run", config={"lr": 0.1})
    for step, m in enumerate(STEPS):
        tracking.log(m, step)
    tracking.finish()
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = []
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.append(
                {k: v for k, v in items.items() if not k.startswith("_") or k == "_step"}
            )
    assert history == [
        {"_step": s, "reward": m["reward"], "loss": m["loss"], "busy/rollout": 0.5}
        for s, m in enumerate(STEPS)
    ]


class _Failing(Tracker):
    def __init__(self) -> None:
        self.finished = False

    def log(self, data: Mapping[str, Any], step: int) -> None:
        raise RuntimeError("sink down")

    def finish(self) -> None:
        self.finished = True


def test_a_sink_that_raises_is_logged_and_dropped_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = _Failing()
    jsonl = JsonlTracker(tmp_path / "m.jsonl")
    tracking = Tracking([failing, jsonl], run_dir=tmp_path)
    with caplog.at_level(logging.ERROR, logger="flowrl.tracking"):
        tracking.log({"reward": 1.0}, 0)
        tracking.log({"reward": 2.0}, 1)
    assert failing.finished and "_Failing logger failed at step 0" in caplog.text
    tracking.finish()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_a_user_backend_is_registered_by_name(tmp_path: Path) -> None:
    seen: list[tuple[int, dict]] = []

    class Memory(Tracker):
        def log(self, data: Mapping[str, Any], step: int) -> None:
            seen.append((step, dict(data)))

    register_backend("memory", lambda run_dir, config: Memory())
    try:
        tracking = Tracking("console,memory", run_dir=tmp_path)
        tracking.log({"reward": 0.5}, 3)
        tracking.finish()
    finally:
        del BACKENDS["memory"]
    assert seen == [(3, {"reward": 0.5})]
    with pytest.raises(ConfigError, match=r"unknown logger backend\(s\) \['nope'\]"):
        Tracking("console,nope", run_dir=tmp_path)
    with pytest.raises(ConfigError, match="expected a name"):
        register_backend("not a name", lambda run_dir, config: Memory())


def test_the_main_job_logs_to_tensorboard_and_jsonl_and_writes_a_trace(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from grpo_runs import TINY, step_metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowrl.recipes.grpo_arith import GRPOConfig, run

    summary = run(GRPOConfig(**TINY, logger="jsonl,tensorboard", out=str(tmp_path)))
    rewards = [m["reward"] for m in step_metrics(summary["run_dir"])]
    acc = EventAccumulator(str(Path(summary["run_dir"]) / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward")
    assert [e.step for e in events] == [1, 2, 3]  # steps done
    assert [e.value for e in events] == pytest.approx(rewards)
    assert "busy/Rollout" in acc.Tags()["scalars"]
    # and every run writes a Chrome trace: the trainer's steps and waits, the stages' spans
    trace = json.loads(Path(summary["trace_json"]).read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"step 1", "step 2", "step 3", "wait for a batch", "Rollout", "trainer"} <= names
    with pytest.raises(ConfigError, match="--logger 'console,bogus': unknown logger backend"):
        GRPOConfig(logger="console,bogus")


def test_a_loader_logs_each_batch_to_its_tracker(tmp_path: Path) -> None:
    import numpy as np

    import flowrl
    from flowrl import Column

    with flowrl.Hub(columns=[Column.ragged("ids", "int64")]) as hub:
        loader = flowrl.Loader(
            hub,
            task="train",
            columns=["ids"],
            batch_size=2,
            tracker=Tracking("jsonl", run_dir=tmp_path),
        )
        hub.put({"ids": [np.arange(n + 1) for n in range(4)]})
        hub.end_stream()
        assert sum(len(b) for b in loader) == 4
        loader.tracker.finish()  # type: ignore[union-attr]
        with pytest.raises(ConfigError, match=r"expected a flowrl\.tracking\.Tracker"):
            flowrl.Loader(hub, task="t2", columns=["ids"], batch_size=1, tracker="jsonl")  # type: ignore[arg-type]
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loader/samples"], m["loader/tokens"]) for m in lines] == [
        (1, 2, 3),
        (2, 2, 7),
    ]
    assert all(m["loader/wait_s"] >= 0 and m["loader/version_max"] == 0 for m in lines)

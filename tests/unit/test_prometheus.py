"""serve_metrics: a hub's /metrics, scraped over loopback while a pipeline runs and parsed
with prometheus_client's own parser; the figures agree with the hub's statistics."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import flowrl
from flowrl import Column
from flowrl.errors import ConfigError

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

N = 48


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """metric sample name -> {label values: value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def _pipeline(release: threading.Event) -> flowrl.Pipeline:
    @flowrl.stage(outputs=[Column.ragged("response", "int64")], batch_size=8)
    def rollout():
        for start in range(0, N, 8):
            if start == N // 2:
                release.wait(30)  # hold the run half-way until the test has scraped
            yield {"response": [np.arange(i % 5 + 1) for i in range(start, start + 8)]}

    @flowrl.stage(inputs=["response"], outputs=[Column.scalar("reward", "float32")], batch_size=4)
    def reward(batch):
        return {"reward": batch.ragged("response").lengths.astype(np.float32)}

    return flowrl.Pipeline([rollout, reward])


def test_metrics_while_a_pipeline_runs_and_after(tmp_path: Path) -> None:
    release = threading.Event()
    pipe = _pipeline(release)
    hub = flowrl.Hub(pipe.columns)
    pipe.register(hub)
    loader = flowrl.Loader(hub, task="train", columns=["response", "reward"], batch_size=8)
    # the hub seen through statistics() alone: the exporter follows no event (each one
    # would cost the hub's hot path)
    watched = SimpleNamespace(statistics=hub.statistics)
    with flowrl.serve_metrics(watched, loaders=[loader]) as server:
        assert server.url.startswith("http://127.0.0.1:")
        run = pipe.start(hub, loaders=[loader])
        trained = 0
        for batch in loader:
            trained += len(batch)
            hub.publish_version(trained // 8)
            if trained == 16:  # mid-run: the source is held, some samples are in flight
                mid = scrape(server.url)
                assert mid["flowrl_put_samples_total"][(("column", "response"),)] >= 16
                assert mid["flowrl_acked_samples_total"][(("task", "train"),)] >= 8
                assert mid["flowrl_hub_capacity_samples"][()] == hub.statistics().capacity
                release.set()
        run.result(timeout=60)
        stats = hub.statistics()
        final = scrape(server.url)
    hub.close()

    assert trained == N
    assert final["flowrl_put_samples_total"][(("column", "response"),)] == N
    assert final["flowrl_put_samples_total"][(("column", "reward"),)] == N
    assert final["flowrl_put_bytes_total"][(("column", "response"),)] > 0
    for task in ("reward", "train"):
        label = (("task", task),)
        assert final["flowrl_claimed_samples_total"][label] == N
        assert final["flowrl_acked_samples_total"][label] == N
        assert final["flowrl_task_busy_seconds_total"][label] > 0
        assert final["flowrl_task_ready_samples"][label] == stats.tasks[task].ready
        assert final["flowrl_task_leased_samples"][label] == stats.tasks[task].leased
    # the staleness histogram: cumulative buckets, +Inf bucket = count = samples acked
    buckets = {
        dict(k)["le"]: v
        for k, v in final["flowrl_staleness_versions_bucket"].items()
        if dict(k)["task"] == "train"
    }
    assert buckets["+Inf"] == N == final["flowrl_staleness_versions_count"][(("task", "train"),)]
    values = [buckets[b] for b in ("0", "1", "2", "+Inf")]
    assert values == sorted(values)
    assert final["flowrl_policy_version"][()] == stats.version == N // 8
    assert final["flowrl_loader_batches_total"][(("task", "train"),)] == N // 8
    assert final["flowrl_loader_wait_seconds_total"][(("task", "train"),)] >= 0
    assert final["flowrl_unit_bytes"][(("unit", "0"),)] == stats.units[0].nbytes


def test_bad_port_and_a_taken_port_are_refused() -> None:
    with flowrl.Hub(columns=[Column.scalar("x", "float32")]) as hub:
        with pytest.raises(ConfigError, match="expected an int in"):
            flowrl.serve_metrics(hub, port=70000)
        with flowrl.serve_metrics(hub) as first, pytest.raises(ConfigError, match="cannot listen"):
            flowrl.serve_metrics(hub, port=first.port)

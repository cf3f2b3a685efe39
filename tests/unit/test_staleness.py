"""Bounded staleness: admission control bounds the version lag of trained samples to η."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from flowrl import Column, Hub
from flowrl._observers.staleness import StalenessMetrics
from flowrl._pipeline.admission import AdmissionController, Staleness
from flowrl._pipeline.loader import Loader
from flowrl._pipeline.pipeline import Pipeline
from flowrl._pipeline.stage import stage
from flowrl.errors import ConfigError, PipelineError, Timeout, WouldBlock

IDS = Column.ragged("ids", "int64")
B = 8  # samples per version (the trainer's batch)


def test_staleness_config_is_validated() -> None:
    assert Staleness(max_staleness=1, samples_per_version=8).window == 16
    with pytest.raises(ConfigError, match="0 = synchronous"):
        Staleness(max_staleness=-1, samples_per_version=8)
    with pytest.raises(ConfigError, match="global batch size"):
        Staleness(max_staleness=0, samples_per_version=0)


def test_admission_window_moves_with_the_published_version() -> None:
    hub = Hub([IDS])
    with AdmissionController(hub, Staleness(max_staleness=1, samples_per_version=4)) as adm:
        adm.admit(4)
        adm.admit(4)  # (0 + 1 + 1) * 4 = 8 admitted at version 0
        with pytest.raises(WouldBlock, match="publish a new version"):
            adm.admit_nowait(1)
        with pytest.raises(Timeout):
            adm.admit(1, timeout=0.05)
        adm.refund(2)  # two were never produced
        adm.admit_nowait(2)
        hub.publish_version(1)
        adm.admit(4, timeout=5)
        stats = adm.statistics()
        assert (stats.admitted, stats.allowed, stats.version) == (12, 12, 1)
        with pytest.raises(ConfigError, match=r"in \[1, 8\]"):
            adm.admit(9)
    hub.close()


class _DeafHub:
    """A hub whose event subscription loses every event, counting version reads."""

    def __init__(self, hub: Hub) -> None:
        self.hub, self.reads = hub, 0

    @property
    def version(self) -> int:
        self.reads += 1
        return self.hub.version

    def subscribe(self, callback: Any, **kwargs: Any) -> Any:
        return self.hub.subscribe(lambda event: None, **kwargs)


def test_admission_follows_events_and_reads_the_hub_only_while_blocked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("flowrl._pipeline.admission.REFRESH_S", 0.05)
    hub = Hub([IDS])
    deaf = _DeafHub(hub)
    with AdmissionController(deaf, Staleness(max_staleness=0, samples_per_version=2)) as adm:
        for _ in range(2):
            adm.admit(1)
        assert deaf.reads == 1  # (when it was made): an admission asks the hub nothing
        hub.publish_version(1)  # its event is lost: at the bound, the producer asks the hub
        adm.admit_nowait(2)
        assert adm.statistics().version == 1 and deaf.reads == 2
        later = threading.Timer(0.3, hub.publish_version, args=(2,))
        later.start()  # (this event is lost too: a blocked producer asks again and again)
        try:
            adm.admit(2, timeout=30)
        finally:
            later.join()
        assert adm.statistics().version == 2 and deaf.reads >= 4
    hub.close()


def _producer(hub: Any, adm: AdmissionController | None, total: int, chunk: int) -> None:
    for start in range(0, total, chunk):
        if adm is not None:
            adm.admit(chunk, timeout=30)
        lengths = np.arange(start, start + chunk) % 5 + 1
        hub.put({"ids": [np.zeros(n, dtype=np.int64) for n in lengths]})
    hub.end_stream(["ids"])


def _saturated(adm: AdmissionController | None, chunk: int) -> bool:
    """The producer is blocked because the next chunk would exceed the bound."""
    if adm is None:
        return False
    stats = adm.statistics()
    return stats.waiting > 0 and stats.admitted + chunk > stats.allowed


def _train(
    hub: Any, adm: AdmissionController | None, producer: threading.Thread
) -> tuple[list[int], StalenessMetrics]:
    """A slow trainer: before each step it waits until the producer is as far ahead as the
    admission controller allows (or done), so the lag reached is the worst case."""
    lags: list[int] = []
    loader = Loader(hub, task="train", columns=["ids"], batch_size=B, timeout=30)
    metrics = StalenessMetrics("train")
    hub.subscribe(metrics)
    producer.start()
    step = 0
    while True:
        while producer.is_alive() and not _saturated(adm, B // 2):
            time.sleep(0.001)
        batch = next(loader, None)
        if batch is None:
            break
        lags.extend((hub.version - batch.meta.versions).tolist())
        step += 1
        hub.publish_version(step)  # one optimizer step per batch
        while adm is not None and adm.statistics().version < step:
            time.sleep(0.001)  # (else `_saturated` may judge by the version before this one)
    producer.join()
    hub.flush_events()
    return lags, metrics


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_admission_bounds_lag_under_fast_producer_and_slow_trainer(eta: int) -> None:
    hub = Hub([IDS])
    adm = AdmissionController(hub, Staleness(max_staleness=eta, samples_per_version=B))
    producer = threading.Thread(target=_producer, args=(hub, adm, 12 * B, B // 2))
    lags, metrics = _train(hub, adm, producer)
    assert len(lags) == 12 * B
    assert max(lags) == eta  # reached, never exceeded
    steps = metrics.steps()
    assert [s.samples for s in steps] == [B] * 12
    assert max(s.max_lag for s in steps) == eta
    assert sum(s.mean_lag * s.samples for s in steps) == pytest.approx(sum(lags))
    if eta == 0:
        assert all(s.stale_token_fraction == 0.0 for s in steps)  # synchronous: on-policy
    else:
        assert steps[-1].stale_tokens == steps[-1].tokens  # the producer ran ahead
    adm.close()
    hub.close()


def test_without_admission_the_same_trainer_sees_unbounded_lag() -> None:
    hub = Hub([IDS])
    producer = threading.Thread(target=_producer, args=(hub, None, 12 * B, B // 2))
    lags, metrics = _train(hub, None, producer)
    assert max(lags) == 11  # everything was produced at version 0
    assert metrics.steps()[-1].mean_lag == 11
    hub.close()


def test_pipeline_staleness_throttles_its_sources() -> None:
    eta = 1

    @stage(outputs=[IDS], batch_size=4)
    def rollout():
        return {"ids": [np.arange(3)] * 4}

    pipe = Pipeline([rollout], staleness=Staleness(max_staleness=eta, samples_per_version=B))
    hub = Hub(pipe.columns)
    loader = Loader(hub, task="train", columns=["ids"], batch_size=B, timeout=30)
    lags: list[int] = []
    with pipe.start(hub, max_samples=10 * B, loaders=[loader]) as run:
        for step, batch in enumerate(loader, start=1):
            lags.extend((hub.version - batch.meta.versions).tolist())
            hub.publish_version(step)
    assert run.result().stages["rollout"].samples == 10 * B
    assert len(lags) == 10 * B and max(lags) <= eta
    hub.close()


def test_pipeline_staleness_needs_a_source() -> None:
    @stage(inputs=["ids"], batch_size=4)
    def train(batch):
        return None

    with pytest.raises(PipelineError, match="has none"):
        Pipeline(
            [train], columns=[IDS], staleness=Staleness(max_staleness=0, samples_per_version=4)
        )


def test_metrics_count_tokens_and_versions_of_the_trained_task_only() -> None:
    hub = Hub([IDS], tasks={"score": ["ids"], "train": ["ids"]})
    metrics = StalenessMetrics("train")
    hub.subscribe(metrics)
    hub.put({"ids": [np.arange(2), np.arange(6)]})  # version 0: 2 + 6 tokens
    hub.publish_version(2)
    hub.put({"ids": [np.arange(4)]})  # version 2: 4 tokens
    hub.ack(hub.claim("score", 3, timeout=1))  # another task: ignored
    hub.ack(hub.claim("train", 3, timeout=1))
    hub.flush_events()
    (step,) = metrics.steps()
    assert (step.version, step.samples, step.tokens) == (2, 3, 12)
    assert (step.max_lag, step.mean_lag) == (2, pytest.approx(4 / 3))
    assert step.stale_tokens == 8 and step.stale_token_fraction == pytest.approx(8 / 12)
    hub.close()


def test_metrics_take_each_samples_own_version() -> None:
    hub = Hub([IDS], tasks={"train": ["ids"]})
    metrics = StalenessMetrics("train")
    hub.subscribe(metrics)
    hub.publish_version(3)
    # a resumed rollout (begun under version 1) and a fresh one, put together
    hub.put({"ids": [np.arange(5), np.arange(3)]}, version=[1, 3])
    hub.ack(hub.claim("train", 2, timeout=1))
    hub.flush_events()
    (step,) = metrics.steps()
    assert (step.samples, step.tokens, step.max_lag) == (2, 8, 2)
    assert step.mean_lag == pytest.approx(1.0) and step.stale_tokens == 5
    hub.close()

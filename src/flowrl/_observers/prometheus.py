"""Prometheus metrics of a hub: ``serve_metrics(hub)`` answers ``GET /metrics``.

Everything comes from one ``hub.statistics()`` call per scrape (the exporter follows no
event, so between scrapes it costs the hub nothing):

* the hub's counters (``flowrl._controller.counters``): samples put and bytes put per
  column; samples claimed, acked, released and expired per task; busy seconds per task
  (time with at least one lease open: ``rate()`` of it is the stage's busy fraction); a
  histogram of the staleness of acked samples (policy versions behind the newest);
* gauges of ready / leased / consumed samples per task, live samples, capacity, leases,
  the policy version, and bytes and samples per storage unit;

plus the size of the journal folder, and each registered ``Loader``'s wait seconds.

Names follow Prometheus' conventions: ``flowrl_`` prefix, ``_total`` for counters, base
units (``_seconds``, ``_bytes``), labels for task, column, unit. The server is
``prometheus_client``'s own (a thread), on loopback unless told otherwise. It works for an
embedded ``Hub`` and for a ``RemoteHub`` connected to a launched one alike.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, final

from flowrl._config import STALENESS_BUCKETS, HubStats, TaskCounters
from flowrl._observers.sources import HubLike, LoaderLike, check_port
from flowrl.errors import ConfigError

__all__ = ["MetricsServer", "serve_metrics"]


class _Collector:
    """prometheus_client's custom-collector interface: fresh families at every scrape."""

    def __init__(
        self,
        hub: HubLike,
        loaders: Sequence[LoaderLike],
        journal: Path | None,
    ) -> None:
        self.hub, self.loaders, self.journal = hub, loaders, journal

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats = self.hub.statistics()
        g = GaugeMetricFamily
        per_task = [
            (
                g("flowrl_task_ready_samples", "samples ready for the task", labels=["task"]),
                "ready",
            ),
            (
                g(
                    "flowrl_task_leased_samples",
                    "samples the task holds leases on",
                    labels=["task"],
                ),
                "leased",
            ),
            (
                g(
                    "flowrl_task_consumed_samples",
                    "live samples the task has acked",
                    labels=["task"],
                ),
                "consumed",
            ),
        ]
        for family, field in per_task:
            for task, t in sorted(stats.tasks.items()):
                family.add_metric([task], getattr(t, field))
            yield family
        yield g("flowrl_hub_live_samples", "samples put or being put", value=stats.live)
        yield g(
            "flowrl_hub_capacity_samples", "samples the hub holds at most", value=stats.capacity
        )
        yield g("flowrl_hub_leases", "open leases", value=stats.leases)
        yield g("flowrl_policy_version", "the newest published policy version", value=stats.version)
        unit_bytes = g("flowrl_unit_bytes", "bytes held by a storage unit", labels=["unit"])
        unit_samples = g("flowrl_unit_samples", "samples held by a storage unit", labels=["unit"])
        for u in stats.units:
            unit_bytes.add_metric([str(u.unit)], u.nbytes)
            unit_samples.add_metric([str(u.unit)], u.samples)
        yield unit_bytes
        yield unit_samples
        if self.journal is not None:
            yield g(
                "flowrl_journal_bytes",
                "bytes in the journal folder",
                value=_folder_bytes(self.journal),
            )
        yield from _counter_families(stats, CounterMetricFamily, HistogramMetricFamily)
        if self.loaders:
            wait = CounterMetricFamily(
                "flowrl_loader_wait_seconds", "seconds a Loader waited for a batch", labels=["task"]
            )
            batches = CounterMetricFamily(
                "flowrl_loader_batches", "batches a Loader handed out", labels=["task"]
            )
            for loader in self.loaders:
                s = loader.statistics()
                wait.add_metric([loader.task], s.wait_s)
                batches.add_metric([loader.task], s.batches)
            yield wait
            yield batches


def _counter_families(stats: HubStats, counter: Any, histogram: Any) -> Iterator[Any]:
    """The hub's counters (``stats.counters``) as metric families."""
    put = counter("flowrl_put_samples", "samples a column was put for", labels=["column"])
    put_bytes = counter("flowrl_put_bytes", "bytes put per column", labels=["column"])
    for column, c in sorted(stats.counters.columns.items()):
        put.add_metric([column], c.samples)
        put_bytes.add_metric([column], c.nbytes)
    yield put
    yield put_bytes
    now = time.time()
    tasks = sorted(stats.counters.tasks.items())
    per_task: dict[str, tuple[str, Callable[[TaskCounters], float]]] = {
        "flowrl_claimed_samples": ("samples claimed", lambda t: t.claimed),
        "flowrl_acked_samples": ("samples acked (consumed)", lambda t: t.acked),
        "flowrl_released_samples": ("samples given back unconsumed", lambda t: t.released),
        "flowrl_lease_expired_samples": ("samples whose lease expired", lambda t: t.expired),
        "flowrl_task_busy_seconds": (
            "seconds with at least one lease open",
            lambda t: t.busy_until(now),
        ),
    }
    for name, (text, value) in per_task.items():
        family = counter(name, text, labels=["task"])
        for task, t in tasks:
            family.add_metric([task], value(t))
        yield family
    staleness = histogram(
        "flowrl_staleness_versions",
        "policy versions an acked sample was behind the newest",
        labels=["task"],
    )
    bounds = [str(b) for b in STALENESS_BUCKETS] + ["+Inf"]
    for task, t in tasks:
        cumulative = list(itertools.accumulate(t.staleness))
        staleness.add_metric([task], list(zip(bounds, cumulative, strict=True)), t.staleness_sum)
    yield staleness


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # compaction replaced it meanwhile
                total += os.stat(os.path.join(root, name)).st_size
    return total


@final
class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve_metrics`); ``close()`` stops it."""

    def __init__(self, server: Any, thread: threading.Thread, registry: Any) -> None:
        self._server, self._thread = server, thread
        self.registry = registry  # add your own metrics here
        host, port = server.server_address[:2]
        self.port: int = port
        self.url = f"http://{host}:{port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    hub: HubLike,
    *,
    port: int = 0,
    addr: str = "127.0.0.1",
    loaders: Sequence[LoaderLike] = (),
    journal: str | os.PathLike[str] | None = None,
) -> MetricsServer:
    """Serve ``hub``'s metrics on ``http://addr:port/metrics`` (port 0: a free one; read
    ``.url``). ``loaders``: Loaders whose wait time to export; ``journal``: the hub's
    journal folder, to export its size. Needs ``prometheus_client``
    (``pip install 'flowrl[prometheus]'``)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise ConfigError(
            "serve_metrics needs prometheus_client: pip install 'flowrl[prometheus]'"
        ) from exc
    check_port(port, "serve_metrics")
    registry = CollectorRegistry()
    registry.register(_Collector(hub, loaders, None if journal is None else Path(journal)))
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError(f"serve_metrics: cannot listen on {addr}:{port} ({exc})") from exc
    return MetricsServer(server, thread, registry)

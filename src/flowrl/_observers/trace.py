"""ChromeTrace: the hub's event stream as a Chrome trace-event file (Perfetto, chrome://tracing).

What it records, from the events alone (so it works for any pipeline and any placement):

* a **span per micro-batch**: ``Claimed`` to the ``Acked``/``Released``/``LeaseExpired``
  of the same lease, on one track per consumer (a stage worker, the trainer's Loader),
  grouped in one process row per task; its args say how it ended and how many samples;
* **policy versions** as global instant events;
* **queue depths** as counters: the samples the hub holds, and per task the samples
  under lease.

Code that is not a hub consumer adds its own spans with :meth:`ChromeTrace.span` (the main
job's trainer steps and waits). :meth:`ChromeTrace.save` writes the JSON object format
(``{"traceEvents": [...]}``); times are microseconds since the first event.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, final

from flowrl.events import (
    Acked,
    Claimed,
    Event,
    Evicted,
    LeaseExpired,
    Put,
    Released,
    VersionPublished,
)
from flowrl.hooks import Observer

__all__ = ["ChromeTrace"]

_HUB_PID = 0  # the process row of the hub's own counters and instants


@final
class ChromeTrace(Observer):
    """Collects trace events; subscribe it with ``hub.subscribe`` and :meth:`save` at the end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._open: dict[int, Claimed] = {}
        self._pids: dict[str, int] = {}  # process row per task (or user span group)
        self._tids: dict[tuple[str, str], int] = {}  # track per (task, consumer)
        self._held = 0
        self._leased: dict[str, int] = {}

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, Claimed):
                self._open[event.lease] = event
                self._count_leased(event.task, len(event.indices), event.t)
            elif isinstance(event, Acked | Released | LeaseExpired):
                self._settle(event)
            elif isinstance(event, Put) and event.new:
                self._held += len(event.indices)
                self._counter("samples in hub", event.t, {"samples": self._held})
            elif isinstance(event, Evicted):
                self._held -= len(event.indices)
                self._counter("samples in hub", event.t, {"samples": self._held})
            elif isinstance(event, VersionPublished):
                self._events.append(
                    {
                        "name": f"version {event.version}",
                        "ph": "i",
                        "s": "g",
                        "ts": _us(event.t),
                        "pid": _HUB_PID,
                        "tid": 0,
                        "args": {"version": event.version},
                    }
                )

    def span(
        self, name: str, start: float, end: float, *, group: str, track: str = "", **args: Any
    ) -> None:
        """A span of your own code (``time.time()`` seconds) on track ``track`` of the
        process row ``group`` (e.g. ``group="trainer", name="step 3"``)."""
        with self._lock:
            self._events.append(
                {
                    "name": name,
                    "ph": "X",
                    "ts": _us(start),
                    "dur": max(0.0, _us(end) - _us(start)),
                    "pid": self._pid(group),
                    "tid": self._tid(group, track),
                    "args": args,
                }
            )

    def events(self) -> list[dict[str, Any]]:
        """The trace events so far, with track names, times relative to the first event."""
        with self._lock:
            recorded = list(self._events)
            pids, tids = dict(self._pids), dict(self._tids)
        t0 = min((e["ts"] for e in recorded), default=0.0)
        out = [{**e, "ts": e["ts"] - t0} for e in recorded]
        meta: list[dict[str, Any]] = [_name("process_name", _HUB_PID, 0, "hub")]
        meta += [_name("process_name", pid, 0, group) for group, pid in pids.items()]
        for (group, track), tid in tids.items():
            meta.append(_name("thread_name", pids[group], tid, track or group))
        return meta + sorted(out, key=lambda e: e["ts"])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON (opens in Perfetto's UI and chrome://tracing)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)

    def _settle(self, event: Acked | Released | LeaseExpired) -> None:
        claim = self._open.pop(event.lease, None)
        if claim is None:  # claimed before the trace subscribed
            return
        outcome = {Acked: "acked", Released: "released", LeaseExpired: "expired"}[type(event)]
        self._events.append(
            {
                "name": claim.task,
                "ph": "X",
                "ts": _us(claim.t),
                "dur": max(0.0, _us(event.t) - _us(claim.t)),
                "pid": self._pid(claim.task),
                "tid": self._tid(claim.task, claim.consumer),
                "args": {"lease": claim.lease, "samples": len(claim.indices), "end": outcome},
            }
        )
        self._count_leased(claim.task, -len(claim.indices), event.t)

    def _count_leased(self, task: str, delta: int, t: float) -> None:
        self._leased[task] = self._leased.get(task, 0) + delta
        self._counter(f"leased: {task}", t, {"samples": self._leased[task]})

    def _counter(self, name: str, t: float, values: dict[str, int]) -> None:
        self._events.append(
            {"name": name, "ph": "C", "ts": _us(t), "pid": _HUB_PID, "args": values}
        )

    def _pid(self, group: str) -> int:
        return self._pids.setdefault(group, len(self._pids) + 1)

    def _tid(self, group: str, track: str) -> int:
        self._pid(group)
        return self._tids.setdefault((group, track), len(self._tids) + 1)


def _us(t: float) -> float:
    return t * 1e6


def _name(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}

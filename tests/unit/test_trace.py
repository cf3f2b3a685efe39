"""ChromeTrace: a trace-event file that follows the format (JSON object form) and whose
spans are exactly the leases of the hub's event log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl import ChromeTrace, Column
from flowrl.events import Acked, Claimed, Event, LeaseExpired, Released

PHASES = {"X", "i", "C", "M"}


def check_trace_format(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace-event format's rules for the phases we write; the events, validated."""
    assert set(trace) <= {"traceEvents", "displayTimeUnit"}
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int) and isinstance(e["ts"], int | float), e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0 and e["ts"] >= 0, e
        elif e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, int | float) for v in e["args"].values()), e
        else:
            assert e["name"] in ("process_name", "thread_name") and e["args"]["name"], e
    named = {(e["pid"], e.get("tid")) for e in events if e["name"] == "thread_name"}
    for e in events:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in named, f"a span on an unnamed track: {e}"
    return events


def test_spans_are_the_leases_of_the_event_log(tmp_path: Path) -> None:
    log: list[Event] = []
    trace = ChromeTrace()
    with flowrl.Hub(
        columns=[Column.scalar("x", "float32")],
        tasks={"score": ["x"], "train": ["x"]},
    ) as hub:
        hub.subscribe(log.append)
        hub.subscribe(trace)
        hub.put({"x": np.arange(8, dtype=np.float32)})
        a = hub.claim("score", 4, timeout=1.0)
        hub.ack(a)
        b = hub.claim("score", 4, timeout=1.0)
        hub.release(b)
        hub.publish_version(1)
        c = hub.claim("train", 8, timeout=1.0)
        hub.ack(c)
        hub.claim("score", 4, timeout=1.0, lease_timeout=0.05)  # never acked: it expires
        again = hub.claim("score", 4, timeout=30.0)  # waits for the expired samples
        hub.ack(again)
    path = tmp_path / "trace.json"
    trace.save(path)
    events = check_trace_format(json.loads(path.read_text()))

    claims = {e.lease: e for e in log if isinstance(e, Claimed)}
    settled = [e for e in log if isinstance(e, Acked | Released | LeaseExpired)]
    t0 = min(e["ts"] for e in events if e["ph"] != "M")
    spans = {e["args"]["lease"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {e.lease for e in settled}
    first_t = min(e.t for e in log if isinstance(e, Claimed | Acked | Released | LeaseExpired))
    for end in settled:
        span, claim = spans[end.lease], claims[end.lease]
        assert span["name"] == claim.task and span["args"]["samples"] == len(claim.indices)
        assert (
            span["args"]["end"]
            == {Acked: "acked", Released: "released", LeaseExpired: "expired"}[type(end)]
        )
        assert span["dur"] == pytest.approx((end.t - claim.t) * 1e6, abs=1.0)
        assert span["ts"] - t0 >= (claim.t - first_t) * 1e6 - 1.0
    assert {s["args"]["end"] for s in spans.values()} == {"acked", "released", "expired"}
    versions = [e for e in events if e["ph"] == "i"]
    assert [v["args"]["version"] for v in versions] == [1]
    held = [e["args"]["samples"] for e in events if e["name"] == "samples in hub"]
    assert held[0] == 8 and held[-1] == 0  # every sample acked by both tasks, then evicted
    leased = [e["args"]["samples"] for e in events if e["name"] == "leased: score"]
    assert max(leased) == 4 and leased[-1] == 0
    tracks = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"hub", "score", "train"} <= tracks


def test_user_spans_get_their_own_rows(tmp_path: Path) -> None:
    trace = ChromeTrace()
    trace.span("step 1", 10.0, 10.5, group="trainer", loss=0.1)
    trace.span("wait", 10.5, 10.75, group="trainer", track="waits")
    events = check_trace_format({"traceEvents": trace.events()})
    spans = [e for e in events if e["ph"] == "X"]
    assert [(s["name"], s["ts"], s["dur"]) for s in spans] == [
        ("step 1", 0.0, 500_000.0),
        ("wait", 500_000.0, 250_000.0),
    ]
    assert spans[0]["args"] == {"loss": 0.1} and spans[0]["tid"] != spans[1]["tid"]

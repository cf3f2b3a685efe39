"""What watching a hub costs: throughput with a live page or a Prometheus scraper attached.

What it measures: ``benchmarks/hub_throughput.py``'s put + consume loop (a producer puts
--samples samples in batches of --batch, each an int64 and a float32 sequence of
--seq-len plus a float32 reward; then a consumer claims, reads every column into numpy and
acks micro-batches of --batch; --passes times) on a fresh hub per round, in three modes:

* ``none``: nothing attached;
* ``metrics``: ``flowrl.serve_metrics`` with a scraper reading ``/metrics`` every second;
* ``dashboard``: ``flowrl.serve_dashboard`` with a page open (a client reading its
  server-sent events, as the browser does, every 0.5 s).

The modes alternate for --rounds rounds in one run; ``*_over_none`` is the median over
rounds of that mode's samples/s divided by ``none``'s in the same round (1.0: free; the
target is >= 0.97 with a page open). Run for --transport inproc (the embedded hub, where
the observers share the GIL with the loop) or zmq (the hub in other processes).

Usage: python benchmarks/observability_overhead.py --json [--transport zmq]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
from hub_throughput import _read_pass, make_hub, payload

import flowrl

MODES = ("none", "metrics", "dashboard")


def _reader(url: str, stop: threading.Event, every: float, stream: bool) -> threading.Thread:
    """A client that scrapes ``url`` every ``every`` s, or follows it as an event stream."""

    def scrape() -> None:
        while not stop.wait(every):
            urllib.request.urlopen(url, timeout=10).read()

    def follow() -> None:
        with urllib.request.urlopen(url, timeout=30) as events:
            while not stop.is_set():
                events.readline()

    thread = threading.Thread(target=follow if stream else scrape, daemon=True)
    thread.start()
    return thread


def _attach(mode: str, hub: Any) -> Callable[[], None]:
    """Attach ``mode``'s observer and its reader; returns what detaches them."""
    if mode == "none":
        return lambda: None
    stop = threading.Event()
    if mode == "metrics":
        server: Any = flowrl.serve_metrics(hub)
        thread = _reader(server.url, stop, 1.0, stream=False)
    else:
        server = flowrl.serve_dashboard(hub, interval=0.5)
        thread = _reader(server.url + "stream", stop, 0.5, stream=True)

    def detach() -> None:
        stop.set()
        server.close()
        thread.join(timeout=10)

    return detach


def one_round(
    mode: str, transport: str, samples: int, seq_len: int, batch: int, passes: int
) -> float:
    """Samples/s of ``passes`` x (put + consume) with ``mode`` attached."""
    rng = np.random.default_rng(0)
    batches = [payload(batch, seq_len, rng) for _ in range(min(8, samples // batch))]
    hub = make_hub(transport, capacity=samples + batch)
    detach = _attach(mode, hub)
    try:
        time.sleep(0.6)  # the page's first update, the scraper's first wait
        n_batches = samples // batch
        t0 = time.perf_counter()
        for _ in range(passes):  # acked samples are evicted: each pass starts empty
            for i in range(n_batches):
                hub.put(batches[i % len(batches)])
            for _ in range(n_batches):
                meta = hub.claim("train", batch, timeout=10)
                _read_pass(hub, [meta])
                hub.ack(meta)
        return passes * n_batches * batch / (time.perf_counter() - t0)
    finally:
        detach()
        hub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--transport", choices=["inproc", "zmq"], default="inproc")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=6, help="put + consume passes per round")
    args = ap.parse_args()
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            rates[mode].append(
                one_round(mode, args.transport, args.samples, args.seq_len, args.batch, args.passes)
            )
    result: dict[str, Any] = {
        "transport": args.transport,
        "rounds": args.rounds,
        **{f"{m}_samples_per_s": statistics.median(rates[m]) for m in MODES},
    }
    for mode in MODES[1:]:
        per_round = [a / b for a, b in zip(rates[mode], rates["none"], strict=True)]
        result[f"{mode}_over_none"] = statistics.median(per_round)
        result[f"{mode}_over_none_per_round"] = [round(r, 3) for r in per_round]
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

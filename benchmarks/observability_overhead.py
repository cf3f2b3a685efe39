"""What watching a hub costs: throughput with a live page or a Prometheus scraper attached.

What it measures: ``benchmarks/hub_throughput.py``'s put + consume loop (a producer puts
--samples samples in batches of --batch, each an int64 and a float32 sequence of
--seq-len plus a float32 reward; then a consumer claims, reads every column into numpy and
acks micro-batches of --batch; --passes times) on a fresh hub per round, in three modes:

* ``none``: nothing attached;
* ``metrics``: ``flowrl.serve_metrics`` with a scraper reading ``/metrics`` every second;
* ``dashboard``: ``flowrl.serve_dashboard`` with a page open (a client reading its
  server-sent events, as the browser does, every 0.5 s).

Each reader runs in a process of its own, as a browser or Prometheus does.

The modes alternate for --rounds rounds in one run, each round in another order;
``*_over_none`` is the median over rounds of that mode's samples/s divided by
``none``'s in the same round (1.0: free; the target is >= 0.97 with a page open),
``*_lowest_round`` the lowest of those ratios and ``*_over_none_per_round`` all of them.
``*_cpu_over_none`` is the same median for CPU time per sample (``none``'s over the
mode's: 1.0 free, 0.97 = 3% more CPU), counting every thread of this process and, over
zmq, the hub's server processes (on a loaded machine it swings with the wall-clock
ratio: contention slows CPU work too).
``*_exporter_cpu_share`` is the CPU the exporters' own threads used (this process's CPU
but the loop's thread's, less the same in ``none``'s round) over ``none``'s whole CPU,
per sample: what watching costs, other tenants left out. ``load_average`` is the
machine's 1-minute load at the start and the end.
Run for --transport inproc (the embedded hub, where the exporters share the GIL with the
loop) or zmq (the hub in other processes, the exporters in this one).

Usage: python benchmarks/observability_overhead.py --json [--transport zmq]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from hub_throughput import _cpu_s, _read_pass, make_hub, payload

import flowrl

MODES = ("none", "metrics", "dashboard")


# A reader in a process of its own, as a browser or Prometheus is: it prints "ready" after
# its first read, then scrapes the URL every EVERY seconds or follows its event stream.
READER = """
import sys, time, urllib.request
url, every, stream = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "stream"
if stream:
    with urllib.request.urlopen(url, timeout=30) as events:
        events.readline()
        print("ready", flush=True)
        while True:
            events.readline()
else:
    while True:
        urllib.request.urlopen(url, timeout=10).read()
        print("ready", flush=True)
        time.sleep(every)
"""


def _reader(url: str, every: float, stream: bool) -> subprocess.Popen:
    """Start a reader process and wait for its first read."""
    args = [url, str(every), "stream" if stream else "scrape"]
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # (it is killed mid-read at the end)
        text=True,
    )
    if proc.stdout is None or proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the reader of {url} did not start (exit code {proc.wait()})")
    return proc


def _attach(mode: str, hub: Any) -> Callable[[], None]:
    """Attach ``mode``'s exporter and its reader; returns what detaches them."""
    if mode == "none":
        return lambda: None
    if mode == "metrics":
        server: Any = flowrl.serve_metrics(hub)
        reader = _reader(server.url, 1.0, stream=False)
    else:
        server = flowrl.serve_dashboard(hub, interval=0.5)
        reader = _reader(server.url + "stream", 0.5, stream=True)

    def detach() -> None:  # the server first: a reader killed mid-scrape breaks its pipe
        server.close()
        reader.kill()
        reader.wait()

    return detach


def one_round(
    mode: str, transport: str, samples: int, seq_len: int, batch: int, passes: int
) -> tuple[float, float, float]:
    """Samples/s of ``passes`` x (put + consume) with ``mode`` attached, CPU seconds per
    sample (this process and the hub's server processes), and of those, the seconds of
    this process's threads but this one (the exporters', and zmq's I/O threads)."""
    rng = np.random.default_rng(0)
    batches = [payload(batch, seq_len, rng) for _ in range(min(8, samples // batch))]
    hub = make_hub(transport, capacity=samples + batch)
    detach = _attach(mode, hub)
    try:
        time.sleep(0.6)  # the page's first update, the scraper's first wait
        n_batches = samples // batch
        cpu0, own0, mine0 = _cpu(hub), time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        for _ in range(passes):  # acked samples are evicted: each pass starts empty
            for i in range(n_batches):
                hub.put(batches[i % len(batches)])
            for _ in range(n_batches):
                meta = hub.claim("train", batch, timeout=10)
                _read_pass(hub, [meta])
                hub.ack(meta)
        wall = time.perf_counter() - t0
        n = passes * n_batches * batch
        others = time.process_time() - own0 - (time.thread_time() - mine0)
        return n / wall, (_cpu(hub) - cpu0) / n, others / n
    finally:
        detach()
        hub.close()


def _cpu(hub: Any) -> float:
    """CPU seconds used so far by this process and the hub's server processes (if any)."""
    servers = getattr(hub, "servers", None)
    pids = [] if servers is None else [proc.pid for proc in servers.procs]
    return time.process_time() + sum(_cpu_s(pid) for pid in pids)


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
    load = [os.getloadavg()[0]]
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    others: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each mode first in turn
            rate, per_sample, other = one_round(
                mode, args.transport, args.samples, args.seq_len, args.batch, args.passes
            )
            rates[mode].append(rate)
            cpu[mode].append(per_sample)
            others[mode].append(other)
    load.append(os.getloadavg()[0])
    result: dict[str, Any] = {
        "transport": args.transport,
        "rounds": args.rounds,
        "load_average": [round(x, 2) for x in load],
        **{f"{m}_samples_per_s": statistics.median(rates[m]) for m in MODES},
    }
    for mode in MODES[1:]:
        per_round = [a / b for a, b in zip(rates[mode], rates["none"], strict=True)]
        result[f"{mode}_over_none"] = statistics.median(per_round)
        result[f"{mode}_lowest_round"] = min(per_round)
        result[f"{mode}_over_none_per_round"] = [round(r, 3) for r in per_round]
        cpu_ratios = [b / a for a, b in zip(cpu[mode], cpu["none"], strict=True)]
        result[f"{mode}_cpu_over_none"] = statistics.median(cpu_ratios)
        result[f"{mode}_cpu_over_none_per_round"] = [round(r, 3) for r in cpu_ratios]
        share = [
            (o - o_none) / c_none
            for o, o_none, c_none in zip(others[mode], others["none"], cpu["none"], strict=True)
        ]
        result[f"{mode}_exporter_cpu_share"] = statistics.median(share)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

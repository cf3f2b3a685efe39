"""Soak a multi-process hub: many concurrent clients for a while, every sample accounted for.

What it runs: ``flowrl.testing.run_soak`` — the scenario tests/integration/test_soak.py
runs for 20 s — for longer. A zmq hub (controller + 2 storage units, capacity 4096) on
this machine; --clients client connections (default 64), each its own ``flowrl.connect``
client in its own thread, spread over --processes worker processes (default 4); --producers
of them (default a quarter) put batches of 1..--batch samples (a key, a ragged int64
sequence of 1..7 tokens and a float32 reward each) for --seconds (default 120); the rest
consume, alternating between two tasks (``train`` reads all three columns, ``score`` two),
claiming up to --batch samples, reading them, checking their data against their key and
acking. Then the stream is ended and consumers drain it.

What it reports (JSON with --json):

* ``samples_per_s``: samples produced per second of production (each is also read and
  acked by both tasks); ``calls``: calls made, by kind.
* ``latency_ms``: p50/p99/max of every call as the client saw it, per kind and ``all``.
  A claim's latency includes waiting for samples (up to its 0.5 s timeout).
* ``lost`` / ``duplicated`` per task (must be 0), ``corrupt`` (data not matching its key),
  ``untyped`` (exceptions that are not a FlowRLError), ``stuck`` (calls still in flight at
  the end), ``ambiguous`` (calls whose outcome is unknown): all must be 0 / empty.
* ``errors``: typed errors by class, all handled (a claim Timeout while nothing is ready,
  the final EndOfStream of each consumer, a put Timeout while the hub is full).
* ``ok``: all of the above held and the hub ended empty (no live sample, lease or
  reservation).

Read throughput and latency as figures for this machine and this run; on a shared 2-core
machine they drift from run to run. The accounting is exact whatever the load.
Usage: python benchmarks/soak_clients.py --json [--seconds N] [--clients N] [--processes N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec

from flowrl.testing import SoakConfig, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=float, default=120.0, help="production time")
    parser.add_argument("--clients", type=int, default=64, help="client connections")
    parser.add_argument("--producers", type=int, default=None, help="default: clients // 4")
    parser.add_argument("--processes", type=int, default=4, help="worker processes (0: threads)")
    parser.add_argument("--batch", type=int, default=8, help="samples per put / claim, at most")
    args = parser.parse_args(argv)
    config = SoakConfig(
        seconds=args.seconds,
        clients=args.clients,
        producers=args.producers if args.producers is not None else max(1, args.clients // 4),
        processes=args.processes,
        batch=args.batch,
    )
    started = time.perf_counter()
    report = run_soak(config)
    result = msgspec.to_builtins(report)
    result["ok"] = report.ok
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{report.produced} samples from {report.producers} producers to "
            f"{report.clients - report.producers} consumers over {report.connected} connections "
            f"in {report.seconds:.0f}s: {report.samples_per_s:.0f} samples/s; calls "
            f"p50 {report.latency_ms['all']['p50']:.2f} ms, p99 "
            f"{report.latency_ms['all']['p99']:.2f} ms; lost {report.lost}, duplicated "
            f"{report.duplicated}, corrupt {report.corrupt}, untyped {report.untyped}, "
            f"stuck {len(report.stuck)}, errors {report.errors}; ok={report.ok}"
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

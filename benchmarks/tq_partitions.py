"""A TransferQueue program with one partition per step, on flowrl's compat client.

What it measures: the wall time of one step of a program written against TransferQueue's
client the way verl's TransferQueue trainer runs (``train_0``, ``train_1``, ...): put a
TensorDict of ``--batch`` samples (int64 ids of 128 tokens and a float reward) into the
step's partition, ``get_meta`` them for one task, ``get_data``, ``clear_partition``. The
steps are timed in windows of ``--window`` steps; after each window the hub's registered
tasks and declared columns are counted.

How to read it: ``windows`` lists, per window, ``ms_per_step`` and the ``tasks`` and
``columns`` the hub held at its end. A cleared partition must leave nothing behind, so
``tasks`` and ``columns`` stay what the first window left, and ``growth`` (the last
window's ms_per_step over the first's) stays near 1: the machine's noise, not a trend.
Before issue 24's fix every partition left a task and a column behind and each step
walked over them: ``growth`` was about 4-10 at 400 steps. Absolute figures drift on a
shared machine (note the load average beside them); the counts do not.

    python benchmarks/tq_partitions.py --json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from tensordict import TensorDict

import flowrl.compat.transfer_queue as tq


def measure(steps: int, window: int, batch: int, placement: str) -> dict[str, Any]:
    conf = {"backend": {"SimpleStorage": {"total_storage_size": 8 * batch}}}
    tq.init({**conf, "flowrl": {"placement": placement}})
    try:
        client = tq.get_client()
        data = TensorDict(
            {"ids": torch.ones(batch, 128, dtype=torch.int64), "r": torch.ones(batch)}, [batch]
        )
        windows = []
        start = time.perf_counter()
        for step in range(steps):
            partition = f"train_{step}"
            client.put(data=data, partition_id=partition)
            meta = client.get_meta(["ids", "r"], batch, partition, task_name="actor")
            client.get_data(meta)
            client.clear_partition(partition)
            if (step + 1) % window == 0:
                now = time.perf_counter()
                windows.append(
                    {
                        "step": step + 1,
                        "ms_per_step": (now - start) / window * 1e3,
                        "tasks": len(client.hub.statistics().tasks),
                        "columns": len(client.hub.schema.by_name),
                    }
                )
                start = time.perf_counter()  # (the counting is not a step's)
    finally:
        tq.close()
    return {
        "placement": placement,
        "steps": steps,
        "batch": batch,
        "windows": windows,
        "growth": windows[-1]["ms_per_step"] / windows[0]["ms_per_step"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--window", type=int, default=50, help="steps timed together")
    ap.add_argument("--batch", type=int, default=64, help="samples a step puts")
    ap.add_argument("--placement", choices=["inproc", "zmq"], default="inproc")
    args = ap.parse_args()
    if args.steps < args.window or args.window < 1:
        ap.error("--steps must be at least --window, which must be positive")
    report = measure(args.steps, args.window, args.batch, args.placement)
    if args.json:
        print(json.dumps(report))
        return
    for w in report["windows"]:
        print(
            f"step {w['step']:5d}: {w['ms_per_step']:6.2f} ms/step, "
            f"{w['tasks']} tasks, {w['columns']} columns"
        )
    print(f"growth (last window / first): {report['growth']:.2f}")


if __name__ == "__main__":
    main()

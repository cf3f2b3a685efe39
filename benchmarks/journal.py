"""Durability costs: throughput with the journal on vs off, and recovery time.

What it measures (payload as ``hub_throughput.py``: per sample an int64 ``input_ids`` and
a float32 ``logprobs`` sequence of --seq-len plus a float32 ``reward``; one producer
putting batches of --batch, one consumer claiming, reading and acking micro-batches):

* ``overhead``: per transport (``inproc``, ``zmq``) and journal mode, ``samples_per_s``
  of the whole put + consume loop (samples / (put time + consume time)). Modes: ``off``;
  ``journal`` (the controller's event journal only, ``persist_data=False``); ``journal+data``
  (journal plus storage units appending their Arrow chunks to IPC files: the default
  ``JournalConfig``). All at the default sync policy (``"write"``: every event reaches the
  OS before its call returns, fsync once a second). ``loss`` is ``1 - on / off``; the target
  is ``loss <= 0.20`` at the default policy. Modes are run in rotation --repeat times and
  the median taken, so drift on a shared machine hits every mode alike.
* ``recovery``: a journaled hub is filled with --recovery-samples samples (puts of 32,
  half of them claimed and acked by one of two tasks, some leases in flight) and then
  abandoned; ``recovery_s_inproc`` is the time for ``flowrl.Hub(config=...)`` to recover
  it (journal replay + memory-mapping the Arrow files), ``recovery_s_zmq`` the time for
  ``launch_hub`` on the same folder to answer its first call (compare
  ``startup_s_zmq_without_journal``, a fresh hub's start-up). ``journal_events``,
  ``journal_mib`` and ``data_mib`` size what was recovered.
* ``compaction``: recovery time and journal size against the run's length. A hub of
  capacity --compaction-capacity (metadata journal only, ``persist_data=False``) streams
  each of --compaction-lengths samples through (puts of 32, each claimed and acked by two
  tasks), keeping 1,024 live at the end, then is abandoned and recovered. Per length and
  mode: ``journal_mib`` (the event log plus the snapshot) and ``recovery_s``. Modes:
  ``off`` (``compact_bytes`` larger than any log: the journal before compaction existed)
  and ``on`` (``compact_bytes`` = --compact-mib). ``growth`` is each mode's figure at the
  longest run over the shortest: with compaction both stay flat (about 1.0) while the
  run grows, without they grow with it.

* ``restart``: restart time at steady state under the default ``JournalConfig`` (only
  ``persist_data=False``). A hub of capacity --compaction-capacity streams
  --restart-samples samples (puts of 32, each claimed and acked by two tasks, 1,024 live);
  every --restart-every batches its journal folder is copied aside, as a crash would leave
  it, and a fresh hub recovers the copy. ``recovery_s`` max and median over the copies,
  ``log_kib`` (the event log at each copy: the saw-tooth of compaction) and ``snapshot_kib``.
  ``replay_mib_per_s`` (from ``compaction``'s longest run without compaction) and
  ``restore_mib_per_s`` (recovering a copy taken right after a compaction, log empty, at
  capacity --restore-capacity half full) say why the log is kept small: replaying a byte of
  log costs far more than restoring a byte of snapshot.

Read ratios (``loss``) from one run; absolute numbers drift on a shared 2-core machine.
Usage: python benchmarks/journal.py --json [--samples N] [--recovery-samples N]
       [--compaction-lengths 20000,40000,80000] [--compact-mib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
from hub_throughput import COLUMNS, payload, put_get

import flowrl
from flowrl import HubConfig, JournalConfig
from flowrl.testing import abandon

MODES = ("off", "journal", "journal+data")


def _journal(mode: str, folder: str) -> JournalConfig | None:
    if mode == "off":
        return None
    return JournalConfig(path=folder, persist_data=mode == "journal+data")


def overhead(transport: str, samples: int, seq_len: int, batch: int, repeat: int) -> dict:
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    put_get(transport, min(samples, 512), seq_len, batch)  # warm-up: imports, page cache
    for _ in range(repeat):
        for mode in MODES:
            folder = tempfile.mkdtemp(prefix="flowrl-journal-bench-")
            try:
                got = put_get(transport, samples, seq_len, batch, _journal(mode, folder))
                runs[mode].append(got["put_get_samples_per_s"])
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    return {
        "samples_per_s": med,
        "loss": {m: 1 - med[m] / med["off"] for m in MODES if m != "off"},
    }


def recovery(samples: int, seq_len: int) -> dict:
    folder = tempfile.mkdtemp(prefix="flowrl-recovery-bench-")
    config = HubConfig(
        capacity=max(samples, 1024) * 2,
        lease_timeout=600.0,
        journal=JournalConfig(path=folder),
    )
    tasks = {"train": ["input_ids", "logprobs", "reward"], "score": ["reward"]}
    try:
        hub = flowrl.Hub(COLUMNS, tasks=tasks, config=config)
        rng = np.random.default_rng(0)
        batches = [payload(32, seq_len, rng) for _ in range(8)]
        for i in range(samples // 32):
            hub.put(batches[i % 8], groups=np.arange(32) // 8 + 4 * i)
        for i in range(samples // 64):  # half of the samples scored; some leases in flight
            meta = hub.claim("score", 32, timeout=10)
            if i % 10:
                hub.ack(meta)
        hub.publish_version(1)
        live = hub.statistics().live
        abandon(hub)  # as by a crash
        t0 = time.perf_counter()
        again = flowrl.Hub(config=config)
        inproc_s = time.perf_counter() - t0
        assert again.statistics().live == live
        events = again.statistics().events
        again.close()
        t0 = time.perf_counter()
        remote = flowrl.launch_hub(config=config)
        remote.statistics()
        zmq_s = time.perf_counter() - t0
        remote.close()
        t0 = time.perf_counter()
        fresh = flowrl.launch_hub(COLUMNS)
        fresh.statistics()
        startup_s = time.perf_counter() - t0
        fresh.close()
        data = sum(f.stat().st_size for f in Path(folder).glob("unit*/*") if f.is_file())
        journal = os.path.getsize(os.path.join(folder, "events.log"))
        return {
            "samples": live,
            "recovery_s_inproc": inproc_s,
            "recovery_s_zmq": zmq_s,
            "startup_s_zmq_without_journal": startup_s,
            "journal_events": events,
            "journal_mib": journal / 2**20,
            "data_mib": data / 2**20,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def compaction(lengths: list[int], capacity: int, compact_mib: float) -> dict:
    modes = {"off": 1 << 62, "on": max(1, int(compact_mib * 2**20))}
    tasks = {"train": ["input_ids", "logprobs", "reward"], "score": ["reward"]}
    batch = payload(32, 8, np.random.default_rng(0))
    out: dict = {m: {"journal_mib": {}, "recovery_s": {}} for m in modes}
    for length in lengths:
        for mode, compact_bytes in modes.items():
            folder = tempfile.mkdtemp(prefix="flowrl-compaction-bench-")
            journal = JournalConfig(path=folder, persist_data=False, compact_bytes=compact_bytes)
            config = HubConfig(capacity=capacity, lease_timeout=600.0, journal=journal)
            try:
                hub = flowrl.Hub(COLUMNS, tasks=tasks, config=config)
                for i in range(length // 32):
                    hub.put(batch)
                    if i >= 1024 // 32:  # 1,024 samples stay live
                        for task in tasks:
                            hub.ack(hub.claim(task, 32, timeout=10))
                live = hub.statistics().live
                abandon(hub)
                t0 = time.perf_counter()
                again = flowrl.Hub(config=config)
                took = time.perf_counter() - t0
                assert again.statistics().live == live
                again.close()
                size = sum(f.stat().st_size for f in Path(folder).glob("*") if f.is_file())
                out[mode]["journal_mib"][length] = size / 2**20
                out[mode]["recovery_s"][length] = took
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    first, last = min(lengths), max(lengths)
    for mode in modes:
        out[mode]["growth"] = {
            k: out[mode][k][last] / out[mode][k][first] for k in ("journal_mib", "recovery_s")
        }
    return out


def restart(samples: int, every: int, capacity: int) -> dict:
    """Recover copies of a live journal folder taken every ``every`` batches."""
    tasks = {"train": ["input_ids", "logprobs", "reward"], "score": ["reward"]}
    batch = payload(32, 8, np.random.default_rng(0))
    folder = tempfile.mkdtemp(prefix="flowrl-restart-bench-")
    journal = JournalConfig(path=os.path.join(folder, "live"), persist_data=False)
    config = HubConfig(capacity=capacity, lease_timeout=600.0, journal=journal)
    took, log_kib = [], []
    try:
        hub = flowrl.Hub(COLUMNS, tasks=tasks, config=config)
        for i in range(samples // 32):
            hub.put(batch)
            if i >= 1024 // 32:
                for task in tasks:
                    hub.ack(hub.claim(task, 32, timeout=10))
            if i % every == every - 1:
                took.append(_recover_copy(journal.path, config))
                log_kib.append(os.path.getsize(os.path.join(journal.path, "events.log")) / 1024)
        snapshot = os.path.join(journal.path, "snapshot.msgpack")
        snapshot_kib = os.path.getsize(snapshot) / 1024 if os.path.exists(snapshot) else 0.0
        hub.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "compact_kib": journal.compact_bytes / 1024,
        "recovery_s": {"max": max(took), "median": statistics.median(took)},
        "log_kib": {"max": max(log_kib), "median": statistics.median(log_kib)},
        "snapshot_kib": snapshot_kib,
        "copies": len(took),
    }


def restore_rate(capacity: int) -> float:
    """MiB/s recovering a snapshot with an (almost) empty log, capacity half full."""
    folder = tempfile.mkdtemp(prefix="flowrl-restore-bench-")
    journal = JournalConfig(path=folder, persist_data=False, compact_bytes=1 << 62)
    config = HubConfig(capacity=capacity, lease_timeout=600.0, journal=journal)
    try:
        hub = flowrl.Hub(COLUMNS, config=config)
        batch = payload(32, 8, np.random.default_rng(0))
        for _ in range(capacity // 64):
            hub.put(batch)
        hub.close()
        # reopened with compaction due at once: its first call turns the log into a snapshot
        compacting = msgspec.structs.replace(journal, compact_bytes=1)
        config = msgspec.structs.replace(config, journal=compacting)
        hub = flowrl.Hub(config=config)
        hub.statistics()
        hub.close()
        size = os.path.getsize(os.path.join(folder, "snapshot.msgpack")) / 2**20
        t0 = time.perf_counter()
        flowrl.Hub(config=config).close()
        return size / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _recover_copy(path: str, config: HubConfig) -> float:
    copy = path + "-copy"
    shutil.copytree(path, copy)
    try:
        assert config.journal is not None
        moved = msgspec.structs.replace(config.journal, path=copy)
        t0 = time.perf_counter()
        again = flowrl.Hub(config=msgspec.structs.replace(config, journal=moved))
        took = time.perf_counter() - t0
        again.close()
        return took
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--recovery-samples", type=int, default=100_000)
    ap.add_argument("--recovery-seq-len", type=int, default=256)
    ap.add_argument(
        "--compaction-lengths",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[20_000, 40_000, 80_000],
    )
    ap.add_argument("--compaction-capacity", type=int, default=4096)
    ap.add_argument("--compact-mib", type=float, default=1.0)
    ap.add_argument("--restart-samples", type=int, default=200_000)
    ap.add_argument("--restart-every", type=int, default=300)
    ap.add_argument("--restore-capacity", type=int, default=65_536)
    ap.add_argument(
        "--sections", default="overhead,recovery,compaction,restart", help="comma-separated"
    )
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    out: dict = {"sync": "write"}
    if "overhead" in sections:
        out["overhead"] = {
            t: overhead(t, args.samples, args.seq_len, args.batch, args.repeat)
            for t in ("inproc", "zmq")
        }
        out["targets"] = {
            "journal_loss_le_20pct": {
                t: {m: v <= 0.20 for m, v in o["loss"].items()} for t, o in out["overhead"].items()
            }
        }
    if "recovery" in sections:
        out["recovery"] = recovery(args.recovery_samples, args.recovery_seq_len)
    if "compaction" in sections:
        out["compaction"] = compaction(
            args.compaction_lengths, args.compaction_capacity, args.compact_mib
        )
    if "restart" in sections:
        out["restart"] = restart(args.restart_samples, args.restart_every, args.compaction_capacity)
        out["restart"]["restore_mib_per_s"] = restore_rate(args.restore_capacity)
        if "compaction" in sections:
            off, last = out["compaction"]["off"], max(args.compaction_lengths)
            out["restart"]["replay_mib_per_s"] = off["journal_mib"][last] / off["recovery_s"][last]
        out.setdefault("targets", {})["restart_under_1s"] = (
            out["restart"]["recovery_s"]["max"] < 1.0
        )
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

"""Soak a journaled multi-process hub while SIGKILLing every role; account for every sample.

What it runs (issue 26's soak): a hub from ``launch_hub`` with a journal (controller and
2 storage units, each restarted by the launcher's supervisor when it dies), and, as
processes of ``benchmarks/_soak_roles.py``: --producers idempotent producers
(``put_async``, producer id + sequence), one *churn* producer whose every put comes from
a new short-lived thread (rounds of 16, all at once or one after another), --consumers
consumers of two tasks (``train`` reads all three columns, ``score`` two), a
``WeightPublisher`` publishing a versioned 4 MB model (and announcing each version to
the hub) and a ``WeightSubscriber`` reading it. Every --kill-every seconds for
--duration seconds (and until each role was killed once) one of them is SIGKILLed, the
roles in turn (producer, churn, consumer, storage unit, controller, publisher,
subscriber, shuffled each round; a role not yet recovered from its last kill waits its
next turn): a killed role process is started again at once under the same name and
resumes from its own log; a killed server is restarted by the supervisor. Once every
role has recovered, producers stop, the stream is ended and consumers drain it.

Each sample's data is a function of its key (producer, put sequence, position): a
consumer checks what it reads (and, after every read, the last 4 batches it read again:
an array from ``get`` must not change while the units reuse the shared memory of evicted
samples) and logs the keys it acked; one sample in 61 is big
enough (72 KB) to go through the units' shared-memory arenas. The accounting compares
the keys acked per task with the keys of the puts the producers saw answered — the
processes' own logs, never the hub's counters: ``lost`` and ``duplicated`` must be 0.
An ack whose outcome a consumer could not see is sent again after its restart, which
settles it while the lease's deadline (--lease-timeout, long for that reason) is ahead
(see ``_soak_roles``); ``unresolved_acks`` counts those it could not settle, leases
for which a loss or duplicate would go unseen: the accounting is exact when it is 0.

What it reports (JSON with --json): samples produced / consumed per task / lost /
duplicated / corrupt; kills per role and each role's recovery time (a server: from the
kill until a call through it succeeds; a role process: until its log moves again);
weight versions published and read, torn reads (must be 0); and, sampled every
--sample-every seconds (``series``: t from the start, kills start at ``kills_from_s``),
each role's open descriptors, sockets, threads and resident memory (the largest over
the role's processes; start: when every role had made progress; final: when the kills
stopped and every role had recovered), the hub's and the weight channel's files and
bytes in ``/dev/shm`` (and what is left after close: must be 0), the controller's
journal (log and snapshot: bounded by compaction) and the storage units' files beside
it (segments of 1,024 chunks per column, deleted once all evicted: about what is
live). ``ok`` is false, with ``problems`` saying why, on any loss, duplicate, corrupt
sample, torn read, crash, leftover, or a resource above its bound (--max-fds,
--max-shm-files, --max-journal-mb).

Read recovery times as figures for this machine and its load (``load_avg``); the
accounting is exact whatever the load.
Usage: python benchmarks/soak.py --json [--duration 75] [--kill-every 2.5]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _soak_roles as roles  # (this script's folder is on sys.path)

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._weights.shm_files import ChannelFiles
from flowrl.errors import TransportError
from flowrl.testing import account

COLUMNS = [
    Column.scalar("key", "int64"),
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
]
TASKS = {"train": ["key", "ids", "reward"], "score": ["key", "ids"]}
KILLED_ROLES = ("producer", "churn", "consumer", "unit", "controller", "publisher", "subscriber")
_SCRIPT = str(Path(__file__).with_name("_soak_roles.py"))
_RPC_TIMEOUT = 5.0
_PROBE_TIMEOUT = 0.5
#: what is sampled of each process (the largest over a role's processes)
_PER_PROCESS = ("fds", "sockets", "threads", "rss_mib")


class Worker:
    """One role process, started again under the same name (and log) after a kill."""

    def __init__(self, role: str, name: str, spec: dict[str, Any], folder: str) -> None:
        self.role, self.name = role, name
        self.log = spec["log"] = os.path.join(folder, f"{name}.log")
        self.stderr = os.path.join(folder, f"{name}.err")
        self.spec = spec
        self.crashes: list[str] = []
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.stderr, "ab") as err:
            argv = [sys.executable, _SCRIPT, self.role, json.dumps(self.spec)]
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = self._spawn()

    def restart_if_crashed(self) -> None:
        code = self.proc.poll()
        if code not in (None, 0):
            tail = Path(self.stderr).read_text(errors="replace").strip().splitlines()[-1:]
            self.crashes.append(f"{self.name} exited with {code}: {' '.join(tail)}")
            self.proc = self._spawn()

    def progress(self) -> int:
        return len(roles.read_log(self.log))


# -- resources -------------------------------------------------------------------------------
def _proc_usage(pid: int) -> tuple[int, int, int, int] | None:
    """(descriptors, sockets, threads, resident MiB) of a live process, None if gone."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        sockets = 0
        for fd in fds:
            with contextlib.suppress(OSError):
                sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        threads, rss_kib = int(status["Threads"]), int(status["VmRSS"].split()[0])
    except (OSError, KeyError):
        return None
    return len(fds), sockets, threads, rss_kib >> 10


def _files(paths: list[str]) -> tuple[int, int]:
    """(files, bytes) under these files and folders (recursively)."""
    count = size = 0
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path):
                for root, _, names in os.walk(path):
                    for name in names:
                        with contextlib.suppress(OSError):
                            size += os.stat(os.path.join(root, name)).st_size
                            count += 1
            else:
                size += os.stat(path).st_size
                count += 1
    return count, size


class Monitor:
    """Samples every role's descriptors, sockets and threads, ``/dev/shm`` and the journal."""

    def __init__(self, soak: Soak, every: float) -> None:
        self.soak, self.every = soak, every
        self.series: list[dict[str, Any]] = []
        self.start: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.series.append(self.sample())

    def sample(self) -> dict[str, Any]:
        usage: dict[str, list[tuple[int, int, int, int]]] = {}
        for role, pids in self.soak.pids().items():
            got = [u for u in map(_proc_usage, pids) if u is not None]
            if got:
                usage[role] = got
        point: dict[str, Any] = {"t": round(time.monotonic() - self.soak.started, 2)}
        for i, what in enumerate(_PER_PROCESS):
            point[what] = {role: max(u[i] for u in got) for role, got in usage.items()}
        point["shm_files"], point["shm_bytes"] = _files(self.soak.shm_paths())
        journal = self.soak.journal
        point["journal_bytes"] = _files(glob.glob(f"{journal}/*.*"))[1]  # log and snapshot
        point["unit_files_bytes"] = _files(glob.glob(f"{journal}/unit*"))[1]
        return point

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, after_close: dict[str, Any]) -> dict[str, Any]:
        """start / max / final of each measure (max over the whole run)."""
        first = self.start or (self.series[0] if self.series else {})
        last = self.final or (self.series[-1] if self.series else {})
        out: dict[str, Any] = {}
        for what in _PER_PROCESS:
            out[what] = {
                role: {
                    "start": first.get(what, {}).get(role),
                    "max": max(p[what].get(role, 0) for p in self.series),
                    "final": last.get(what, {}).get(role),
                }
                for role in sorted({r for p in self.series for r in p[what]})
            }
        for what in ("shm_files", "shm_bytes", "journal_bytes", "unit_files_bytes"):
            out[what] = {
                "start": first.get(what),
                "max": max((p[what] for p in self.series), default=0),
                "final": last.get(what),
                "after_close": after_close.get(what),
            }
        return out


# -- the run ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.folder = tempfile.mkdtemp(prefix="flowrl-soak-")
        self.journal = os.path.join(self.folder, "journal")
        self.channel = f"soak{os.getpid()}"
        config = HubConfig(
            capacity=args.capacity,
            n_units=2,
            lease_timeout=args.lease_timeout,
            journal=JournalConfig(path=self.journal),
        )
        self.hub = flowrl.launch_hub(COLUMNS, tasks=TASKS, config=config)
        self.hub.rpc_timeout = _RPC_TIMEOUT
        self.unit_arenas = [s.shm_folder for s in self.hub.servers.specs[:-1]]
        self.started = self.t0 = time.monotonic()  # (t0: when the kills start)
        self.workers: list[Worker] = []
        self.kills: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    # the processes
    def start_roles(self) -> None:
        a = self.args
        common = {"address": self.hub.address, "rpc_timeout": _RPC_TIMEOUT}
        common["stop"] = os.path.join(self.folder, "stop")
        producing = {**common, "batch": a.batch, "put_timeout": 2.0, "pause": a.pause}
        for p in range(a.producers):
            spec = {**producing, "index": p, "name": f"producer-{p}", "window": 8}
            self._add("producer", spec)
        spec = {**producing, "index": a.producers, "name": "churn", "window": 16}
        self._add("churn", spec)
        for c in range(a.consumers):
            task = list(TASKS)[c % len(TASKS)]
            spec = {**common, "name": f"consumer-{c}", "task": task, "batch": 2 * a.batch}
            self._add("consumer", {**spec, "claim_timeout": 1.0})
        weights = {**common, "channel": self.channel}
        self._add("publisher", {**weights, "name": "publisher", "elements": 1 << 20, "pause": 0.2})
        self._add("subscriber", {**weights, "name": "subscriber", "pause": 0.05})

    def _add(self, role: str, spec: dict[str, Any]) -> None:
        self.workers.append(Worker(role, spec["name"], spec, self.folder))

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def pids(self) -> dict[str, list[int]]:
        with self._lock:
            out: dict[str, list[int]] = {"soak": [os.getpid()]}
            for w in self.workers:
                if w.proc.poll() is None:
                    out.setdefault(w.role, []).append(w.proc.pid)
            procs = self.hub.servers.procs
            out["controller"] = [procs[-1].pid]
            out["unit"] = [p.pid for p in procs[:-1]]
            return out

    def shm_paths(self) -> list[str]:
        base = ChannelFiles(self.channel, "/dev/shm").base
        return [a for a in self.unit_arenas if a] + glob.glob(base + ".*")

    def wait_all_progressed(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for w in self.workers:
                w.restart_if_crashed()
            if all(w.progress() for w in self.workers):
                return
            time.sleep(0.2)

    # the kills
    def kill(self, role: str) -> None:
        at = time.monotonic()
        entry: dict[str, Any] = {"role": role, "t": round(at - self.t0, 2)}
        if role in ("controller", "unit"):
            procs = self.hub.servers.procs
            victim = len(procs) - 1 if role == "controller" else random.randrange(len(procs) - 1)
            restarts = self.hub.servers.restarts
            os.kill(procs[victim].pid, signal.SIGKILL)
            entry["recovered_s"] = self._wait_server(restarts, at, entry)
        else:
            worker = random.choice(self.of(role))
            entry["victim"] = worker.name
            before = worker.progress()
            with self._lock:
                worker.kill()
            entry["worker"], entry["before"] = worker, before
        self.kills.append(entry)

    def _wait_server(self, restarts: int, killed_at: float, entry: dict[str, Any]) -> float | None:
        """Seconds from the kill until the server is back and a call through every
        server (statistics: the controller and each unit) succeeds."""
        deadline = killed_at + 120
        self.hub.rpc_timeout = _PROBE_TIMEOUT  # (a finer grain than one rpc_timeout per try)
        try:
            while time.monotonic() < deadline:
                if self.hub.servers.restarts > restarts:
                    entry.setdefault("respawned_s", round(time.monotonic() - killed_at, 3))
                    with contextlib.suppress(TransportError):
                        self.hub.statistics()
                        return round(time.monotonic() - killed_at, 3)
                time.sleep(0.02)
            return None
        finally:
            self.hub.rpc_timeout = _RPC_TIMEOUT

    def track_recoveries(self) -> set[str]:
        """A killed role process has recovered once its log moves again; returns the
        roles with a kill not recovered yet."""
        now = time.monotonic()
        waiting = set()
        for entry in self.kills:
            worker = entry.get("worker")
            if worker is not None and "recovered_s" not in entry:
                if worker.progress() > entry["before"]:
                    entry["recovered_s"] = round(now - self.t0 - entry["t"], 3)
                else:
                    waiting.add(entry["role"])
        return waiting

    def wait_recovered(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while self.track_recoveries() and time.monotonic() < deadline:
            for w in self.workers:
                w.restart_if_crashed()
            time.sleep(0.1)

    def chaos(self, monitor: Monitor) -> None:
        a = self.args
        end = time.monotonic() + a.duration
        give_up = end + 300  # every role is killed at least once, however long it takes
        order: list[str] = []
        next_kill = time.monotonic() + a.kill_every
        while time.monotonic() < give_up and (
            time.monotonic() < end or {k["role"] for k in self.kills} != set(KILLED_ROLES)
        ):
            for w in self.workers:
                w.restart_if_crashed()
            waiting = self.track_recoveries()
            if time.monotonic() >= next_kill:
                if not order:
                    order = random.sample(KILLED_ROLES, len(KILLED_ROLES))
                # a role still starting up after its last kill waits for a later turn
                ready = [r for r in order if r not in waiting]
                if ready:
                    order.remove(ready[-1])
                    self.kill(ready[-1])
                next_kill = time.monotonic() + a.kill_every
            time.sleep(0.05)
        self.wait_recovered(120)
        monitor.final = monitor.sample()

    # the end
    def drain(self) -> list[str]:
        """Stop producers, end the stream, let consumers drain; the problems met."""
        problems = []
        Path(self.folder, "stop").touch()
        writers = [w for w in self.workers if w.role in ("producer", "churn")]
        problems += self._wait_exit(writers, 180)
        roles.retry(self.hub.end_stream, time.time() + 120)
        problems += self._wait_exit(self.of("consumer"), 180 + self.args.lease_timeout)
        problems += self._wait_exit(self.of("publisher") + self.of("subscriber"), 60)
        self.track_recoveries()
        return problems

    def _wait_exit(self, workers: list[Worker], limit: float) -> list[str]:
        deadline = time.monotonic() + limit
        problems = []
        for w in workers:
            while True:
                try:
                    code = w.proc.wait(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        problems.append(f"{w.name} still running after the drain (killed)")
                        w.proc.kill()
                        w.proc.wait()
                        break
                    self.track_recoveries()
                    continue
                if code != 0:
                    w.restart_if_crashed()  # (records the crash)
                    continue
                break
        return problems

    def close(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        self.hub.close()


# -- the accounting ----------------------------------------------------------------------------
def account_samples(soak: Soak) -> dict[str, Any]:
    """Keys produced (the producers' logs) against keys acked per task (the consumers')."""
    batch = soak.args.batch
    produced: list[int] = []
    for w in soak.of("producer"):
        for fields in roles.read_log(w.log):
            produced += roles.keys_of(w.spec["index"], int(fields[0]), batch)
    for w in soak.of("churn"):
        for fields in roles.read_log(w.log):
            for seq in range(int(fields[0]), int(fields[1]) + 1):
                produced += roles.keys_of(w.spec["index"], seq, batch)
    records: dict[str, list[tuple[str, int, list[int]]]] = {t: [] for t in TASKS}
    corrupt = 0
    for w in soak.of("consumer"):
        lines = roles.read_log(w.log)
        corrupt += sum(int(f[2]) for f in lines if f[0] == "Z")
        records[w.spec["task"]] += roles.consumer_records(lines)
    outcomes = Counter(r[0] for task_records in records.values() for r in task_records)
    consumed = {t: roles.consumed_keys(r) for t, r in records.items()}
    lost, duplicated = {}, {}
    for task in TASKS:
        lost[task], duplicated[task] = account(produced, consumed[task])
    return {
        "produced": len(produced),
        "consumed": {t: len(k) for t, k in consumed.items()},
        "lost": lost,
        "duplicated": duplicated,
        "corrupt": corrupt,
        "acks": outcomes.get("A", 0),
        "leases_given_back_or_expired": outcomes.get("X", 0),
        "unresolved_acks": outcomes.get("U", 0),
    }


def account_weights(soak: Soak) -> dict[str, Any]:
    published = [int(f[0]) for w in soak.of("publisher") for f in roles.read_log(w.log)]
    seen = [(int(f[1]), int(f[2])) for w in soak.of("subscriber") for f in roles.read_log(w.log)]
    versions = [v for v, _ in seen]
    return {
        "published": len(published),
        "newest": max(published, default=0),
        "read": len(seen),
        "torn_reads": sum(bad > 0 for _, bad in seen),
        # versions read, in order (a restarted subscriber starts at the newest): never older
        "went_back": sum(b < a for a, b in itertools.pairwise(versions)),
    }


def recoveries(kills: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role in KILLED_ROLES:
        times = [k.get("recovered_s") for k in kills if k["role"] == role]
        done = [t for t in times if t is not None]
        out[role] = {
            "kills": len(times),
            "recovered": len(done),
            "median_s": round(statistics.median(done), 3) if done else None,
            "max_s": max(done) if done else None,
        }
    return out


def problems_of(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    s, w, r = report["samples"], report["weights"], report["resources"]
    problems = []
    if s["produced"] == 0:
        problems.append("nothing was produced")
    for task in TASKS:
        if s["lost"][task] or s["duplicated"][task]:
            problems.append(f"{task}: {s['lost'][task]} lost, {s['duplicated'][task]} duplicated")
    if s["corrupt"]:
        problems.append(f"{s['corrupt']} samples read with data not their key's")
    if w["torn_reads"] or w["went_back"]:
        problems.append(f"weights: {w['torn_reads']} torn reads, went back {w['went_back']}x")
    if w["read"] == 0:
        problems.append("the subscriber read no weight version")
    for role in KILLED_ROLES:
        if report["kills"].get(role, 0) == 0:
            problems.append(f"no {role} was killed (run longer or kill more often)")
    for role, fds in r["fds"].items():
        if fds["max"] > args.max_fds:
            problems.append(f"{role}: {fds['max']} descriptors open (bound {args.max_fds})")
    if r["shm_files"]["max"] > args.max_shm_files:
        problems.append(f"/dev/shm held {r['shm_files']['max']} files (bound {args.max_shm_files})")
    if r["shm_files"]["after_close"]:
        problems.append(f"{r['shm_files']['after_close']} /dev/shm files left after close")
    if r["journal_bytes"]["max"] > args.max_journal_mb * 2**20:
        problems.append(f"journal reached {r['journal_bytes']['max']} bytes")
    for role, times in report["recovery"].items():
        if times["recovered"] < times["kills"]:
            problems.append(f"{times['kills'] - times['recovered']} {role} kill(s) never recovered")
    if report["hub_end"]["live"] or report["hub_end"]["leases"]:
        problems.append(f"the hub did not end empty: {report['hub_end']}")
    return problems + report["crashes"] + report["drain_problems"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    load_before = os.getloadavg()
    started = time.monotonic()
    soak = Soak(args)
    monitor = Monitor(soak, args.sample_every)
    try:
        soak.start_roles()
        soak.wait_all_progressed(120)
        monitor.start = monitor.sample()
        soak.t0 = time.monotonic()
        soak.chaos(monitor)
        drain_problems = soak.drain()
        stats = roles.retry(soak.hub.statistics, time.time() + 120)
    finally:
        soak.close()
        monitor.stop()
    after_close = dict(zip(("shm_files", "shm_bytes"), _files(soak.shm_paths()), strict=True))
    every = max(1, len(monitor.series) // 40)
    report: dict[str, Any] = {
        "duration_s": args.duration,
        "kills_from_s": round(soak.t0 - soak.started, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "samples": account_samples(soak),
        "duplicate_puts_dropped": stats.duplicate_puts,
        "weights": account_weights(soak),
        "kills": dict(Counter(k["role"] for k in soak.kills)),
        "recovery": recoveries(soak.kills),
        "kill_log": [
            {k: v for k, v in e.items() if k not in ("worker", "before")} for e in soak.kills
        ],
        "resources": monitor.summary(after_close),
        "series": monitor.series[::every],
        "hub_end": {"live": stats.live, "leases": stats.leases, "reserved": stats.reserved},
        "crashes": [c for w in soak.workers for c in w.crashes],
        "drain_problems": drain_problems,
    }
    report["problems"] = problems_of(report, args)
    report["ok"] = not report["problems"]
    if report["ok"]:
        shutil.rmtree(soak.folder, ignore_errors=True)
    else:
        report["folder"] = soak.folder  # the logs, to look into
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--json", action="store_true", help="print one JSON object")
    add("--duration", type=float, default=75.0, help="seconds of kills, at least (see above)")
    add("--kill-every", type=float, default=2.5, help="seconds between two kills")
    add("--producers", type=int, default=2, help="producer processes (besides churn)")
    add("--consumers", type=int, default=3, help="consumer processes (tasks in turn)")
    add("--batch", type=int, default=8, help="samples per put, at most")
    add("--pause", type=float, default=0.01, help="seconds a producer waits between puts")
    add("--capacity", type=int, default=2048, help="the hub's capacity")
    add("--lease-timeout", type=float, default=30.0, help="the hub's lease timeout")
    add("--sample-every", type=float, default=0.5, help="seconds between resource samples")
    add("--max-fds", type=int, default=512, help="bound on one process's descriptors")
    add("--max-shm-files", type=int, default=64, help="bound on the run's /dev/shm files")
    add("--max-journal-mb", type=float, default=4.0, help="bound on the journal's size")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        s, w = report["samples"], report["weights"]
        print(
            f"{s['produced']} samples, consumed {s['consumed']}, lost {s['lost']}, "
            f"duplicated {s['duplicated']}, corrupt {s['corrupt']}; kills {report['kills']}; "
            f"weights {w['published']} published, {w['torn_reads']} torn; ok={report['ok']}"
        )
        for problem in report["problems"]:
            print("  problem:", problem)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

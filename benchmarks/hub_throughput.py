"""Hub throughput and latency: put/get bandwidth, claim latency, controller cell rate.

What it measures (defaults: 4096 samples; per sample an int64 ``input_ids`` sequence and a
float32 ``logprobs`` sequence of --seq-len 1024 plus a float32 ``reward``; one producer
putting batches of --batch 32, one consumer task claiming micro-batches of 32):

* ``put_*`` / ``get_*``: samples/s and GiB/s of payload through the chosen --transport
  (``inproc``: the embedded hub; ``zmq``: controller and storage unit in other processes).
  ``put`` times the puts of a hub whose storage memory has been filled and drained
  once, as in every step of a job past its first (a storage unit reuses the shared
  memory its evicted samples leave); ``put_first_fill_gib_per_s`` times the first fill,
  which also makes that memory (``machine.fresh_shm_gib_per_s`` bounds it).
  ``put_async_gib_per_s``: the same batches streamed with ``put_async`` (one ``flush``
  at the end) into a hub of the default capacity, whose pools let a stream reserve its
  next puts' indices ahead; zmq: ``put_async_cpu_ms``, the CPU milliseconds a put costs
  the producer, each storage unit and the controller (a pipelined stream on 2 cores goes
  no faster than their sum allows). ``put_batched_gib_per_s`` / ``put_batched_cpu_ms``:
  the same batches through ``hub.put_batcher()``, which sends eight puts as one
  ``put_async`` (passes alternate with the ``put_async`` ones).
  ``get`` times ``hub.get(meta)`` plus turning every column into numpy, over every
  claimed micro-batch (reads change nothing: the median of 5 passes after a warm-up
  pass); ``consume_*`` times the whole consumer loop (claim + get + ack, one pass), the
  figure a trainer sees.
* ``claim_p50_ms`` / ``claim_p99_ms``: claim latency with 100,000 samples live, and
  ``claim_p99_ms_1k`` vs ``claim_p99_ms_131k`` to show it does not grow with the table.
* ``controller_cell_updates_per_s``: (sample, column) readiness updates per second the
  controller applies (reserve + commit of metadata only, no payload), batches of --batch;
  the median of five runs after a warm-up.
* zmq only: ``put_to_claimable_p50_ms`` (a put until a consumer blocked in claim returns),
  ``single_sample_puts_per_s`` (one producer thread streaming single-sample puts with
  ``put_async``, each its own request and commit, then ``flush``) and
  ``single_sample_sync_puts_per_s`` (``put``: a round trip each),
  ``metadata_round_trips_per_s`` (one client thread, one request at a time) and
  ``metadata_round_trips_per_s_2_threads`` (two threads of that client, each one request
  at a time: what the controller answers when requests overlap), ``startup_s``,
  ``blocked_claim_put_latency_ratio`` (put latency while another thread waits in claim,
  divided by put latency without it, medians over 5 alternating rounds of 40 puts of
  --batch samples; 1.0 means no interference).
* zmq only, the transport's floor on this machine (bare pyzmq, no flowrl code): an echo
  server in another process, DEALER to ROUTER over ipc as the hub's sockets are.
  ``zmq_echo_round_trips_per_s`` (one small request at a time; a metadata round trip can
  be no faster) and ``zmq_one_way_after_pause_ms`` (the p50 time one put-sized message
  takes to reach a process after 2 ms of quiet, as in ``put_to_claimable``; a put becomes
  claimable after three such hops: producer -> unit -> controller -> consumer).
* zmq only: ``stage_rounds_per_s``: one stage worker thread doing what a pipeline stage
  does per micro-batch of one sample (``claim``, ``get`` of its input column, ``put`` of
  its output column with ``indices=meta, ack=meta``), one round at a time, every input
  already put (2,000 rounds after 200 of warm-up; fewer for --samples under 4,000), and
  ``stage_round_p50_ms`` (the median round: steadier than the rate on a shared machine)
  and ``stage_round_cpu_ms`` (CPU time a round costs the client, the controller and the
  storage unit together, from /proc: the steadiest of the three on a loaded machine).
  ``stage_round_vs_echo`` is that rate over ``zmq_echo_round_trips_per_s`` measured in
  the same run. A round is 7 network legs at the least (claim 2, get 2, put 3: producer
  -> unit -> controller -> producer), 3.5 echoes' worth, so that ratio is 1 / 3.5 = 0.29
  at the very best; ``stage_round_legs_vs_echo`` (the ratio times 3.5) is the share of
  the bare transport's speed the hub keeps per leg (1.0: no cost but the legs').
* ``--auth-rounds N`` (zmq): the cost of the hub key. Two hubs listen on TCP loopback
  (``launch_hub(host="127.0.0.1")``), one with its key (commands CURVE-encrypted, the
  storage unit's data socket behind a PLAIN token) and one without (the same servers
  taking any peer, which only this benchmark starts), both up at once. In each of N
  rounds (the order flips each round) each hub gets --samples / N samples put in batches
  of --batch and claimed, a read pass over every batch it holds (as ``get`` above, per
  batch) and 500 claim + release round trip pairs. ``auth_<figure>_ratio`` is the median
  over rounds of with-key over without-key throughput (1.0: free; 0.9: a 10% cost), for
  ``get``, ``put`` and ``metadata_round_trips``, and ``auth_<figure>_cpu_ratio`` the
  same for the CPU time the client and the servers spent over all rounds (from /proc:
  steadier than the wall clock on a loaded machine).
  ``auth_per_round`` lists the rounds.
  ``zmq_curve_large_echo_ratio``: bare pyzmq, how many times longer a get-sized message
  (--batch samples) takes to echo over TCP loopback under CURVE than in the clear: why
  the data sockets use a token instead.
    )
    ap.add_argument(
  ``stage_rounds_pipelined_per_s`` / ``stage_round_pipelined_vs_echo``: the same rounds
  pipelined as a stage worker over processes runs them (the next input claimed and read
  by a thread, each output put with ``put_async`` and answered during the next round):
  no longer bound by 3.5 echoes a round. ``stage_rounds_prefetch<k>_per_s`` /
  ``stage_round_prefetch<k>_vs_echo`` (k = 8, 32): as a stage declared with
  ``prefetch=k`` runs them (up to k inputs claimed in one request and read in one, up to
  k outputs in flight).
* ``--peer``: runs the TransferQueue package on the same payload in a subprocess and
  reports ``peer`` figures and ``put_get_speedup_vs_transferqueue``: samples / (put time +
  consumer-loop time) for flowrl over the same for TransferQueue (its put, get_meta and
  get_data). ``compat``: flowrl's TransferQueue-compatible client
  (``flowrl.compat.transfer_queue``) driven by the same driver
  (benchmarks/_transferqueue_peer.py: TensorDicts in and out, ``put`` / ``get_meta`` /
  ``get_data``), per placement (``inproc``, ``zmq``). The three clients run
  ``--peer-rounds`` (5) alternating rounds after one uncounted warm-up round of each (a
  first round also pays for first-time allocations: a storage unit's shared memory, Ray's
  object store), each client in its own process started once; every
  figure is the median over rounds, and ``put_get_speedup_vs_transferqueue`` of a
  placement is the median of TransferQueue's put + get seconds over the compat client's
  in the same round (``put_get_speedup_per_round`` lists them), with the get speedup
  apart. Each call is compared apart too: ``<call>_speedup_vs_transferqueue`` (median over
  rounds of TransferQueue's seconds in that call over the compat client's),
  ``<call>_speedup_lowest_round`` and ``<call>_speedup_per_round``, for ``put``,
  ``get_meta``, ``get_data``, ``kv_batch_put`` and ``kv_batch_get``.

* ``machine``: what the machine itself does in this run, to read absolute figures of
  different days against (the same code's figures moved 2-4x between sessions here):
  ``python_loop_mops`` (millions of iterations a second of a plain Python ``+=`` loop),
  ``memcpy_gib_per_s`` (numpy copying 64 MiB between existing buffers) and
  ``fresh_shm_gib_per_s`` (a new 64 MiB ``/dev/shm`` file allocated, mapped and every page
  touched: the memory a storage unit takes for puts; ``null`` without ``/dev/shm``).

Read ratios from one run; absolute numbers drift on a shared 2-core machine.
Usage: python benchmarks/hub_throughput.py --json [--transport zmq] [--peer] [--auth-rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zmq

import flowrl
from flowrl import Column, HubConfig, JournalConfig
from flowrl._controller.controller import Controller
from flowrl._controller.samplers import FifoSampler
from flowrl._launch.processes import start_hub
from flowrl._pipeline.prefetch import Prefetcher
from flowrl._protocol.commands import Cell, Claim, Commit
from flowrl._store.shm import _Segment
from flowrl._transport.auth import HubKey

GIB = 1024**3
GET_PASSES = 5
META_ROUNDS = 500  # claim + release round pairs per --auth-rounds round
FIGURES = ("get", "put", "metadata_round_trips")  # what --auth-rounds compares
COLUMNS = [
    Column.ragged("input_ids", "int64"),
    Column.ragged("logprobs", "float32"),
    Column.scalar("reward", "float32"),
]


def make_hub(transport: str, capacity: int, journal: JournalConfig | None = None):
    """An embedded hub (``inproc``), a launched one (``zmq``: ipc), or one on TCP loopback
    with its key (``tcp+key``) or taking any peer (``tcp``)."""
    config = HubConfig(capacity=capacity, lease_timeout=600.0, journal=journal)
    tasks = {"train": ["input_ids", "logprobs", "reward"]}
    if transport == "inproc":
        return flowrl.Hub(COLUMNS, tasks=tasks, config=config)
    if transport == "zmq":
        return flowrl.launch_hub(COLUMNS, tasks=tasks, config=config)
    key = HubKey.generate() if transport == "tcp+key" else None
    return start_hub(
        COLUMNS, tasks=tasks, config=config, startup_timeout=60.0, host="127.0.0.1", key=key
    )


def payload(batch: int, seq_len: int, rng: np.random.Generator) -> dict:
    ids = rng.integers(0, 32000, size=(batch, seq_len), dtype=np.int64)
    lps = rng.standard_normal((batch, seq_len), dtype=np.float32)
    cu = np.arange(batch + 1, dtype=np.int64) * seq_len
    return {
        "input_ids": flowrl.RaggedArray(ids.reshape(-1), cu),
        "logprobs": flowrl.RaggedArray(lps.reshape(-1), cu),
        "reward": rng.standard_normal(batch, dtype=np.float32),
    }


STREAM_PASSES = 3  # timed put_async passes (the median counts)


def put_get(
    transport: str, samples: int, seq_len: int, batch: int, journal: JournalConfig | None = None
) -> dict:
    rng = np.random.default_rng(0)
    batches = [payload(batch, seq_len, rng) for _ in range(min(8, samples // batch))]
    sample_bytes = seq_len * 8 + seq_len * 4 + 4
    hub = make_hub(transport, capacity=max(samples, 1024) + batch, journal=journal)
    try:
        n_batches = samples // batch
        hub.put(batches[0])  # warm-up (connections, code paths), then consume it
        _drain(hub, batch, 1)
        # The first fill makes the storage's memory; every later step reuses it (what a
        # job does past its first step): puts are timed on both.
        first_fill_s = _timed_puts(hub, batches, n_batches)
        _drain(hub, batch, n_batches)
        put_s = _timed_puts(hub, batches, n_batches)
        # Reads do not change the hub: time passes over every claimed micro-batch (the
        # median of GET_PASSES after a warm-up pass), then give the batches back.
        held = [hub.claim("train", batch, timeout=10) for _ in range(n_batches)]
        passes = [_read_pass(hub, held)[0] for _ in range(GET_PASSES + 1)][1:]
        get_s = statistics.median(passes)
        for meta in reversed(held):  # back to the front of the queue, in claim order
            hub.release(meta)
        checksum = 0
        t0 = time.perf_counter()
        for _ in range(n_batches):
            meta = hub.claim("train", batch, timeout=10)
            checksum += _read_pass(hub, [meta])[1]
            hub.ack(meta)
        consume_s = time.perf_counter() - t0
        n = n_batches * batch
        return {
            "put_samples_per_s": n / put_s,
            "get_samples_per_s": n / get_s,
            "put_gib_per_s": n * sample_bytes / put_s / GIB,
            "put_first_fill_gib_per_s": n * sample_bytes / first_fill_s / GIB,
            "get_gib_per_s": n * sample_bytes / get_s / GIB,
            "consume_samples_per_s": n / consume_s,
            "consume_gib_per_s": n * sample_bytes / consume_s / GIB,
            "put_get_samples_per_s": n / (put_s + consume_s),
            "checksum": checksum,
        }
    finally:
        hub.close()


def _timed_puts(hub: Any, batches: list[dict], n_batches: int, how: str = "put") -> float:
    """Seconds to put ``n_batches`` of ``batches`` with ``put``, a ``put_async`` stream
    (one ``flush``) or a ``put_batcher`` (``batched``: closed at the end)."""
    t0 = time.perf_counter()
    if how == "batched":
        with hub.put_batcher() as batcher:
            for i in range(n_batches):
                batcher.put(batches[i % len(batches)])
    elif how == "put_async":
        for i in range(n_batches):
            hub.put_async(batches[i % len(batches)])
        hub.flush()
    else:
        for i in range(n_batches):
            hub.put(batches[i % len(batches)])
    return time.perf_counter() - t0


def put_stream(transport: str, samples: int, seq_len: int, batch: int) -> dict:
    """A producer streaming --batch-sample puts into a hub of the default capacity, with
    ``put_async`` (one flush at the end) and through a ``put_batcher`` (8 puts sent as
    one), in alternating passes: GiB/s of each (the median of STREAM_PASSES passes after
    one of each that fills the storage memory, each drained after) and the CPU milliseconds
    a put costs each process (the client, the storage units, the controller; zmq only)."""
    rng = np.random.default_rng(3)
    batches = [payload(batch, seq_len, rng) for _ in range(min(8, samples // batch))]
    sample_bytes = seq_len * 8 + seq_len * 4 + 4
    n_batches = samples // batch
    hub = make_hub(transport, capacity=HubConfig().capacity)
    procs = [p.pid for p in hub.servers.procs] if transport == "zmq" else []
    out: dict[str, Any] = {}
    try:
        for how in ("put_async", "batched"):
            _timed_puts(hub, batches, n_batches, how)
            _drain(hub, batch, n_batches)
        passes: dict[str, list[float]] = {"put_async": [], "batched": []}
        cpu = {how: np.zeros(1 + len(procs)) for how in passes}
        for _ in range(STREAM_PASSES):
            for how in passes:
                before = np.array([time.process_time(), *map(_cpu_s, procs)])
                passes[how].append(_timed_puts(hub, batches, n_batches, how))
                cpu[how] += np.array([time.process_time(), *map(_cpu_s, procs)]) - before
                _drain(hub, batch, n_batches)
        for how, key in (("put_async", "put_async"), ("batched", "put_batched")):
            seconds = statistics.median(passes[how])
            out[f"{key}_gib_per_s"] = n_batches * batch * sample_bytes / seconds / GIB
            if procs:
                per_put = cpu[how] / (STREAM_PASSES * n_batches) * 1e3
                out[f"{key}_cpu_ms"] = [float(c) for c in per_put]
        return out
    finally:
        hub.close()


def _drain(hub: Any, batch: int, n_batches: int) -> None:
    """Claim, read and ack ``n_batches`` micro-batches (the samples are evicted)."""
    for _ in range(n_batches):
        meta = hub.claim("train", batch, timeout=10)
        hub.get(meta).packed("input_ids")
        hub.ack(meta)


def auth_rounds(samples: int, seq_len: int, batch: int, rounds: int) -> dict:
    """The same work on two hubs on TCP loopback, one without the key and one with it,
    both up at once, in alternating rounds (the order flips each round)."""
    rng = np.random.default_rng(2)
    batches = [payload(batch, seq_len, rng) for _ in range(min(8, max(1, samples // batch)))]
    per_round = max(1, samples // batch // rounds)  # batches put per round and hub
    hubs = {"off": make_hub("tcp", capacity=samples + 1024), "on": None}
    try:
        hubs["on"] = make_hub("tcp+key", capacity=samples + 1024)
        for hub in hubs.values():  # one batch more than is held: for the round trips
            hub.put(batches[0])
        # per figure and hub, per round: (wall seconds, CPU seconds of client and servers)
        spent: dict[str, dict[str, list[tuple[float, float]]]] = {
            f: {"off": [], "on": []} for f in FIGURES
        }
        held: dict[str, list[Any]] = {"off": [], "on": []}

        def put(hub: Any) -> None:
            for i in range(per_round):
                hub.put(batches[i % len(batches)])

        def round_trips(hub: Any) -> None:
            for _ in range(META_ROUNDS):  # two round trips each, nothing consumed
                hub.release(hub.claim("train", 1, timeout=10))

        for r in range(rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                hub = hubs[name]
                spent["put"][name].append(_spent(hub, put))
                held[name] += [hub.claim("train", batch, timeout=10) for _ in range(per_round)]
                wall, cpu = _spent(hub, lambda h, metas=held[name]: _read_pass(h, metas))
                spent["get"][name].append((wall / len(held[name]), cpu / len(held[name])))
                spent["metadata_round_trips"][name].append(_spent(hub, round_trips))
    finally:
        for hub in hubs.values():
            if hub is not None:
                hub.close()
    # with-key throughput over without-key throughput, per round: off seconds / on seconds
    # (CPU: the totals over every round, since a round may be shorter than a CPU tick)
    out: dict[str, Any] = {"auth_per_round": {}}
    for f, by_hub in spent.items():
        ratios = [a[0] / b[0] for a, b in zip(by_hub["off"], by_hub["on"], strict=True)]
        out[f"auth_{f}_ratio"] = statistics.median(ratios)
        out["auth_per_round"][f] = ratios
        out[f"auth_{f}_cpu_ratio"] = sum(c for _, c in by_hub["off"]) / max(
            1e-9, sum(c for _, c in by_hub["on"])
        )
    out["zmq_curve_large_echo_ratio"] = _curve_echo_ratio(batch * (seq_len * 12 + 4))
    return out


def _spent(hub: Any, work: Any) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process and the hub's servers) ``work(hub)`` took."""
    pids = [os.getpid(), *(p.pid for p in hub.servers.procs)]
    cpu, t0 = sum(map(_cpu_s, pids)), time.perf_counter()
    work(hub)
    return time.perf_counter() - t0, sum(map(_cpu_s, pids)) - cpu


def _curve_echo_ratio(size: int, n: int = 50, rounds: int = 3) -> float:
    """Seconds per echo of ``size`` bytes over TCP loopback under CURVE over in the clear
    (bare pyzmq, one process; the median of alternating rounds)."""
    ctx = zmq.Context.instance()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    msg = os.urandom(size)

    def echo(curve: bool) -> float:
        server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if curve:
            server.curve_server = True
            server.curve_secretkey, server.curve_publickey = server_secret, server_public
            client.curve_serverkey = server_public
            client.curve_publickey, client.curve_secretkey = client_public, client_secret
        client.connect(f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}")
        try:
            t0 = 0.0
            for i in range(n + 1):
                if i == 1:
                    t0 = time.perf_counter()  # (after the handshake)
                client.send(msg, copy=False)
                server.send_multipart(server.recv_multipart(copy=False), copy=False)
                client.recv(copy=False)
            return (time.perf_counter() - t0) / n
        finally:
            server.close(linger=0)
            client.close(linger=0)

    return statistics.median(echo(True) / echo(False) for _ in range(rounds))


def _read_pass(hub: Any, metas: list[Any]) -> tuple[float, int]:
    """Seconds to read every batch into numpy (get + packed + dense), and a checksum."""
    checksum = 0
    t0 = time.perf_counter()
    for meta in metas:
        b = hub.get(meta)
        ids, _ = b.packed("input_ids")
        lps, _ = b.packed("logprobs")
        reward = b["reward"]
        checksum += int(ids[-1]) + int(lps.size) + int(reward.size)
    return time.perf_counter() - t0, checksum


def claim_latency(live: int, batch: int, rounds: int = 2000) -> tuple[float, float]:
    """p50/p99 ms of claim+ack (FIFO, micro-batch ``batch``) with ``live`` samples live."""
    hub = flowrl.Hub(
        [Column.scalar("x", "int64")],
        tasks={"t": ["x"]},
        config=HubConfig(capacity=live + batch * 2),
    )
    chunk = 4096
    for start in range(0, live, chunk):
        hub.put({"x": np.arange(start, min(live, start + chunk), dtype=np.int64)})
    lat = np.empty(rounds)
    for i in range(rounds):
        t0 = time.perf_counter()
        meta = hub.claim("t", batch, timeout=5)
        lat[i] = time.perf_counter() - t0
        hub.ack(meta)
        hub.put({"x": np.arange(batch, dtype=np.int64)})  # keep the table at ``live``
    hub.close()
    return float(np.percentile(lat, 50) * 1e3), float(np.percentile(lat, 99) * 1e3)


def controller_cells(batch: int, runs: int = 5) -> float:
    """Median of ``runs`` after a warm-up run (a single short run swings ±30% here)."""
    _cells_once(batch)
    return statistics.median(_cells_once(batch) for _ in range(runs))


def _cells_once(batch: int, total: int = 262144) -> float:
    ctl = Controller(capacity=65536)
    names = [c.name for c in COLUMNS]
    ctl.add_columns(tuple(COLUMNS))
    ctl.register_task("train", tuple(names))
    nbytes = np.full(batch, 8, dtype=np.int64)
    cells = {name: Cell(nbytes) for name in names}
    sampler = FifoSampler()
    with ctl.cond:
        t0 = time.perf_counter()
        done = 0
        while done < total:
            idx, _ = ctl.reserve(batch)
            ctl.commit(Commit(indices=idx, cells=cells, new=True))
            meta = ctl.try_claim(Claim(task="train", n=batch), sampler)
            assert meta is not None  # the batch just committed is ready
            ctl.ack("train", meta.lease)
            done += batch
        dt = time.perf_counter() - t0
    # each sample: len(names) readiness cells + 1 consumption cell
    return done * (len(names) + 1) / dt


def zmq_latencies(seq_len: int) -> dict:
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    hub = flowrl.launch_hub(
        [*COLUMNS, Column.scalar("y", "int64")],
        tasks={"train": ["input_ids", "logprobs", "reward"], "other": ["y"]},
        config=HubConfig(capacity=65536, lease_timeout=600.0),
    )
    startup = time.perf_counter() - t0
    try:
        one = payload(1, seq_len, rng)
        hub.put(one)
        hub.ack(hub.claim("train", 1, timeout=10))
        # put -> claimable, consumer blocked in claim in another thread
        lat = []
        got = threading.Event()
        stamp = [0.0]

        def consumer(k: int) -> None:
            for _ in range(k):
                meta = hub.claim("train", 1, timeout=10)
                stamp[0] = time.perf_counter()
                hub.ack(meta)
                got.set()

        rounds = 300
        th = threading.Thread(target=consumer, args=(rounds,))
        th.start()
        for _ in range(rounds):
            time.sleep(0.002)  # let the consumer block first
            got.clear()
            t = time.perf_counter()
            hub.put(one)
            got.wait(10)
            lat.append(stamp[0] - t)
        th.join()
        # single-sample put rate: pipelined (put_async, one flush at the end) and one
        # round trip at a time (put)
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            hub.put_async(one)
        hub.flush()
        single_rate = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n // 2):
            hub.put(one)
        single_sync_rate = n // 2 / (time.perf_counter() - t)
        # metadata round trips: claim + ack of one sample each = 2 round trips; one thread
        # waiting for each answer, then two threads of the client (requests overlap)
        k = 1000

        def claim_ack(m: int) -> None:
            for _ in range(m):
                hub.ack(hub.claim("train", 1, timeout=10))

        t = time.perf_counter()
        claim_ack(k)
        meta_rate = 2 * k / (time.perf_counter() - t)
        with ThreadPoolExecutor(2) as pool:
            t = time.perf_counter()
            for done in [pool.submit(claim_ack, k // 2) for _ in range(2)]:
                done.result()
            meta_rate_2 = 2 * k / (time.perf_counter() - t)
        # put latency without / with another thread blocked in claim, alternating in rounds
        # so that the machine's drift (other tenants) falls on both alike
        big = payload(32, seq_len, rng)

        def put_lat(m: int) -> list[float]:
            ts = []
            for _ in range(m):
                t = time.perf_counter()
                hub.put(big)
                ts.append(time.perf_counter() - t)
                hub.ack(hub.claim("train", 32, timeout=10))
            return ts

        def blocked(stop: threading.Event) -> None:
            while not stop.is_set():
                with contextlib.suppress(flowrl.errors.Timeout):
                    hub.claim("other", 1, timeout=0.2)

        alone: list[float] = []
        beside: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            for _ in range(5):
                alone += put_lat(40)
                stop = threading.Event()
                waiter = pool.submit(blocked, stop)
                time.sleep(0.02)  # let it block in claim
                beside += put_lat(40)
                stop.set()
                waiter.result()
        return {
            "startup_s": startup,
            "put_to_claimable_p50_ms": float(np.percentile(lat, 50) * 1e3),
            "put_to_claimable_p99_ms": float(np.percentile(lat, 99) * 1e3),
            "single_sample_puts_per_s": single_rate,
            "single_sample_sync_puts_per_s": single_sync_rate,
            "metadata_round_trips_per_s": meta_rate,
            "metadata_round_trips_per_s_2_threads": meta_rate_2,
            "blocked_claim_put_latency_ratio": float(np.median(beside) / np.median(alone)),
        }
    finally:
        hub.close()


#: Network legs of a stage round: claim 2, get 2, put with ack 3 (unit hands the commit on).
STAGE_ROUND_LEGS = 7
#: The ``prefetch`` of the deeper pipelined stage rounds (``stage_rounds_prefetch<k>_*``).
STAGE_PREFETCH = (8, 32)
#: Each key of the pipelined stage rounds and its depth.
PIPELINED = {"pipelined": 1} | {f"prefetch{k}": k for k in STAGE_PREFETCH}


def stage_rounds(rounds: int = 2000) -> dict:
    """Stage rounds (claim, get, put with ack) per second over zmq, one at a time."""
    hub = flowrl.launch_hub(
        [Column.scalar("x", "int64"), Column.scalar("y", "float32")],
        tasks={"stage": ["x"], "sink": ["y"]},
        config=HubConfig(capacity=(2 + len(PIPELINED)) * rounds + 1024, lease_timeout=600.0),
    )
    try:
        hub.put({"x": np.arange((1 + len(PIPELINED)) * rounds + 201, dtype=np.int64)})
        out = np.ones(1, dtype=np.float32)

        def one_round() -> None:
            meta = hub.claim("stage", 1, timeout=10)
            hub.get(meta, ["x"])
            hub.put({"y": out}, indices=meta, ack=meta)

        for _ in range(200):  # connections, code paths
            one_round()
        pids = [proc.pid for proc in hub.servers.procs]
        cpu0 = time.process_time() + sum(_cpu_s(pid) for pid in pids)
        times = np.empty(rounds)
        for i in range(rounds):
            t0 = time.perf_counter()
            one_round()
            times[i] = time.perf_counter() - t0
        cpu = time.process_time() + sum(_cpu_s(pid) for pid in pids) - cpu0
        result = {
            "stage_rounds_per_s": rounds / times.sum(),
            "stage_round_p50_ms": float(np.median(times) * 1e3),
            "stage_round_cpu_ms": cpu / rounds * 1e3,
        }
        for key, depth in PIPELINED.items():
            result[f"stage_rounds_{key}_per_s"] = rounds / _pipelined_rounds(hub, rounds, depth)
        return result
    finally:
        hub.close()


def _pipelined_rounds(hub: Any, rounds: int, depth: int) -> float:
    """Seconds for ``rounds`` stage rounds run as a stage worker over processes runs them
    with ``prefetch=depth``: a thread claims (in one request) and reads up to ``depth``
    rounds' inputs ahead while outputs go out with put_async, ``depth`` in flight."""
    out = np.ones(1, dtype=np.float32)
    ahead = Prefetcher(
        hub, lambda room: hub.claim_batches("stage", 1, room, timeout=10), depth, hub.ack
    )
    sent: collections.deque[Any] = collections.deque()
    t0 = time.perf_counter()
    try:
        for _ in range(rounds):
            meta, _ = ahead.take()
            if len(sent) == depth:
                sent.popleft().result()
            sent.append(hub.put_async({"y": out}, indices=meta, ack=meta))
        for fut in sent:
            fut.result()
        return time.perf_counter() - t0
    finally:
        ahead.close()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_figures() -> dict:
    """The machine's own speed (see ``machine`` in the module doc): best of three each."""
    loop, copy, fresh = [], [], []
    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        loop.append(1.0 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy.append(src.nbytes / (time.perf_counter() - t0) / GIB)
        if os.path.isdir("/dev/shm"):
            fresh.append(src.nbytes / _fresh_shm_seconds(src.nbytes) / GIB)
    return {
        "python_loop_mops": max(loop),
        "memcpy_gib_per_s": max(copy),
        "fresh_shm_gib_per_s": max(fresh) if fresh else None,
    }


def _fresh_shm_seconds(size: int) -> float:
    """A new segment made as a storage unit makes one (``_Segment``), every page touched."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="flowrl-bench-") as folder:
        t0 = time.perf_counter()
        seg = _Segment(os.path.join(folder, "segment"), size)
        seg.map[::4096] = bytes(size // 4096)  # (mapped already where MAP_POPULATE exists)
        spent = time.perf_counter() - t0
        seg.discard()
    return spent


def zmq_floor(seq_len: int) -> dict:
    """Bare pyzmq between two processes: what any request over the hub's sockets costs."""
    with tempfile.TemporaryDirectory(prefix="flowrl-floor-") as folder:
        address = f"ipc://{folder}/echo"
        server = multiprocessing.get_context("spawn").Process(target=_echo, args=(address,))
        server.start()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a server that failed to start: zmq.Again
        sock.connect(address)
        try:
            small = bytes(64)
            for _ in range(200):  # connect, warm up
                sock.send(small)
                sock.recv()
            k = 3000
            t0 = time.perf_counter()
            for _ in range(k):
                sock.send(small)
                sock.recv()
            echo_rate = k / (time.perf_counter() - t0)
            one_put = bytearray(seq_len * 12 + 4)  # a sample's payload bytes
            one_way = []
            for _ in range(300):
                time.sleep(0.002)
                sent = time.monotonic_ns()  # CLOCK_MONOTONIC: shared by the processes
                sock.send(one_put)
                one_way.append(int.from_bytes(sock.recv(), "little") - sent)
            sock.send(b"")  # stop
            server.join(10)
        finally:
            sock.close()
            ctx.term()
            if server.is_alive():
                server.kill()
    return {
        "zmq_echo_round_trips_per_s": echo_rate,
        "zmq_one_way_after_pause_ms": float(np.median(one_way[50:]) / 1e6),
    }


def _echo(address: str) -> None:
    """Answer each request with the time it arrived (an empty request stops)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        ident, body = sock.recv_multipart()
        arrived = time.monotonic_ns()
        sock.send_multipart([ident, arrived.to_bytes(8, "little")])
        if not body:
            break
    sock.close(linger=1000)
    ctx.term()


#: The calls --peer times one by one (benchmarks/_transferqueue_peer.py, ``<call>_s``).
PEER_CALLS = ("put", "get_meta", "get_data", "kv_batch_put", "kv_batch_get")

PEER_CLIENTS = {
    "transferqueue": ["--client", "transferqueue"],
    "inproc": ["--client", "compat", "--placement", "inproc"],
    "zmq": ["--client", "compat", "--placement", "zmq"],
    "native": ["--client", "native"],
}
#: What the native client's calls are compared with: its put with TransferQueue's put,
#: its consumer loop (a Loader claiming ahead; by hand: claim + get + ack) with
#: TransferQueue's (get_meta + get_data).
NATIVE_CALLS = {"put": ("put_s", "put_s"), "batched_put": ("put_s", "batched_put_s"),
                "consume": ("get_s", "get_s"), "consume_loop": ("get_s", "loop_s")}  # fmt: skip


def peer_rounds(samples: int, seq_len: int, batch: int, rounds: int, busy: int = 0) -> dict:
    """TransferQueue and the compat client (per placement) in alternating rounds, after
    one round of each that is not counted (a warm-up).

    Each client runs in its own process (``_transferqueue_peer.py --serve``: each starts
    its own servers, once); round r runs one measured round of every client, in an order
    rotated each round, so all meet the same machine load. Returns ``peer`` (TransferQueue)
    and ``compat`` (per placement) with each client's median figures; the compat entries
    add the median over rounds of TransferQueue's put + get seconds over theirs, in the
    same round (``put_get_speedup_vs_transferqueue``), and of the put and get ratios apart.
    """
    script = str(Path(__file__).with_name("_transferqueue_peer.py"))
    sizes = ["--samples", str(samples), "--seq-len", str(seq_len), "--batch", str(batch)]
    procs: dict[str, subprocess.Popen] = {}
    info: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {name: [] for name in PEER_CLIENTS}
    try:
        for name, args in PEER_CLIENTS.items():  # one start-up at a time (Ray's is heavy)
            procs[name] = subprocess.Popen(
                [sys.executable, script, *args, *sizes, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            info[name] = _peer_line(procs[name])
        live = [name for name in procs if "error" not in info[name]]
        with busy_processes(busy):
            # Round 0 warms every client up and is not counted: each system's first round
            # also pays for first-time allocations (a storage unit's shared memory, Ray's
            # object store, lazily built code paths) that a running job paid long before.
            for r in range(rounds + 1):
                for name in live[r % len(live) :] + live[: r % len(live)]:
                    procs[name].stdin.write("round\n")  # type: ignore[union-attr]
                    procs[name].stdin.flush()  # type: ignore[union-attr]
                    line = _peer_line(procs[name])
                    if r:
                        runs[name].append(line)
    finally:
        for proc in procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
        for proc in procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    tq = {**info["transferqueue"], **_medians(runs["transferqueue"])}
    compat: dict = {}
    for placement in ("inproc", "zmq"):
        got = compat[placement] = {**info[placement], **_medians(runs[placement])}
        pairs = list(zip(runs["transferqueue"], runs[placement], strict=False))
        if pairs:
            ratios = [(t["put_s"] + t["get_s"]) / (c["put_s"] + c["get_s"]) for t, c in pairs]
            got["put_get_speedup_vs_transferqueue"] = statistics.median(ratios)
            got["put_get_speedup_per_round"] = ratios
            got["get_speedup_vs_transferqueue"] = statistics.median(
                t["get_s"] / c["get_s"] for t, c in pairs
            )
            for call in PEER_CALLS:  # each call apart: the median and the lowest round
                per_round = [t[f"{call}_s"] / c[f"{call}_s"] for t, c in pairs]
                got[f"{call}_speedup_vs_transferqueue"] = statistics.median(per_round)
                got[f"{call}_speedup_lowest_round"] = min(per_round)
                got[f"{call}_speedup_per_round"] = per_round
    native = {**info["native"], **_medians(runs["native"])}
    pairs = list(zip(runs["transferqueue"], runs["native"], strict=False))
    for call, (tq_key, key) in NATIVE_CALLS.items():  # the median and the lowest round
        if pairs:
            per_round = [t[tq_key] / c[key] for t, c in pairs]
            native[f"{call}_speedup_vs_transferqueue"] = statistics.median(per_round)
            native[f"{call}_speedup_lowest_round"] = min(per_round)
            native[f"{call}_speedup_per_round"] = per_round
    return {"peer": tq, "compat": compat, "native": native, "busy_processes": busy}


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes spinning on the CPU while the block runs (the load other jobs put
    on a shared machine, the same for every client of the alternating rounds)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def _spin() -> None:
    while True:
        pass


def _peer_line(proc: subprocess.Popen) -> dict:
    """The next JSON line of a peer process, or its error."""
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        err = proc.stderr.read().strip().splitlines()  # type: ignore[union-attr]
        return {"error": err[-1:] or [f"exited with {proc.wait()}"]}
    return json.loads(line)


def _medians(rounds: list[dict]) -> dict:
    if not rounds or any("error" in r for r in rounds):
        return {"rounds": rounds}
    keys = [k for k in rounds[0] if isinstance(rounds[0][k], int | float)]
    return {"rounds": len(rounds), **{k: statistics.median(r[k] for r in rounds) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--transport", choices=["inproc", "zmq"], default="inproc")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--peer", action="store_true", help="also run TransferQueue (needs .[peer])")
    ap.add_argument("--peer-rounds", type=int, default=5, help="alternating --peer rounds")
    ap.add_argument(
        "--auth-rounds", type=int, default=0, help="zmq: rounds with and without the hub key"
    )
    ap.add_argument(
        "--busy", type=int, default=0, help="CPU-bound processes to run during --peer rounds"
    )
    args = ap.parse_args()
    result: dict = {
        "transport": args.transport,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "batch": args.batch,
    }
    result["machine"] = machine_figures()
    result.update(put_get(args.transport, args.samples, args.seq_len, args.batch))
    result.update(put_stream(args.transport, args.samples, args.seq_len, args.batch))
    p50, p99 = claim_latency(100_000, args.batch)
    result["claim_p50_ms"], result["claim_p99_ms"] = p50, p99
    result["claim_p99_ms_1k"] = claim_latency(1_000, args.batch)[1]
    result["claim_p99_ms_131k"] = claim_latency(131_072, args.batch)[1]
    result["controller_cell_updates_per_s"] = controller_cells(args.batch)
    if args.transport == "zmq":
        result.update(zmq_latencies(args.seq_len))
        result.update(stage_rounds(rounds=min(2000, max(200, args.samples // 2))))
        result.update(zmq_floor(args.seq_len))
        ratio = result["stage_rounds_per_s"] / result["zmq_echo_round_trips_per_s"]
        result["stage_round_vs_echo"] = ratio
        result["stage_round_legs_vs_echo"] = ratio * STAGE_ROUND_LEGS / 2
        if args.auth_rounds:
            result.update(auth_rounds(args.samples, args.seq_len, args.batch, args.auth_rounds))
        for key in PIPELINED:
            result[f"stage_round_{key}_vs_echo"] = (
                result[f"stage_rounds_{key}_per_s"] / result["zmq_echo_round_trips_per_s"]
            )
    if args.peer:
        result.update(
            peer_rounds(args.samples, args.seq_len, args.batch, args.peer_rounds, args.busy)
        )
        tq = result["peer"]
        if "put_samples_per_s" in tq:
            tq_rate = 1 / (1 / tq["put_samples_per_s"] + 1 / tq["get_samples_per_s"])
            result["put_get_speedup_vs_transferqueue"] = result["put_get_samples_per_s"] / tq_rate
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:40s} {v}")


if __name__ == "__main__":
    main()

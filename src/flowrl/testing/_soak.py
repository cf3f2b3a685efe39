"""A bounded soak of a multi-process hub with exact accounting (``flowrl.testing.run_soak``).

The scenario: a hub over zmq (launched here, or one you point it at), ``clients`` client
connections — each its own ``flowrl.connect`` client in its own thread, spread over
``processes`` worker processes — of which some are producers and the rest consumers of
two tasks. Every client connects before the clock starts, so all of them are connected at
once. Producers put small batches for ``seconds``; then the stream is ended and consumers
drain it until ``EndOfStream``.

Every sample carries its identity (``key``: producer and sequence number) and data derived
from it, so consumers check what they read. A key counts as consumed by a task only once
its ack returned. The report then compares, per task, the multiset of keys consumed with
the keys produced: ``lost`` and ``duplicated`` must be 0, and so must ``corrupt`` (data that
does not match its key).

No call may vanish: every call returns, or raises a typed ``FlowRLError`` that is counted
by type and handled (a claim or put that timed out is retried; an ack of an expired lease
leaves the samples to be delivered again). A raised exception that is not a
``FlowRLError`` is counted as ``untyped``; a call still in flight when the drain deadline
passes is reported in ``stuck``. A put or ack that fails with a ``TransportError`` has an
unknown outcome: it is counted in ``ambiguous`` (a put is retried with the same keys, so a
put that did land shows up as duplicated rather than being hidden).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, final

import msgspec
import numpy as np

from flowrl._config import HubConfig
from flowrl._schema.columns import Column
from flowrl._validate import is_int
from flowrl.errors import (
    ConfigError,
    EndOfStream,
    FlowRLError,
    LeaseError,
    Timeout,
    TransportError,
    WouldBlock,
)

__all__ = ["SoakConfig", "SoakReport", "account", "run_soak"]

COLUMNS = [
    Column.scalar("key", "int64"),
    Column.ragged("ids", "int64"),
    Column.scalar("reward", "float32"),
]
TASKS = {"train": ["key", "ids", "reward"], "score": ["key", "ids"]}
_SEQ_BITS = 32
_CONNECT_BUDGET_S = 60.0


@final
class SoakConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What to run. ``seconds`` of production, then a drain of at most ``drain_seconds``.

    ``clients``: client connections in all (at least 2); ``producers``: how many of them
    put (the rest consume, alternating between the two tasks); ``processes``: worker
    processes the clients are spread over (0: threads of this process). ``address``: an
    existing hub to soak (it must have been launched with ``SOAK_COLUMNS`` and
    ``SOAK_TASKS``); empty: launch one with ``hub_config``.
    """

    seconds: float = 20.0
    clients: int = 64
    producers: int = 16
    processes: int = 2
    batch: int = 8
    claim_timeout: float = 0.5
    put_timeout: float = 2.0
    drain_seconds: float = 60.0
    seed: int = 0
    address: str = ""
    hub_config: HubConfig = HubConfig(capacity=4096, n_units=2, lease_timeout=30.0)

    def __post_init__(self) -> None:
        for name in ("seconds", "claim_timeout", "put_timeout", "drain_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"SoakConfig.{name} must be a positive number, got {value!r}")
        for name, low in (("clients", 2), ("producers", 1), ("processes", 0), ("batch", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ConfigError(f"SoakConfig.{name} must be an int >= {low}, got {value!r}")
        if self.producers >= self.clients:
            raise ConfigError(
                f"SoakConfig.producers ({self.producers}) must leave consumers among the "
                f"{self.clients} clients"
            )
        if not isinstance(self.address, str):
            raise ConfigError(f"SoakConfig.address must be a str, got {self.address!r}")


@final
class SoakReport(msgspec.Struct, frozen=True, kw_only=True):
    """What happened. ``ok`` is True when nothing was lost, duplicated, corrupt, untyped,
    stuck or ambiguous and the hub ended empty."""

    seconds: float  # production time
    drain_seconds: float
    clients: int
    connected: int  # clients connected at the same time when production started
    processes: int
    producers: int
    produced: int
    consumed: dict[str, int]
    lost: dict[str, int]
    duplicated: dict[str, int]
    corrupt: int
    untyped: int
    untyped_examples: list[str]
    stuck: list[str]
    ambiguous: int
    errors: dict[str, int]  # typed errors by class name, all handled
    calls: dict[str, int]
    samples_per_s: float  # produced samples per second of production
    latency_ms: dict[str, dict[str, float]]  # per call kind and "all": p50, p99, max
    hub_live: int
    hub_leases: int
    hub_reserved: int

    @property
    def ok(self) -> bool:
        return (
            self.produced > 0
            and not any(self.lost.values())
            and not any(self.duplicated.values())
            and all(n == self.produced for n in self.consumed.values())
            and self.corrupt == 0
            and self.untyped == 0
            and not self.stuck
            and self.ambiguous == 0
            and self.hub_live == 0
            and self.hub_leases == 0
            and self.hub_reserved == 0
        )


SOAK_COLUMNS = COLUMNS
SOAK_TASKS = TASKS


def account(produced: Iterable[int], consumed: Iterable[int]) -> tuple[int, int]:
    """(lost, duplicated) of one task, over multisets of sample keys: ``lost`` counts
    samples produced and never consumed, ``duplicated`` deliveries beyond what was
    produced (a key consumed twice, or a key nobody produced)."""
    made = collections.Counter(produced)
    got = collections.Counter(consumed)
    lost = sum(max(0, n - got[key]) for key, n in made.items())
    duplicated = sum(max(0, n - made[key]) for key, n in got.items())
    return lost, duplicated


def key_of(producer: int, seq: int) -> int:
    return (producer << _SEQ_BITS) | seq


def sample_data(keys: list[int]) -> dict[str, Any]:
    """The columns of samples with these keys (what a consumer checks it got)."""
    return {
        "key": np.array(keys, dtype=np.int64),
        "ids": [np.arange(1 + key % 7, dtype=np.int64) + key for key in keys],
        "reward": np.array([key % 1000 for key in keys], dtype=np.float32),
    }


# -- one client ----------------------------------------------------------------------------
class _Client:
    """One connection and its own tallies; ``call`` times and classifies every call."""

    def __init__(self, address: str) -> None:
        from flowrl._launch.processes import connect

        self.hub = connect(address)
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.errors: collections.Counter[str] = collections.Counter()
        self.untyped: list[str] = []
        self.in_flight: tuple[str, float] | None = None

    def call(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.in_flight = (kind, time.monotonic())
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except FlowRLError as exc:
            self.errors[type(exc).__name__] += 1
            raise
        except Exception as exc:
            self.untyped.append(f"{kind}: {type(exc).__name__}: {exc}")
            raise
        finally:
            self.latency[kind].append((time.perf_counter() - start) * 1000.0)
            self.in_flight = None


class _Tally:
    """What one worker's clients did (merged over workers by the coordinator)."""

    def __init__(self) -> None:
        self.produced: list[int] = []
        self.consumed: dict[str, list[int]] = {t: [] for t in TASKS}
        self.corrupt = 0
        self.ambiguous = 0
        self.lock = threading.Lock()


def _produce(
    client: _Client, producer: int, stop_at: float, cfg: SoakConfig, tally: _Tally
) -> None:
    rng = random.Random(cfg.seed * 7919 + producer)
    seq = 0
    while time.time() < stop_at:
        size = rng.randint(1, cfg.batch)
        keys = [key_of(producer, seq + i) for i in range(size)]
        data = sample_data(keys)
        while True:  # retry the same keys until the put is known to have happened
            try:
                client.call("put", client.hub.put, data, timeout=cfg.put_timeout)
                break
            except (Timeout, WouldBlock):
                continue  # no room yet: nothing was reserved, retry
            except TransportError:
                with tally.lock:
                    tally.ambiguous += 1  # unknown outcome: retrying may duplicate
                continue
            except FlowRLError:
                if time.time() > stop_at + cfg.drain_seconds:
                    return
                continue
        with tally.lock:
            tally.produced.extend(keys)
        seq += size


def _consume(client: _Client, task: str, stop_at: float, cfg: SoakConfig, tally: _Tally) -> None:
    hub = client.hub
    while time.time() < stop_at:
        try:
            meta = client.call(
                "claim", hub.claim, task, cfg.batch, min_n=1, timeout=cfg.claim_timeout
            )
        except EndOfStream:
            return
        except FlowRLError:
            continue  # Timeout (nothing ready yet) or a transient error: claim again
        try:
            batch = client.call("get", hub.get, meta)
        except FlowRLError:
            _give_back(client, meta)
            continue
        keys = batch.numpy("key").tolist()
        bad = _check(batch, keys)
        if bad:
            with tally.lock:
                tally.corrupt += bad
        try:
            client.call("ack", hub.ack, meta)
        except LeaseError:
            continue  # expired meanwhile: the samples are delivered again, not consumed
        except TransportError:
            with tally.lock:
                tally.ambiguous += 1
            continue
        except FlowRLError:
            continue
        with tally.lock:
            tally.consumed[task].extend(keys)


def _give_back(client: _Client, meta: Any) -> None:
    with contextlib.suppress(FlowRLError):  # if refused, the lease expires on its own
        client.call("release", client.hub.release, meta)


def _check(batch: Any, keys: list[int]) -> int:
    """How many samples of the batch hold data that does not match their key."""
    ids = batch["ids"]
    rewards = batch.numpy("reward").tolist() if "reward" in batch else None
    bad = 0
    for pos, key in enumerate(keys):
        seq = ids[pos]
        ok = seq.size == 1 + key % 7 and (seq.size == 0 or int(seq[0]) == key)
        if rewards is not None and rewards[pos] != float(np.float32(key % 1000)):
            ok = False
        bad += not ok
    return bad


# -- one worker (a process, or the coordinator's own threads) ----------------------------------
def _worker(
    address: str,
    roles: list[tuple[str, int]],
    start: Any,
    cfg_json: bytes,
    post: Callable[[tuple[Any, ...]], None],
) -> None:
    """Run ``roles`` (("produce", producer id) or ("consume", task id)) as client threads.

    Connects every client, posts ("connected", n), waits for ``start`` (an Event set once
    every worker connected), runs; posts ("producers_done",) then ("result", dict).
    """
    cfg = msgspec.json.decode(cfg_json, type=SoakConfig)
    clients = [_Client(address) for _ in roles]
    post(("connected", len(clients)))
    tally = _Tally()
    if not start.wait(_CONNECT_BUDGET_S):
        post(("result", _result(clients, tally)))
        return
    stop_at = time.time() + cfg.seconds
    producers: list[threading.Thread] = []
    consumers: list[threading.Thread] = []
    for client, (role, ident) in zip(clients, roles, strict=True):
        if role == "produce":
            args: tuple[Any, ...] = (client, ident, stop_at, cfg, tally)
            thread = threading.Thread(target=_produce, args=args, daemon=True)
            producers.append(thread)
        else:
            task = list(TASKS)[ident % len(TASKS)]
            args = (client, task, stop_at + cfg.drain_seconds, cfg, tally)
            thread = threading.Thread(target=_consume, args=args, daemon=True)
            consumers.append(thread)
        thread.start()
    hard_stop = stop_at + cfg.drain_seconds + 5.0
    for thread in producers:
        thread.join(max(0.0, hard_stop - time.time()))
    post(("producers_done",))
    for thread in consumers:
        thread.join(max(0.0, hard_stop - time.time()))
    result = _result(clients, tally)
    for client in clients:
        if client.in_flight is None:
            client.hub.close()
    post(("result", result))


def _result(clients: list[_Client], tally: _Tally) -> dict[str, Any]:
    stuck = [
        f"{flight[0]} in flight for {time.monotonic() - flight[1]:.1f}s"
        for flight in (client.in_flight for client in clients)
        if flight is not None
    ]
    latency: dict[str, list[float]] = collections.defaultdict(list)
    errors: collections.Counter[str] = collections.Counter()
    untyped: list[str] = []
    calls: collections.Counter[str] = collections.Counter()
    for client in clients:
        for kind, values in client.latency.items():
            latency[kind].extend(values)
            calls[kind] += len(values)
        errors.update(client.errors)
        untyped.extend(client.untyped)
    with tally.lock:
        return {
            "produced": list(tally.produced),
            "consumed": {t: list(k) for t, k in tally.consumed.items()},
            "corrupt": tally.corrupt,
            "ambiguous": tally.ambiguous,
            "stuck": stuck,
            "latency": dict(latency),
            "errors": dict(errors),
            "untyped": untyped,
            "calls": dict(calls),
        }


def _process_main(address: str, roles: Any, start: Any, cfg_json: bytes, inbox: Any) -> None:
    _worker(address, roles, start, cfg_json, inbox.put)


# -- the coordinator -------------------------------------------------------------------------
def run_soak(config: SoakConfig | None = None) -> SoakReport:
    """Run the soak scenario described in this module's docstring; returns the report."""
    from flowrl._launch.processes import connect, launch_hub

    cfg = config or SoakConfig()
    if not isinstance(cfg, SoakConfig):
        raise ConfigError(f"run_soak() expects a SoakConfig, got {type(cfg).__name__}")
    owner = None
    if cfg.address:
        control = connect(cfg.address)
    else:
        tasks: dict[str, Sequence[str]] = dict(TASKS)
        owner = control = launch_hub(COLUMNS, tasks=tasks, config=cfg.hub_config)
    try:
        return _coordinate(cfg, control)
    finally:
        (owner or control).close()


def _coordinate(cfg: SoakConfig, control: Any) -> SoakReport:
    address = control.address
    roles: list[tuple[str, int]] = [("produce", p) for p in range(cfg.producers)]
    roles += [("consume", c) for c in range(cfg.clients - cfg.producers)]
    random.Random(cfg.seed).shuffle(roles)
    n_workers = max(1, cfg.processes)
    shares = [roles[w::n_workers] for w in range(n_workers)]
    cfg_json = msgspec.json.encode(cfg)
    inbox: Any
    start: Any
    workers: list[Any] = []
    if cfg.processes:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded process
        inbox, start = ctx.Queue(), ctx.Event()
        for share in shares:
            proc = ctx.Process(
                target=_process_main, args=(address, share, start, cfg_json, inbox), daemon=True
            )
            proc.start()
            workers.append(proc)
    else:
        inbox, start = queue.Queue(), threading.Event()
        for share in shares:
            thread = threading.Thread(
                target=_worker, args=(address, share, start, cfg_json, inbox.put), daemon=True
            )
            thread.start()
            workers.append(thread)
    # Every client connects first; the clock starts once all of them are connected.
    connected = reporting = 0
    give_up = time.time() + _CONNECT_BUDGET_S
    while reporting < n_workers and time.time() < give_up:
        try:
            msg = inbox.get(timeout=0.5)
        except queue.Empty:
            if not any(_alive(w) for w in workers):
                break
            continue
        connected += msg[1]
        reporting += 1
    start.set()
    stop_at = time.time() + cfg.seconds
    done = 0
    results: list[dict[str, Any]] = []
    ended = False
    give_up = stop_at + cfg.drain_seconds + 30.0
    while len(results) < n_workers:
        try:
            msg = inbox.get(timeout=max(0.1, min(1.0, give_up - time.time())))
        except queue.Empty:
            if time.time() > give_up or not any(_alive(w) for w in workers):
                break
            continue
        if msg[0] == "producers_done":
            done += 1
            if done == n_workers and not ended:
                control.end_stream()  # every producer returned: nothing more will be put
                ended = True
        else:
            results.append(msg[1])
    drain_started = max(stop_at, time.time())
    for w in workers:
        w.join(timeout=5)
    stats = control.statistics()
    return _report(cfg, results, connected, n_workers, stats, time.time() - drain_started)


def _alive(worker: Any) -> bool:
    return bool(worker.is_alive())


def _report(
    cfg: SoakConfig,
    results: list[dict[str, Any]],
    connected: int,
    n_workers: int,
    stats: Any,
    drain: float,
) -> SoakReport:
    produced: list[int] = []
    consumed: dict[str, list[int]] = {t: [] for t in TASKS}
    latency: dict[str, list[float]] = collections.defaultdict(list)
    errors: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    untyped: list[str] = []
    stuck: list[str] = []
    corrupt = ambiguous = 0
    for r in results:
        produced.extend(r["produced"])
        for task, keys in r["consumed"].items():
            consumed[task].extend(keys)
        for kind, values in r["latency"].items():
            latency[kind].extend(values)
        errors.update(r["errors"])
        calls.update(r["calls"])
        untyped.extend(r["untyped"])
        stuck.extend(r["stuck"])
        corrupt += r["corrupt"]
        ambiguous += r["ambiguous"]
    missing = n_workers - len(results)
    if missing:
        stuck.append(f"{missing} worker(s) never reported")
    lost, duplicated = {}, {}
    for task in TASKS:
        lost[task], duplicated[task] = account(produced, consumed[task])
    everything = [v for values in latency.values() for v in values]
    latency["all"] = everything
    return SoakReport(
        seconds=cfg.seconds,
        drain_seconds=round(drain, 3),
        clients=cfg.clients,
        connected=connected,
        processes=cfg.processes,
        producers=cfg.producers,
        produced=len(produced),
        consumed={t: len(k) for t, k in consumed.items()},
        lost=lost,
        duplicated=duplicated,
        corrupt=corrupt,
        untyped=len(untyped),
        untyped_examples=untyped[:5],
        stuck=stuck,
        ambiguous=ambiguous,
        errors=dict(errors),
        calls=dict(calls),
        samples_per_s=round(len(produced) / cfg.seconds, 1),
        latency_ms={k: _percentiles(v) for k, v in latency.items() if v},
        hub_live=stats.live,
        hub_leases=stats.leases,
        hub_reserved=stats.reserved,
    )


def _percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p99": round(float(np.percentile(arr, 99)), 3),
        "max": round(float(arr.max()), 3),
    }

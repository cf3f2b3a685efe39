"""Peer side of the data hub benchmark: put+get throughput of a TransferQueue client.

Two clients run the same driver: TransferQueue itself (``--client transferqueue``;
``pip install transferqueue``, import name ``transfer_queue``), the data hub of the paper
we compare against, and flowrl's TransferQueue-compatible client (``--client compat``,
``flowrl.compat.transfer_queue``, ``--placement inproc`` for the embedded hub or ``zmq``
for controller and storage unit in other processes, as TransferQueue's actors are).

Payload per sample: ``input_ids`` int64[seq_len], ``logprobs`` float32[seq_len]
and a float32 scalar ``reward``; throughput in GiB/s counts exactly those bytes
(``samples * (seq_len * 8 + seq_len * 4 + 4)``), not the clients' own framing or metadata.

Protocol, through each client's public synchronous API (``tq.get_client()``):

* startup (``startup_s``): for TransferQueue, ``ray.init(num_cpus=2,
  include_dashboard=False)`` on 127.0.0.1, then ``transfer_queue.init()`` with the default
  ``SimpleStorage`` backend (one ``TransferQueueController`` actor plus ``storage_units``
  ``SimpleStorageUnit`` actors, each a separate process serving ZMQ over TCP loopback;
  ``ray.init`` is tried up to 3 times: its node start-up times out on a loaded machine);
  for the compat client, ``tq.init()`` in the placement asked for;
* warm-up: one batch put, fetched and cleared in a scratch partition, so
  socket connects and first-call imports are not timed;
* a round: one producer calls ``client.put(TensorDict, partition_id=...)`` once per batch
  of ``batch`` samples; then one consumer task (``task_name="consumer"``) loops
  ``client.get_meta(fields, batch_size=batch, mode="fetch")`` + ``client.get_data(meta)``
  until every sample has been consumed; the partition is cleared. Then the KV API on the
  same batches: ``kv_batch_put(keys, partition_id, fields)`` per batch (new keys), then
  ``kv_batch_get(keys, partition_id)`` per batch, then ``kv_clear`` of every key.
  Each call is timed on its own: ``put_s``, ``get_meta_s``, ``get_data_s`` (``get_s`` is
  their sum), ``kv_batch_put_s``, ``kv_batch_get_s`` are the seconds all calls of that
  kind took in the round; ``<call>_samples_per_s`` the samples they moved per second.
  After each phase's clear the driver pauses 0.5 s, untimed, for both clients: the
  servers' freeing of what was cleared is not charged to the next phase.

Every sample read back is checked against what was put (outside the timed
regions).  Nothing is ever estimated: if a client cannot be imported or
started, this raises :class:`RuntimeError` saying why.

``--serve`` keeps the client started and runs one round per ``round`` line read on stdin,
printing one JSON line per round (after a first line with the start-up figures):
``hub_throughput.py --peer`` alternates rounds of TransferQueue and of the compat client
this way, so both meet the same machine load, and start-up is paid once.

Standalone::

    python benchmarks/_transferqueue_peer.py --samples 4096 --seq-len 1024 --batch 32
    python benchmarks/_transferqueue_peer.py --client compat --placement zmq
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "NativePeer",
    "Peer",
    "payload_bytes",
    "run_transferqueue",
    "start_compat",
    "start_native",
    "start_transferqueue",
]

_FIELDS = ("input_ids", "logprobs", "reward")
_PARTITION = "flowrl_bench"
_WARMUP_PARTITION = "flowrl_bench_warmup"
_CONSUMER_TASK = "consumer"
_GIB = float(1 << 30)
_RAY_ATTEMPTS = 3
# Untimed pause after each phase's clear: what a clear leaves to do in the background (the
# servers freeing memory) is not charged to the next phase's calls.
_SETTLE_S = 0.5
_INSTALL_HINT = (
    "install it with `pip install -c constraints.txt transferqueue==0.1.11` where "
    "constraints.txt holds `torch==2.13.0` (it pulls ray[default] and tensordict; the "
    "constraint stops pip from replacing the pinned torch)"
)


def payload_bytes(samples: int, seq_len: int) -> int:
    """Bytes of payload for ``samples`` samples: int64 ids + float32 logprobs + float32 reward."""
    return samples * (seq_len * 8 + seq_len * 4 + 4)


def _import_transferqueue() -> tuple[Any, Any, Any, Any]:
    """Import ray, torch, tensordict and transfer_queue, or raise a RuntimeError saying why."""
    # TransferQueue reads TQ_NUM_THREADS at import time and clamps it to the number of physical
    # cores, warning on every put/get when the default (8) exceeds it.  Pre-set the value it would
    # clamp to: identical behaviour, no log spam.  Set before ray.init so actors inherit it too.
    cores = os.cpu_count() or 1
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or cores
    except ImportError:
        pass
    os.environ.setdefault("TQ_NUM_THREADS", str(max(1, cores)))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
        import torch
        import transfer_queue
        from tensordict import TensorDict
    except ImportError as e:
        raise RuntimeError(
            f"TransferQueue peer unavailable: cannot import {e.name or e} ({e}); {_INSTALL_HINT}"
        ) from e
    return ray, torch, TensorDict, transfer_queue


def _make_payload(torch: Any, samples: int, seq_len: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1234)
    return {
        "input_ids": torch.randint(
            0, 151_936, (samples, seq_len), dtype=torch.int64, generator=gen
        ),
        "logprobs": -torch.rand((samples, seq_len), dtype=torch.float32, generator=gen) * 10.0,
        "reward": torch.rand((samples,), dtype=torch.float32, generator=gen),
    }


def _cat(torch: Any, parts: list[Any]) -> dict[str, Any]:
    """The fields of several ``get`` results, rows concatenated in order."""
    return {
        f: torch.cat([_field_rows(torch, p[f], p.batch_size[0]) for p in parts]) for f in _FIELDS
    }


def _field_rows(torch: Any, value: Any, n: int) -> Any:
    """Per-sample rows of a field returned by ``get_data``, as one dense [n, ...] tensor.

    TransferQueue returns variable-length fields as jagged nested tensors; with equal lengths
    their packed ``values()`` reshape to the dense batch without a copy.
    """
    if getattr(value, "is_nested", False):
        return value.values().reshape(n, -1)
    return value


class Peer:
    """A started client (and its module, for the KV API) with the benchmark payload,
    ready to run measured rounds."""

    def __init__(
        self, tq: Any, client: Any, torch: Any, samples: int, seq_len: int, batch: int
    ) -> None:
        from tensordict import TensorDict

        self.tq, self.client, self.torch = tq, client, torch
        self.samples, self.seq_len, self.batch = samples, seq_len, batch
        self.data = _make_payload(torch, samples, seq_len)
        self.starts = list(range(0, samples, batch))
        # Built before timing: TensorDicts of contiguous row slices (views, no copies).
        self.batches = [
            TensorDict(
                {f: self.data[f][s : s + batch] for f in _FIELDS},
                batch_size=[min(batch, samples - s)],
            )
            for s in self.starts
        ]
        self.rounds = 0
        # Warm-up: first-call socket connects and lazy imports, in a scratch partition.
        client.put(data=self.batches[0], partition_id=_WARMUP_PARTITION)
        meta = client.get_meta(
            data_fields=list(_FIELDS),
            batch_size=self.batches[0].batch_size[0],
            partition_id=_WARMUP_PARTITION,
            task_name=_CONSUMER_TASK,
        )
        client.get_data(meta)
        client.clear_partition(_WARMUP_PARTITION)

    def round(self) -> dict[str, Any]:
        """Put every batch, then consume them all; check what was read; clear."""
        client, fields = self.client, list(_FIELDS)
        partition = f"{_PARTITION}_{self.rounds}"
        self.rounds += 1
        put_indexes: list[list[int]] = []
        tp0 = time.perf_counter()
        for td in self.batches:
            put_indexes.append(client.put(data=td, partition_id=partition).global_indexes)
        put_s = time.perf_counter() - tp0

        got: list[tuple[list[int], Any]] = []
        remaining = self.samples
        get_meta_s = get_data_s = 0.0
        while remaining > 0:
            n = min(self.batch, remaining)
            t0 = time.perf_counter()
            meta = client.get_meta(
                data_fields=fields, batch_size=n, partition_id=partition, task_name=_CONSUMER_TASK
            )
            t1 = time.perf_counter()
            data = client.get_data(meta)
            t2 = time.perf_counter()
            get_meta_s, get_data_s = get_meta_s + t1 - t0, get_data_s + t2 - t1
            if meta.size != n:
                raise RuntimeError(f"peer: get_meta returned {meta.size} samples, expected {n}")
            got.append((meta.global_indexes, data))
            remaining -= n
        get_s = get_meta_s + get_data_s

        _verify(self.torch, self.data, put_indexes, self.starts, got, self.seq_len)
        client.clear_partition(partition)
        time.sleep(_SETTLE_S)
        times = {"put_s": put_s, "get_meta_s": get_meta_s, "get_data_s": get_data_s}
        times.update(self._kv_round(f"{partition}_kv"))
        nbytes = payload_bytes(self.samples, self.seq_len)
        return {
            "put_gib_per_s": nbytes / put_s / _GIB,
            "get_gib_per_s": nbytes / get_s / _GIB,
            "get_samples_per_s": self.samples / get_s,
            "get_s": get_s,
            **{f"{k[:-2]}_samples_per_s": self.samples / v for k, v in times.items()},
            **times,
        }

    def _kv_round(self, partition: str) -> dict[str, float]:
        """``kv_batch_put`` of every batch under new keys, then ``kv_batch_get`` of each;
        the values read are checked; every key is cleared (not timed)."""
        tq = self.tq
        keys = [[f"s{s + i}" for i in range(td.batch_size[0])]
                for s, td in zip(self.starts, self.batches, strict=True)]  # fmt: skip
        t0 = time.perf_counter()
        for batch_keys, td in zip(keys, self.batches, strict=True):
            tq.kv_batch_put(keys=batch_keys, partition_id=partition, fields=td)
        t1 = time.perf_counter()
        got = [tq.kv_batch_get(keys=batch_keys, partition_id=partition) for batch_keys in keys]
        t2 = time.perf_counter()
        rows = list(range(self.samples))
        _verify(self.torch, self.data, [rows], [0], [(rows, _cat(self.torch, got))], self.seq_len)
        tq.kv_clear(keys=[k for batch_keys in keys for k in batch_keys], partition_id=partition)
        time.sleep(_SETTLE_S)
        return {"kv_batch_put_s": t1 - t0, "kv_batch_get_s": t2 - t1}


@contextlib.contextmanager
def start_transferqueue(
    samples: int, seq_len: int, batch: int, *, storage_units: int = 1
) -> Iterator[tuple[Peer, dict[str, Any]]]:
    """TransferQueue started on a private local Ray: the peer, and its start-up figures
    (``startup_s`` = ``ray_init_s`` + ``tq_init_s``, versions, configuration).

    Each TransferQueue actor reserves one Ray CPU, so Ray is started with
    ``max(2, storage_units + 1)`` logical CPUs (2 for the default single unit).
    Raises RuntimeError if TransferQueue is not installed, a Ray instance is already running
    in this process, or it cannot start.
    """
    ray, torch, _, tq = _import_transferqueue()
    if ray.is_initialized():
        raise RuntimeError(
            "TransferQueue peer needs its own local Ray instance, but Ray is already initialised "
            "in this process; run the peer in a fresh process (it calls ray.shutdown() at the end)"
        )
    from omegaconf import OmegaConf

    conf = OmegaConf.create(
        {
            "controller": {"sampler": "SequentialSampler", "polling_mode": False},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {"num_data_storage_units": storage_units},
            },
        }
    )
    t0 = time.perf_counter()
    for attempt in range(1, _RAY_ATTEMPTS + 1):  # Ray's node start-up can time out under load
        try:
            ray.init(
                num_cpus=max(2, storage_units + 1),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                namespace="flowrl_transferqueue_peer",
            )
            break
        except Exception as e:
            ray.shutdown()
            if attempt == _RAY_ATTEMPTS:
                raise RuntimeError(
                    f"TransferQueue peer: ray.init failed {attempt} times: {type(e).__name__}: {e}"
                ) from e
    try:
        t1 = time.perf_counter()
        try:
            tq.init(conf)
            client = tq.get_client()
        except Exception as e:
            raise RuntimeError(
                f"TransferQueue peer: transfer_queue.init failed: {type(e).__name__}: {e}"
            ) from e
        t2 = time.perf_counter()
        info = {
            "client": "transferqueue",
            "version": tq.__version__,
            "startup_s": t2 - t0,
            "ray_init_s": t1 - t0,
            "tq_init_s": t2 - t1,
            "storage_units": storage_units,
            "backend": "SimpleStorage",
            "ray_version": ray.__version__,
        }
        yield Peer(tq, client, torch, samples, seq_len, batch), info
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()


@contextlib.contextmanager
def start_compat(
    samples: int, seq_len: int, batch: int, *, placement: str
) -> Iterator[tuple[Peer, dict[str, Any]]]:
    """flowrl.compat.transfer_queue started in ``placement``: the peer and ``startup_s``."""
    import torch

    import flowrl.compat.transfer_queue as tq

    t0 = time.perf_counter()
    tq.init(
        {
            "backend": {"SimpleStorage": {"total_storage_size": 4 * samples}},
            "flowrl": {"placement": placement, "fetch_timeout": 60.0},
        }
    )
    try:
        info = {"client": "compat", "placement": placement, "startup_s": time.perf_counter() - t0}
        yield Peer(tq, tq.get_client(), torch, samples, seq_len, batch), info
    finally:
        tq.close()


#: Micro-batches the native client's Loader claims ahead.
PREFETCH = 4


class NativePeer:
    """flowrl's own API over zmq (``launch_hub``) on the same payload and round shape:
    ``put`` of every batch (``put_s``), then one consumer reading every column of each
    micro-batch into numpy until all are consumed (``get_s``, the figure a trainer sees):
    a ``Loader`` claiming ``PREFETCH`` micro-batches ahead (claim, get and ack); then the
    same batches put through a ``hub.put_batcher()`` (``batched_put_s``: eight puts sent
    as one) and the consumer loop by hand, one claim + get + ack at a time (``loop_s``)."""

    def __init__(self, samples: int, seq_len: int, batch: int) -> None:
        import numpy as np

        import flowrl
        from flowrl import Column, HubConfig

        self.samples, self.seq_len, self.batch = samples, seq_len, batch
        self.hub = flowrl.launch_hub(
            [
                Column.ragged("input_ids", "int64"),
                Column.ragged("logprobs", "float32"),
                Column.scalar("reward", "float32"),
            ],
            tasks={_CONSUMER_TASK: list(_FIELDS)},
            config=HubConfig(capacity=2 * samples + batch, lease_timeout=600.0),
        )
        rng = np.random.default_rng(1234)
        self.batches = []
        for start in range(0, samples, batch):
            n = min(batch, samples - start)
            cu = np.arange(n + 1, dtype=np.int64) * seq_len
            self.batches.append(
                {
                    "input_ids": flowrl.RaggedArray(
                        rng.integers(0, 151_936, n * seq_len, dtype=np.int64), cu
                    ),
                    "logprobs": flowrl.RaggedArray(
                        rng.standard_normal(n * seq_len, dtype=np.float32), cu
                    ),
                    "reward": rng.standard_normal(n, dtype=np.float32),
                }
            )
        self.hub.put(self.batches[0])  # warm-up: connections, first calls
        self._consume(self.batches[0]["reward"].size)

    def _consume(self, n: int) -> int:
        """Claim, read and ack ``n`` samples, micro-batch by micro-batch; a checksum."""
        hub, checksum = self.hub, 0
        while n > 0:
            meta = hub.claim(_CONSUMER_TASK, min(self.batch, n), timeout=60)
            checksum += _read(hub.get(meta))
            hub.ack(meta)
            n -= len(meta)
        return checksum

    def _load(self, n: int) -> int:
        """``n`` samples through a Loader claiming ahead; a checksum."""
        from flowrl import Loader

        checksum = 0
        loader = Loader(
            self.hub,
            task=_CONSUMER_TASK,
            columns=list(_FIELDS),
            batch_size=self.batch,
            timeout=60,
            prefetch=PREFETCH,
        )
        for batch in loader:
            checksum += _read(batch)
            n -= len(batch)
            if n <= 0:
                break
        loader.close()
        return checksum

    def _put(self) -> None:
        for data in self.batches:
            self.hub.put(data)

    def _put_batched(self) -> None:
        with self.hub.put_batcher() as batcher:
            for data in self.batches:
                batcher.put(data)

    def round(self) -> dict[str, Any]:
        times = {}
        for put, consume, keys in (
            (self._put, self._load, ("put_s", "get_s")),
            (self._put_batched, self._consume, ("batched_put_s", "loop_s")),
        ):
            t0 = time.perf_counter()
            put()
            times[keys[0]] = time.perf_counter() - t0
            t0 = time.perf_counter()
            consume(self.samples)
            times[keys[1]] = time.perf_counter() - t0
        nbytes = payload_bytes(self.samples, self.seq_len)
        return {
            **times,
            "put_gib_per_s": nbytes / times["put_s"] / _GIB,
            "batched_put_gib_per_s": nbytes / times["batched_put_s"] / _GIB,
            "get_gib_per_s": nbytes / times["get_s"] / _GIB,
            "loop_gib_per_s": nbytes / times["loop_s"] / _GIB,
        }

    def close(self) -> None:
        self.hub.close()


def _read(batch: Any) -> int:
    """Every column of a batch into numpy, as a trainer reads it; a checksum."""
    ids, _ = batch.packed("input_ids")
    lps, _ = batch.packed("logprobs")
    return int(ids[-1]) + int(lps.size) + int(batch["reward"].size)


@contextlib.contextmanager
def start_native(samples: int, seq_len: int, batch: int) -> Iterator[tuple[Any, dict[str, Any]]]:
    """flowrl's own client over zmq: the peer and ``startup_s``."""
    t0 = time.perf_counter()
    peer = NativePeer(samples, seq_len, batch)
    try:
        yield peer, {"client": "native", "startup_s": time.perf_counter() - t0}
    finally:
        peer.close()


def run_transferqueue(
    samples: int, seq_len: int, batch: int, *, storage_units: int = 1
) -> dict[str, Any]:
    """One round of TransferQueue: put and get throughput, timings and start-up figures."""
    _check_sizes(samples, seq_len, batch, storage_units)
    with start_transferqueue(samples, seq_len, batch, storage_units=storage_units) as (peer, info):
        return {**peer.round(), **info, **_sizes(samples, seq_len, batch)}


def _check_sizes(*sizes: int) -> None:
    if any(size <= 0 for size in sizes):
        raise ValueError(f"samples, seq_len, batch and storage_units must be positive, got {sizes}")


def _sizes(samples: int, seq_len: int, batch: int) -> dict[str, int]:
    return {
        "payload_bytes": payload_bytes(samples, seq_len),
        "samples": samples,
        "seq_len": seq_len,
        "batch": batch,
    }


def _verify(
    torch: Any,
    data: dict[str, Any],
    put_indexes: list[list[int]],
    starts: list[int],
    got: list[tuple[list[int], Any]],
    seq_len: int,
) -> None:
    """Check every sample read back equals the one put under the same global index."""
    row_of: dict[int, int] = {}
    for start, idxs in zip(starts, put_indexes, strict=True):
        for k, gi in enumerate(idxs):
            row_of[gi] = start + k
    if len(row_of) != data["reward"].shape[0]:
        raise RuntimeError(
            f"peer: put assigned {len(row_of)} distinct indexes for "
            f"{data['reward'].shape[0]} samples"
        )
    seen: set[int] = set()
    for idxs, td in got:
        rows = torch.tensor([row_of[gi] for gi in idxs], dtype=torch.long)
        seen.update(idxs)
        n = len(idxs)
        for f in _FIELDS:
            value = _field_rows(torch, td[f], n)
            expected = data[f].index_select(0, rows)
            if f != "reward":
                value = value.reshape(n, seq_len)
            if not torch.equal(value, expected):
                raise RuntimeError(f"peer: field {f!r} read back differs from what was put")
    if seen != set(row_of):
        raise RuntimeError(
            f"peer: consumer got {len(seen)} distinct samples, expected {len(row_of)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--client", choices=["transferqueue", "compat", "native"], default="transferqueue"
    )
    parser.add_argument("--placement", choices=["inproc", "zmq"], default="zmq", help="compat only")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--storage-units", type=int, default=1, help="SimpleStorageUnit actors (default 1)"
    )
    parser.add_argument(
        "--serve", action="store_true", help="one round per 'round' line on stdin, JSON lines"
    )
    args = parser.parse_args(argv)
    try:
        _check_sizes(args.samples, args.seq_len, args.batch, args.storage_units)
        if args.client == "transferqueue":
            started = start_transferqueue(
                args.samples, args.seq_len, args.batch, storage_units=args.storage_units
            )
        elif args.client == "native":
            started = start_native(args.samples, args.seq_len, args.batch)
        else:
            started = start_compat(args.samples, args.seq_len, args.batch, placement=args.placement)
        with started as (peer, info):
            info.update(_sizes(args.samples, args.seq_len, args.batch))
            if not args.serve:
                print(json.dumps({**peer.round(), **info}, indent=2))
                return 0
            print(json.dumps(info), flush=True)
            for line in sys.stdin:
                if line.strip() != "round":
                    break
                print(json.dumps(peer.round()), flush=True)
    except (RuntimeError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peer side of the data hub benchmark: put+get throughput of TransferQueue.

TransferQueue (``pip install transferqueue``, import name ``transfer_queue``) is
the data hub of the paper we compare against.  This module starts it locally on
a private single-node Ray instance bound to loopback, pushes the same payload
our own hub is benchmarked with, reads it back, and reports throughput.

Payload per sample: ``input_ids`` int64[seq_len], ``logprobs`` float32[seq_len]
and a float32 scalar ``reward``; throughput in GiB/s counts exactly those bytes
(``samples * (seq_len * 8 + seq_len * 4 + 4)``), not TransferQueue's own
framing or metadata.

Protocol, all through TransferQueue's public synchronous client
(``transfer_queue.get_client()``, a ``TransferQueueClient``):

* startup: ``ray.init(num_cpus=2, include_dashboard=False)`` on 127.0.0.1, then
  ``transfer_queue.init()`` with the default ``SimpleStorage`` backend (one
  ``TransferQueueController`` actor plus ``storage_units`` ``SimpleStorageUnit``
  actors, each a separate process serving ZMQ over TCP loopback);
* warm-up: one batch put, fetched and cleared in a scratch partition, so
  socket connects and first-call imports are not timed;
* put: one producer calls ``client.put(TensorDict, partition_id=...)`` once per
  batch of ``batch`` samples;
* get: one consumer task (``task_name="consumer"``) loops
  ``client.get_meta(fields, batch_size=batch, mode="fetch")`` +
  ``client.get_data(meta)`` until every sample has been consumed.

Every sample read back is checked against what was put (outside the timed
regions).  Nothing is ever estimated: if TransferQueue cannot be imported or
started, :func:`run_transferqueue` raises :class:`RuntimeError` saying why.

Standalone::

    python benchmarks/_transferqueue_peer.py --samples 4096 --seq-len 1024 --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["payload_bytes", "run_transferqueue"]

_FIELDS = ("input_ids", "logprobs", "reward")
_PARTITION = "flowrl_bench"
_WARMUP_PARTITION = "flowrl_bench_warmup"
_CONSUMER_TASK = "consumer"
_GIB = float(1 << 30)
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


def _field_rows(torch: Any, value: Any, n: int) -> Any:
    """Per-sample rows of a field returned by ``get_data``, as one dense [n, ...] tensor.

    TransferQueue returns variable-length fields as jagged nested tensors; with equal lengths
    their packed ``values()`` reshape to the dense batch without a copy.
    """
    if getattr(value, "is_nested", False):
        return value.values().reshape(n, -1)
    return value


def run_transferqueue(
    samples: int, seq_len: int, batch: int, *, storage_units: int = 1
) -> dict[str, Any]:
    """Measure TransferQueue put and get throughput on the benchmark payload.

    Args:
        samples: number of samples to put and then get back.
        seq_len: tokens per sample (``input_ids`` and ``logprobs`` length).
        batch: samples per ``put`` call and per consumer micro-batch.
        storage_units: ``SimpleStorageUnit`` actors.  Each TransferQueue actor reserves one Ray
            CPU, so Ray is started with ``max(2, storage_units + 1)`` logical CPUs (2 for the
            default single unit).  TransferQueue's own default is 2 units.

    Returns:
        ``put_samples_per_s``, ``get_samples_per_s``, ``put_gib_per_s``, ``get_gib_per_s``,
        ``version`` (``transfer_queue.__version__``), plus the raw timings (``put_s``, ``get_s``),
        ``startup_s`` (``ray.init`` + ``transfer_queue.init``, split in ``ray_init_s`` and
        ``tq_init_s``), the payload size and the configuration used.

    Raises:
        ValueError: on non-positive arguments.
        RuntimeError: if TransferQueue is not installed, a Ray instance is already running in
            this process, it cannot start, or data read back differs from what was put.
    """
    if samples <= 0 or seq_len <= 0 or batch <= 0 or storage_units <= 0:
        raise ValueError(
            f"samples, seq_len, batch and storage_units must be positive, got "
            f"{samples=}, {seq_len=}, {batch=}, {storage_units=}"
        )
    ray, torch, TensorDict, tq = _import_transferqueue()
    if ray.is_initialized():
        raise RuntimeError(
            "TransferQueue peer needs its own local Ray instance, but Ray is already initialised "
            "in this process; run the peer in a fresh process (it calls ray.shutdown() at the end)"
        )
    from omegaconf import OmegaConf

    data = _make_payload(torch, samples, seq_len)
    starts = list(range(0, samples, batch))
    # Built before timing: TensorDicts of contiguous row slices (views, no copies).
    batches = [
        TensorDict(
            {f: data[f][s : s + batch] for f in _FIELDS},
            batch_size=[min(batch, samples - s)],
        )
        for s in starts
    ]
    fields = list(_FIELDS)
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
    try:
        ray.init(
            num_cpus=max(2, storage_units + 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            namespace="flowrl_transferqueue_peer",
        )
    except Exception as e:
        raise RuntimeError(f"TransferQueue peer: ray.init failed: {type(e).__name__}: {e}") from e
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

        # Warm-up: first-call socket connects and lazy imports, in a scratch partition.
        client.put(data=batches[0], partition_id=_WARMUP_PARTITION)
        meta = client.get_meta(
            data_fields=fields,
            batch_size=batches[0].batch_size[0],
            partition_id=_WARMUP_PARTITION,
            task_name=_CONSUMER_TASK,
        )
        client.get_data(meta)
        client.clear_partition(_WARMUP_PARTITION)

        # Put: one producer, one call per batch.
        put_indexes: list[list[int]] = []
        tp0 = time.perf_counter()
        for td in batches:
            put_meta = client.put(data=td, partition_id=_PARTITION)
            put_indexes.append(put_meta.global_indexes)
        put_s = time.perf_counter() - tp0

        # Get: one consumer task, get_meta + get_data per micro-batch, until all are consumed.
        got: list[tuple[list[int], Any]] = []
        remaining = samples
        tg0 = time.perf_counter()
        while remaining > 0:
            n = min(batch, remaining)
            meta = client.get_meta(
                data_fields=fields, batch_size=n, partition_id=_PARTITION, task_name=_CONSUMER_TASK
            )
            if meta.size != n:
                raise RuntimeError(
                    f"TransferQueue peer: get_meta returned {meta.size} samples, expected {n}"
                )
            got.append((meta.global_indexes, client.get_data(meta)))
            remaining -= n
        get_s = time.perf_counter() - tg0

        _verify(torch, data, put_indexes, starts, got, seq_len)
        client.clear_partition(_PARTITION)
    finally:
        try:
            tq.close()
        finally:
            ray.shutdown()

    nbytes = payload_bytes(samples, seq_len)
    return {
        "put_samples_per_s": samples / put_s,
        "get_samples_per_s": samples / get_s,
        "put_gib_per_s": nbytes / put_s / _GIB,
        "get_gib_per_s": nbytes / get_s / _GIB,
        "version": tq.__version__,
        "put_s": put_s,
        "get_s": get_s,
        "startup_s": t2 - t0,
        "ray_init_s": t1 - t0,
        "tq_init_s": t2 - t1,
        "payload_bytes": nbytes,
        "samples": samples,
        "seq_len": seq_len,
        "batch": batch,
        "storage_units": storage_units,
        "backend": "SimpleStorage",
        "ray_version": ray.__version__,
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
            f"TransferQueue peer: put assigned {len(row_of)} distinct indexes for "
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
                raise RuntimeError(
                    f"TransferQueue peer: field {f!r} read back differs from what was put"
                )
    if seen != set(row_of):
        raise RuntimeError(
            f"TransferQueue peer: consumer got {len(seen)} distinct samples, expected {len(row_of)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--storage-units", type=int, default=1, help="SimpleStorageUnit actors (default 1)"
    )
    args = parser.parse_args(argv)
    try:
        result = run_transferqueue(
            args.samples, args.seq_len, args.batch, storage_units=args.storage_units
        )
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""flowrl's TransferQueue-compatible client on the TransferQueue peer's protocol.

The same payload, calls and checks as ``_transferqueue_peer.py`` (read its docstring), made
through ``flowrl.compat.transfer_queue`` instead of ``transfer_queue``: one producer calls
``client.put(TensorDict, partition_id=...)`` per batch, one consumer task loops
``client.get_meta`` + ``client.get_data`` until every sample was consumed, and every sample
read back is compared with what was put (outside the timed regions). ``startup_s`` is
``tq.init()``. ``--placement``: ``inproc`` (the embedded hub) or ``zmq`` (controller and
storage unit in other processes, as TransferQueue's actors are).

Standalone::

    python benchmarks/_compat_peer.py --placement zmq --samples 4096 --seq-len 1024 --batch 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from _transferqueue_peer import _FIELDS, _GIB, _make_payload, _verify, payload_bytes

__all__ = ["run_compat"]

_PARTITION = "flowrl_bench"
_WARMUP_PARTITION = "flowrl_bench_warmup"
_CONSUMER_TASK = "consumer"


def run_compat(samples: int, seq_len: int, batch: int, placement: str) -> dict[str, Any]:
    """Put and get throughput of the compat client (same keys as the TransferQueue peer's)."""
    import torch
    from tensordict import TensorDict

    import flowrl.compat.transfer_queue as tq

    data = _make_payload(torch, samples, seq_len)
    starts = list(range(0, samples, batch))
    batches = [
        TensorDict(
            {f: data[f][s : s + batch] for f in _FIELDS}, batch_size=[min(batch, samples - s)]
        )
        for s in starts
    ]
    fields = list(_FIELDS)
    t0 = time.perf_counter()
    tq.init(
        {
            "backend": {"SimpleStorage": {"total_storage_size": samples + 2 * batch}},
            "flowrl": {"placement": placement, "fetch_timeout": 60.0},
        }
    )
    try:
        client = tq.get_client()
        startup_s = time.perf_counter() - t0
        client.put(data=batches[0], partition_id=_WARMUP_PARTITION)
        meta = client.get_meta(
            data_fields=fields,
            batch_size=batches[0].batch_size[0],
            partition_id=_WARMUP_PARTITION,
            task_name=_CONSUMER_TASK,
        )
        client.get_data(meta)
        client.clear_partition(_WARMUP_PARTITION)

        put_indexes: list[list[int]] = []
        tp0 = time.perf_counter()
        for td in batches:
            put_indexes.append(client.put(data=td, partition_id=_PARTITION).global_indexes)
        put_s = time.perf_counter() - tp0

        got: list[tuple[list[int], Any]] = []
        remaining = samples
        tg0 = time.perf_counter()
        while remaining > 0:
            n = min(batch, remaining)
            meta = client.get_meta(
                data_fields=fields, batch_size=n, partition_id=_PARTITION, task_name=_CONSUMER_TASK
            )
            got.append((meta.global_indexes, client.get_data(meta)))
            remaining -= n
        get_s = time.perf_counter() - tg0
        _verify(torch, data, put_indexes, starts, got, seq_len)
        client.clear_partition(_PARTITION)
    finally:
        tq.close()
    nbytes = payload_bytes(samples, seq_len)
    return {
        "put_samples_per_s": samples / put_s,
        "get_samples_per_s": samples / get_s,
        "put_gib_per_s": nbytes / put_s / _GIB,
        "get_gib_per_s": nbytes / get_s / _GIB,
        "put_s": put_s,
        "get_s": get_s,
        "startup_s": startup_s,
        "placement": placement,
        "samples": samples,
        "seq_len": seq_len,
        "batch": batch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--placement", choices=["inproc", "zmq"], default="zmq")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object (always)")
    args = parser.parse_args(argv)
    try:
        result = run_compat(args.samples, args.seq_len, args.batch, args.placement)
    except ImportError as e:
        print(f"error: compat client unavailable: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

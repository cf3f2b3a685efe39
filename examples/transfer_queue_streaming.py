"""A TransferQueue program running on flowrl: only the import differs.

A rollout process writes prompts and responses with TransferQueue's client API, a reward
step tags samples through the KV API, and the trainer iterates a StreamingDataLoader.
With ``--placement zmq`` the hub runs in server processes and the rollout worker is a
separate process that joins it with a bare ``tq.init()`` (as in TransferQueue, where the
second process finds the controller); ``inproc`` (default) keeps everything here.

    python examples/transfer_queue_streaming.py [--placement zmq] [--samples 64]

Needs: the ``compat`` extra (tensordict): ``pip install 'flowrl[compat]'``. Takes: a few
seconds (``inproc``), about half a minute with ``--placement zmq``.
"""

from __future__ import annotations

import argparse
import multiprocessing

import torch

try:
    from tensordict import TensorDict
except ImportError:  # say which extra, not just the module
    raise SystemExit(
        "this example needs tensordict: pip install 'flowrl[compat]' (with torch==2.13.0)"
    ) from None

import flowrl.compat.transfer_queue as tq  # was: import transfer_queue as tq

PARTITION = "train_0"


def rollout(samples: int) -> None:
    """Insert prompts, then fetch them as the 'generate' task and write responses back."""
    tq.init()  # joins the hub the parent started (or, in-process, is a no-op)
    client = tq.get_client()
    prompts = torch.randint(0, 100, (samples, 8))
    client.put(TensorDict({"prompts": prompts}, batch_size=samples), partition_id=PARTITION)
    for _ in range(samples // 8):
        meta = client.get_meta(["prompts"], 8, PARTITION, task_name="generate")
        batch = client.get_data(meta)
        responses = [p[: 1 + int(p[0]) % 7] * 2 for p in batch["prompts"].unbind(0)]
        out = TensorDict(
            {"responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged)},
            batch_size=meta.size,
        )
        client.put(out, metadata=meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placement", choices=["inproc", "zmq"], default="inproc")
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()
    tq.init({"flowrl": {"placement": args.placement, "fetch_timeout": 30.0}})
    try:
        if args.placement == "zmq":
            worker = multiprocessing.get_context("spawn").Process(
                target=rollout, args=(args.samples,)
            )
            worker.start()
        else:
            rollout(args.samples)
        dataset = tq.StreamingDataset(
            config=None,
            batch_size=8,
            micro_batch_size=4,
            data_fields=["prompts", "responses"],
            partition_id=PARTITION,
            task_name="update_actor",
            dp_rank=0,
        )
        tokens = 0
        for step, (batch, meta) in enumerate(tq.StreamingDataLoader(dataset)):
            lengths = [int(r.numel()) for r in batch["responses"].unbind(0)]
            tokens += sum(lengths)
            keys = [f"sample_{i}" for i in meta.global_indexes]
            tq.kv_batch_put(keys=keys, partition_id="stats", tags=[{"len": n} for n in lengths])
            if (step + 1) * 4 == args.samples:
                break
        if args.placement == "zmq":
            worker.join()
        stats = tq.kv_list("stats")["stats"]
        print(f"trained on {len(stats)} samples, {tokens} response tokens")
        tq.get_client().clear_partition(PARTITION)
    finally:
        tq.close()


if __name__ == "__main__":
    main()

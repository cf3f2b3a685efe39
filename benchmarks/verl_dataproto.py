"""Cost of handing hub batches to verl: ``to_dataproto`` / ``from_dataproto`` (needs verl 0.9.1).

What: ``n`` GRPO samples (prompt 64-256 tokens, response 16-1024 tokens, heavy-tailed,
per-token log-probs, a scalar score) sit in an in-process hub. Per repeat we time:

* ``claim_get_ms``: claim + get of the batch from the hub (zero-copy Arrow views);
* ``to_dataproto_ms``: building verl's padded worker layout (prompts, responses,
  input_ids, attention_mask, position_ids, response_mask, log-probs) as a ``DataProto``;
* ``from_dataproto_ms``: rebuilding the flowrl ``Batch`` from it (unpadding);
* ``from_verl_ms``: ``from_dataproto`` of the DataProto verl's padding loop built (below):
  no flowrl schema, so lengths come from ``attention_mask`` and the padded layout is
  checked to rebuild equal;
* ``verl_pad_ms``: the baseline verl's agent loop does for the same samples: pad Python
  token lists per sample into tensors (``torch.nn.functional.pad``) and
  ``DataProto.from_dict``.

How to read: ``ratio_to_vs_verl_pad`` < 1 means flowrl's conversion is cheaper than the
per-sample padding loop it replaces. Medians over ``--repeats``; quote the ratio, absolute
times drift on shared machines.

    python benchmarks/verl_dataproto.py --json [--samples 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from verl import DataProto

import flowrl
from flowrl import Column
from flowrl.integrations.verl import from_dataproto, to_dataproto


def _data(n: int, rng: np.random.Generator) -> dict:
    p_len = rng.integers(64, 257, n)
    r_len = np.minimum(16 + rng.pareto(1.5, n) * 64, 1024).astype(np.int64)
    return {
        "prompt_ids": [rng.integers(0, 32000, k) for k in p_len],
        "response_ids": [rng.integers(0, 32000, k) for k in r_len],
        "rollout_log_probs": [rng.standard_normal(k).astype(np.float32) for k in r_len],
        "score": rng.random(n).astype(np.float32),
    }


def _verl_pad(data: dict, p_width: int, r_width: int) -> DataProto:
    """Per-sample padding from Python lists, as verl's agent loop post-processing does."""
    prompts, responses, logps, p_mask, r_mask = [], [], [], [], []
    for p, r, lp in zip(
        data["prompt_ids"], data["response_ids"], data["rollout_log_probs"], strict=True
    ):
        p_t, r_t = torch.tensor(p.tolist()), torch.tensor(r.tolist())
        prompts.append(torch.nn.functional.pad(p_t, (p_width - len(p), 0)))
        responses.append(torch.nn.functional.pad(r_t, (0, r_width - len(r))))
        logps.append(torch.nn.functional.pad(torch.tensor(lp.tolist()), (0, r_width - len(r))))
        p_mask.append(torch.nn.functional.pad(torch.ones(len(p)), (p_width - len(p), 0)))
        r_mask.append(torch.nn.functional.pad(torch.ones(len(r)), (0, r_width - len(r))))
    pt, rt = torch.stack(prompts), torch.stack(responses)
    attention = torch.cat([torch.stack(p_mask), torch.stack(r_mask)], 1).long()
    return DataProto.from_dict(
        tensors={
            "prompts": pt,
            "responses": rt,
            "input_ids": torch.cat([pt, rt], 1),
            "attention_mask": attention,
            "position_ids": torch.clip(torch.cumsum(attention, 1) - 1, min=0),
            "response_mask": torch.stack(r_mask).long(),
            "rollout_log_probs": torch.stack(logps),
            "score": torch.from_numpy(data["score"]),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = _data(args.samples, np.random.default_rng(0))
    p_width = max(len(p) for p in data["prompt_ids"])
    r_width = max(len(r) for r in data["response_ids"])
    keys = ("claim_get", "to", "from", "verl_pad", "from_verl")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(args.repeats):
        hub = flowrl.Hub(
            [
                Column.ragged("prompt_ids", "int64"),
                Column.ragged("response_ids", "int64"),
                Column.ragged("rollout_log_probs", "float32"),
                Column.scalar("score", "float32"),
            ]
        )
        hub.register_task("train", list(data))
        hub.put(data)
        t0 = time.perf_counter()
        batch = hub.get(hub.claim("train", args.samples))
        t1 = time.perf_counter()
        dp = to_dataproto(batch)
        t2 = time.perf_counter()
        from_dataproto(dp)
        t3 = time.perf_counter()
        verl_dp = _verl_pad(data, p_width, r_width)
        t4 = time.perf_counter()
        from_dataproto(verl_dp)
        t5 = time.perf_counter()
        hub.close()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[key].append(dt * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "samples": args.samples,
        "repeats": args.repeats,
        "claim_get_ms": round(med["claim_get"], 3),
        "to_dataproto_ms": round(med["to"], 3),
        "from_dataproto_ms": round(med["from"], 3),
        "verl_pad_ms": round(med["verl_pad"], 3),
        "from_verl_ms": round(med["from_verl"], 3),
        "ratio_to_vs_verl_pad": round(med["to"] / med["verl_pad"], 3),
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

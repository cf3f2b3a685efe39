"""Cost of durable (partial) rollouts in the main job's rollout stage.

What it measures: the time of one rollout micro-batch of the main job (``flowrl run
grpo``: 32 prompts of 1-2 digit additions, TinyLM d_model=64 warmed up on the task, the
KV-cache sampler, up to 5 new tokens) through ``flowrl.rl.generate_resumable`` on an
embedded hub, claim + read + generate + put + ack, with appends every
``append_every`` decoding steps: 0 (off: plain generation, as before partial rollouts),
1, 2 (the main job's default) and 4; every setting but 0 also reads the prefixes once
per micro-batch (``hub.partial``). Each round runs every setting, in an order rotated
from round to round, so that the machine's drift hits them alike.

How to read it: ``ms_per_batch`` per setting (the fastest round, CPU time of this
process: torch runs one thread, and the fastest round of CPU time is what other jobs on
a shared machine disturb least; ``median_ms_per_batch`` and ``wall_ms_per_batch``, the
medians, too) and ``overhead`` = ms_per_batch(setting) / ms_per_batch(off) - 1, which on
a busy machine is still noisy (several %); the direct figure is ``append_ms_per_batch``,
the CPU time spent inside ``hub.append_async`` per micro-batch (in-process it returns once
the append is done), and ``append_share`` = that over the micro-batch without appends.
``appends_per_batch`` is how many appends (one per chunk: tokens and log-probs together)
a micro-batch made on average. The rollout stage is one of the job's two busiest stages,
so its overhead bounds the job's wall-time cost.

    python benchmarks/partial_rollouts.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import flowrl
from flowrl import Column
from flowrl.models import TinyLM, TinyLMConfig
from flowrl.rl import generate_resumable
from flowrl.tasks import EOS_ID, VOCAB_SIZE, ArithTask, pretrain

SETTINGS = (0, 1, 2, 4)
COLUMNS = [
    Column.ragged("prompt", "int64"),
    Column.ragged("response", "int64"),
    Column.ragged("sample_logprobs", "float32"),
    Column.ragged("response_versions", "int64"),
]


class _Counting:
    """The hub, counting appends and the CPU time spent inside them."""

    def __init__(self, hub: flowrl.Hub) -> None:
        self.hub = hub
        self.appends = 0
        self.cpu_s = 0.0

    def partial(self, *args: Any, **kwargs: Any) -> Any:
        return self.hub.partial(*args, **kwargs)

    def append_async(self, *args: Any, **kwargs: Any) -> Any:
        self.appends += 1
        t0 = time.process_time()
        try:
            return self.hub.append_async(*args, **kwargs)  # (in-process: done at once)
        finally:
            self.cpu_s += time.process_time() - t0


def measure(rounds: int, batches: int, batch: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = ArithTask(digits=(1, 2), seed=0)
    model = TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB_SIZE, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=24
        )
    )
    pretrain(model, task, 300, lr=3e-3, noise=0.0, seed=0)  # realistic response lengths
    model.eval()
    max_new = task.max_response_len + 1
    hub = flowrl.Hub(COLUMNS, tasks={"Rollout": ["prompt"]}, config=flowrl.HubConfig(capacity=4096))
    counting = _Counting(hub)
    times: dict[int, list[float]] = {s: [] for s in SETTINGS}
    walls: dict[int, list[float]] = {s: [] for s in SETTINGS}
    appends: dict[int, int] = dict.fromkeys(SETTINGS, 0)
    inside: dict[int, float] = dict.fromkeys(SETTINGS, 0.0)
    tokens = 0
    for r in range(rounds):
        for setting in SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]:
            prompts = [p.prompt_ids for p in task.sample(batch * batches)]
            hub.put({"prompt": prompts})
            counting.appends = 0
            counting.cpu_s = 0.0
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(batches):
                meta = hub.claim("Rollout", batch, timeout=5)
                got = hub.get(meta)
                with torch.no_grad():
                    out = generate_resumable(
                        model,
                        counting,  # type: ignore[arg-type]
                        meta,
                        got.ragged("prompt").tolist(),
                        max_new,
                        version=0,
                        eos_id=EOS_ID,
                        append_every=setting,
                        generator=torch.Generator().manual_seed(int(meta.indices[0])),
                    )
                hub.put(
                    {
                        "response": out.responses,
                        "sample_logprobs": out.logprobs,
                        "response_versions": out.versions,
                    },
                    indices=meta,
                    version=out.sample_versions(0),
                )
                hub.ack(meta)
                tokens += out.responses.values.size
            times[setting].append((time.process_time() - t0) / batches * 1e3)
            walls[setting].append((time.perf_counter() - w0) / batches * 1e3)
            appends[setting] += counting.appends
            inside[setting] += counting.cpu_s
    hub.close()
    base = min(times[0])
    return {
        "batch": batch,
        "max_new_tokens": max_new,
        "rounds": rounds,
        "batches_per_round": batches,
        "settings": {
            str(s): {
                "ms_per_batch": round(min(times[s]), 3),
                "median_ms_per_batch": round(statistics.median(times[s]), 3),
                "wall_ms_per_batch": round(statistics.median(walls[s]), 3),
                "overhead": round(min(times[s]) / base - 1, 4),
                "appends_per_batch": round(appends[s] / (rounds * batches), 2),
                "append_ms_per_batch": round(inside[s] / (rounds * batches) * 1e3, 3),
                "append_share": round(inside[s] / (rounds * batches) * 1e3 / base, 4),
            }
            for s in SETTINGS
        },
        "mean_response_tokens": round(tokens / (rounds * len(SETTINGS) * batches * batch), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.rounds, args.batches, args.batch)
    if args.json:
        print(json.dumps(result))
        return
    for name, row in result["settings"].items():
        print(
            f"append_every={name}: {row['ms_per_batch']:.2f} ms/batch, "
            f"overhead {row['overhead']:+.1%}, {row['appends_per_batch']} appends/batch "
            f"taking {row['append_ms_per_batch']:.3f} ms ({row['append_share']:.1%})"
        )


if __name__ == "__main__":
    main()

"""Engine throughput and weight-sync latency.

What it measures, on one model and one set of prompts for every engine:

- ``rollout``: generated tokens/s of each rollout engine in ``ROLLOUT_ENGINES``: ``--prompts``
  random prompts of ``--prompt-len`` tokens, all added at once, ``--new-tokens`` sampled
  per prompt at temperature 1 with no EOS (every request runs to the end), stepped until
  all are returned; the fastest of ``--rounds`` rounds.
- ``train``: trained response tokens/s of each update engine in ``UPDATE_ENGINES``: one
  step over the same prompts with random responses of ``--new-tokens`` tokens, in
  ``--micro-batches`` micro-batches, a token-mean NLL loss; the fastest of ``--rounds``
  steps after one warm-up step. DeepSpeed runs ZeRO-2 on one gloo rank here (its sharding
  pays off with more ranks; the figure shows its per-rank overhead); Megatron-core runs
  its GPT rebuilt from the Llama (tensor and pipeline parallel 1, one gloo rank, SDPA
  core attention): read it against ``torch-hf-llama``, the same weights in transformers.
- ``weight_sync``: latency from the end of a trainer step to the first decoding step of a
  rollout engine *in another process* sampling with the new version, through shared
  memory (``flowrl.WeightPublisher`` / ``WeightSubscriber``), for a Llama of
  ``--sync-hidden`` x ``--sync-layers`` (default about 110M parameters, float32): the
  publisher copies the weights into a new segment, the rollout process notices the
  header between two decoding steps, copies the tensors into its model and decodes one
  step (``update_ms`` is its share, ``publish_ms`` the trainer's). Median of
  ``--sync-rounds``. The latency includes the rest of the decoding step under way when
  the version lands and one step after it (``rollout_step_ms_median``); ``memcpy_ms`` is
  one plain copy of the same bytes in the trainer process, measured in the same run: a
  sync costs about one copy on each side, so read the latency against it on a shared
  machine, where memory bandwidth is what other jobs take.

The model is a randomly initialised Hugging Face Llama (``flowrl.models.hf.tiny_llama``)
of ``--hidden`` x ``--layers``, and TinyLM of the same width and depth for the built-in
model; engines whose package is missing are reported as skipped. One torch thread per
process. Add an engine by adding a factory to ``ROLLOUT_ENGINES`` or ``UPDATE_ENGINES``.

    python benchmarks/engines.py --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import flowrl
from flowrl.engines import (
    GenerationRequest,
    OptimConfig,
    RolloutEngine,
    SamplingParams,
    TorchRolloutEngine,
    TorchUpdateEngine,
    TrainBatch,
    UpdateEngine,
)

VOCAB = 512


def hf_llama(args: argparse.Namespace, hidden: int, layers: int) -> torch.nn.Module:
    from flowrl.models.hf import tiny_llama

    return tiny_llama(
        vocab_size=VOCAB if hidden == args.hidden else 32000,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=max(hidden // 64, 1),
        max_positions=args.prompt_len + args.new_tokens + 8,
    )


def tinylm(args: argparse.Namespace) -> torch.nn.Module:
    from flowrl.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    return TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB,
            d_model=args.hidden,
            n_layers=args.layers,
            n_heads=max(args.hidden // 64, 1),
            d_ff=4 * args.hidden,
            max_seq_len=args.prompt_len + args.new_tokens + 8,
        )
    )


def _deepspeed(model: torch.nn.Module) -> UpdateEngine:
    from flowrl.engines import DeepSpeedUpdateEngine

    return DeepSpeedUpdateEngine(model, OptimConfig(lr=1e-4), zero_stage=2)


def _megatron(model: torch.nn.Module) -> UpdateEngine:
    from flowrl.engines import MegatronUpdateEngine

    return MegatronUpdateEngine(model, OptimConfig(lr=1e-4))


ROLLOUT_ENGINES: dict[str, Callable[[argparse.Namespace], RolloutEngine]] = {
    "torch-tinylm": lambda a: TorchRolloutEngine(tinylm(a)),
    "torch-hf-llama": lambda a: TorchRolloutEngine(hf_llama(a, a.hidden, a.layers)),
}
UPDATE_ENGINES: dict[str, Callable[[argparse.Namespace], UpdateEngine]] = {
    "torch-tinylm": lambda a: TorchUpdateEngine(tinylm(a), OptimConfig(lr=1e-4)),
    "torch-hf-llama": lambda a: TorchUpdateEngine(
        hf_llama(a, a.hidden, a.layers), OptimConfig(lr=1e-4)
    ),
    "deepspeed-zero2-hf-llama": lambda a: _deepspeed(hf_llama(a, a.hidden, a.layers)),
    "megatron-hf-llama": lambda a: _megatron(hf_llama(a, a.hidden, a.layers)),
}


def prompts(args: argparse.Namespace) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(4, VOCAB, size=args.prompt_len) for _ in range(args.prompts)]


def bench_rollout(engine: RolloutEngine, args: argparse.Namespace) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    best = float("inf")
    for _ in range(args.rounds):
        engine.add([GenerationRequest(i, p) for i, p in enumerate(prompts(args))], params)
        t0 = time.perf_counter()
        done = []
        while engine.pending:
            done += engine.step()
        best = min(best, time.perf_counter() - t0)
    tokens = sum(len(c.tokens) for c in done)
    return {"tokens_per_s": tokens / best, "tokens": tokens, "s": best}


def bench_train(engine: UpdateEngine, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(1)
    responses = [rng.integers(4, VOCAB, size=args.new_tokens) for _ in range(args.prompts)]
    batch = TrainBatch.pack(prompts(args), responses).split(args.micro_batches)

    def nll(lp: torch.Tensor, _: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return -lp.mean(), {}

    engine.train_step(batch, nll)  # warm-up (optimizer state allocation)
    best = float("inf")
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        engine.train_step(batch, nll)
        best = min(best, time.perf_counter() - t0)
    tokens = sum(mb.n_tokens for mb in batch)
    return {"tokens_per_s": tokens / best, "tokens": tokens, "s": best}


def _sync_rollout(channel: str, args: argparse.Namespace, ready: Any, out: Any) -> None:
    torch.set_num_threads(1)
    engine = TorchRolloutEngine(hf_llama(args, args.sync_hidden, args.sync_layers))
    sub = flowrl.WeightSubscriber(channel)
    request = [GenerationRequest(0, np.arange(4, 12, dtype=np.int64))]
    params = SamplingParams(max_new_tokens=args.prompt_len + args.new_tokens, seed=0)
    ready.set()
    step_ms: list[float] = []
    for _ in range(args.sync_rounds):
        while True:
            if not engine.pending:
                engine.add(request, params)
            snap = sub.poll(engine.version)
            if snap is not None:
                t_load = time.time()
                engine.update_weights(snap.tensors(), snap.version)
                t_loaded = time.time()
                engine.step()  # the first step sampling with the new version
                used = time.time()
                out.put((snap.version, used, (t_loaded - t_load) * 1e3, step_ms[-20:]))
                break
            t0 = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    engine.abort()


def bench_weight_sync(args: argparse.Namespace) -> dict[str, float]:
    trainer = TorchUpdateEngine(hf_llama(args, args.sync_hidden, args.sync_layers))
    n_params = sum(p.numel() for p in trainer.model.parameters())
    channel = f"bench-{secrets.token_hex(4)}"
    pub = flowrl.WeightPublisher(channel)
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_sync_rollout, args=(channel, args, ready, out))
    child.start()
    latencies, publish_ms, update_ms, step_ms = [], [], [], []
    t0 = time.perf_counter()
    copies = [t.clone() for _, t in trainer.named_weights()]  # the bytes, copied once
    memcpy_ms = (time.perf_counter() - t0) * 1e3
    del copies
    try:
        if not ready.wait(600):
            raise RuntimeError("the rollout process did not start")
        for version in range(1, args.sync_rounds + 1):
            time.sleep(0.2)  # the rollout process is decoding when the step ends
            t_end = time.time()  # a trainer step ends here
            pub.publish(trainer.named_weights(), version)
            publish_ms.append((time.time() - t_end) * 1e3)
            got, t_used, loaded_ms, steps = out.get(timeout=600)
            step_ms += steps
            if got != version:
                raise RuntimeError(f"rollout used version {got}, expected {version}")
            latencies.append((t_used - t_end) * 1e3)
            update_ms.append(loaded_ms)
        child.join(120)
    finally:
        pub.close()
        if child.is_alive():
            child.kill()
    return {
        "params_millions": n_params / 1e6,
        "latency_ms_median": statistics.median(latencies),
        "latency_ms_max": max(latencies),
        "publish_ms_median": statistics.median(publish_ms),
        "update_ms_median": statistics.median(update_ms),
        "rollout_step_ms_median": statistics.median(step_ms) if step_ms else 0.0,
        "memcpy_ms": memcpy_ms,
        "rounds": len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-hidden", type=int, default=768)
    parser.add_argument("--sync-layers", type=int, default=12)
    parser.add_argument("--sync-rounds", type=int, default=3)
    parser.add_argument("--engines", nargs="*", help="engine names to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rollout": {}, "train": {}, "skipped": {}}
    wanted = set(args.engines) if args.engines else None
    for kind, engines, bench in (
        ("rollout", ROLLOUT_ENGINES, bench_rollout),
        ("train", UPDATE_ENGINES, bench_train),
    ):
        for name, make in engines.items():
            if wanted is not None and name not in wanted:
                continue
            try:
                engine = make(args)
            except (ImportError, flowrl.FlowRLError) as exc:
                report["skipped"][f"{kind}/{name}"] = str(exc).splitlines()[0]
                continue
            report[kind][name] = bench(engine, args)  # type: ignore[operator]
            engine.close()
    if args.sync_rounds:
        report["weight_sync"] = bench_weight_sync(args)
    report["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

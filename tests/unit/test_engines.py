"""Conformance of every engine that installs to the protocol in ``flowrl.engines.base``.

Rollout engines: streaming (requests added while others run, each returned the step it
finishes), exactly-once return (step or abort), a weight update mid-generation resumes
each interrupted request from its exact prefix with per-token versions, sampler log-probs
equal a recompute. Update engines: a step lowers the loss of a fixed batch, the step does
not depend on how it is split into micro-batches, ``named_weights`` load into a rollout
engine, ``state_dict`` round-trips. Models: TinyLM, and a Hugging Face Llama where
``transformers`` is installed (else skipped with the reason). DeepSpeed runs in
tests/integration/test_engines_deepspeed.py (two processes).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from flowrl.engines import (
    Completion,
    GenerationRequest,
    OptimConfig,
    SamplingParams,
    TorchRolloutEngine,
    TorchUpdateEngine,
    TrainBatch,
)
from flowrl.errors import ConfigError
from flowrl.models import TinyLM, TinyLMConfig, as_causal_lm
from flowrl.rl import build_batch, token_logprobs

VOCAB = 16
EOS = 3


def _tinylm() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, max_seq_len=48))


def _llama() -> torch.nn.Module:
    pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    from flowrl.models.hf import tiny_llama

    return tiny_llama(vocab_size=VOCAB, hidden_size=32, n_heads=4, n_kv_heads=2, max_positions=48)


MODELS = {"tinylm": _tinylm, "hf-llama": _llama}


@pytest.fixture(params=sorted(MODELS))
def make_model(request: pytest.FixtureRequest) -> Callable[[], torch.nn.Module]:
    torch.set_num_threads(1)
    MODELS[request.param]()  # skips here when the model cannot be built
    return MODELS[request.param]


def _requests(ids: range, seed: int = 0) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(i, rng.integers(4, VOCAB, size=int(rng.integers(2, 7))).astype(np.int64))
        for i in ids
    ]


def _drain(engine: TorchRolloutEngine, out: list[Completion], max_steps: int = 200) -> int:
    steps = 0
    while engine.pending and steps < max_steps:
        out += engine.step()
        steps += 1
    return steps


def _recompute(
    model: torch.nn.Module,
    prompts: list[np.ndarray],
    tokens: list[np.ndarray],
    temperature: float,
    top_p: float = 1.0,
) -> list[np.ndarray]:
    ids, mask, starts, cu = build_batch(
        [torch.from_numpy(p) for p in prompts], [torch.from_numpy(t) for t in tokens]
    )
    lm = as_causal_lm(model)
    with torch.no_grad():
        lp = token_logprobs(lm, ids, mask, starts, cu, temperature=temperature, top_p=top_p)
    return [lp[a:b].numpy() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


def test_streaming_each_request_returned_once_when_it_finishes(make_model) -> None:
    engine = TorchRolloutEngine(make_model())
    params = SamplingParams(max_new_tokens=12, eos_id=EOS, seed=1)
    first, second = _requests(range(0, 6)), _requests(range(6, 10), seed=1)
    engine.add(first, params)
    out: list[Completion] = []
    per_step: list[int] = []
    for _ in range(3):
        done = engine.step()
        per_step.append(len(done))
        out += done
    engine.add(second, params)  # while the first ones run
    assert engine.pending == 10 - len(out)
    while engine.pending:
        done = engine.step()
        per_step.append(len(done))
        out += done
        assert engine.pending == 10 - len(out)
    assert sorted(c.id for c in out) == list(range(10))  # each exactly once
    assert all(c.finished for c in out)
    assert sum(1 for n in per_step if n) > 1  # returned as they finish, not all at the end
    for c in out:
        n = len(c.tokens)
        assert len(c.logprobs) == n == len(c.versions) and 1 <= n <= 12
        assert (c.versions == 0).all()
        assert n == 12 or c.tokens[-1] == EOS
        assert EOS not in c.tokens[:-1]
    assert engine.step() == [] and engine.abort() == []


def test_abort_returns_partial_work_once(make_model) -> None:
    engine = TorchRolloutEngine(make_model())
    params = SamplingParams(max_new_tokens=20, seed=3)  # no EOS: all run 20 steps
    engine.add(_requests(range(4)), params)
    for _ in range(5):
        assert engine.step() == []
    aborted = engine.abort([1, 2, 99])
    assert sorted(c.id for c in aborted) == [1, 2]
    assert all(not c.finished and len(c.tokens) == 5 for c in aborted)
    out: list[Completion] = []
    _drain(engine, out)
    assert sorted(c.id for c in out) == [0, 3]
    assert all(len(c.tokens) == 20 for c in out)
    engine.add(_requests(range(1, 2)), params)  # an aborted id may be added again
    assert engine.pending == 1


def test_sampler_logprobs_match_recompute(make_model) -> None:
    model = make_model()
    engine = TorchRolloutEngine(model)
    requests = _requests(range(8))
    engine.add(requests, SamplingParams(max_new_tokens=10, temperature=0.7, eos_id=EOS))
    out: list[Completion] = []
    _drain(engine, out)
    out.sort(key=lambda c: c.id)
    again = _recompute(model, [r.prompt for r in requests], [c.tokens for c in out], 0.7)
    for c, lp in zip(out, again, strict=True):
        np.testing.assert_allclose(c.logprobs, lp, atol=2e-5)


def test_top_p_logprobs_are_the_renormalised_nucleus(make_model) -> None:
    # Recorded: the log-prob under the distribution sampled from (the nucleus, renormalised),
    # what vLLM records and what a TIS correction needs; not the untruncated one.
    model = make_model()
    engine = TorchRolloutEngine(model)
    requests = _requests(range(8))
    engine.add(requests, SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.6, seed=5))
    out: list[Completion] = []
    _drain(engine, out)
    out.sort(key=lambda c: c.id)
    prompts, tokens = [r.prompt for r in requests], [c.tokens for c in out]
    nucleus = np.concatenate(_recompute(model, prompts, tokens, 1.3, top_p=0.6))
    full = np.concatenate(_recompute(model, prompts, tokens, 1.3))
    recorded = np.concatenate([c.logprobs for c in out])
    np.testing.assert_allclose(recorded, nucleus, atol=2e-5)
    assert np.isfinite(recorded).all()  # every sampled token lies in its nucleus
    assert (recorded >= full - 1e-6).all() and (recorded - full).max() > 0.1


def test_seeded_request_does_not_depend_on_its_batch(make_model) -> None:
    model = make_model()
    params = SamplingParams(max_new_tokens=10, eos_id=EOS, seed=11)
    requests = _requests(range(6))
    together = TorchRolloutEngine(model)
    together.add(requests, params)
    alone = TorchRolloutEngine(model)
    alone.add([requests[4]], params)
    a: list[Completion] = []
    b: list[Completion] = []
    _drain(together, a)
    _drain(alone, b)
    np.testing.assert_array_equal(next(c for c in a if c.id == 4).tokens, b[0].tokens)


def test_weight_update_mid_generation_resumes_from_exact_prefix(make_model) -> None:
    old_model = make_model()
    new_model = copy.deepcopy(old_model)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)  # no EOS: all run on
    requests = _requests(range(5))
    steps_before = 6

    # what each request had when the update came: the same seeded requests, aborted there
    probe = TorchRolloutEngine(copy.deepcopy(old_model))
    probe.add(requests, params)
    for _ in range(steps_before):
        probe.step()
    prefixes = {c.id: c for c in probe.abort()}

    engine = TorchRolloutEngine(copy.deepcopy(old_model))
    engine.add(requests, params)
    for _ in range(steps_before):
        assert engine.step() == []
    resumed = engine.update_weights(new_model.named_parameters(), version=1)
    assert resumed == 5 and engine.version == 1 and engine.pending == 5
    out: list[Completion] = []
    _drain(engine, out)
    assert sorted(c.id for c in out) == list(range(5))
    by_id = {c.id: c for c in out}
    for r in requests:
        c, before = by_id[r.id], prefixes[r.id]
        n = len(before.tokens)
        assert n == steps_before and len(c.tokens) == 16
        np.testing.assert_array_equal(c.tokens[:n], before.tokens)  # the exact prefix
        np.testing.assert_array_equal(c.logprobs[:n], before.logprobs)
        np.testing.assert_array_equal(c.versions, [0] * n + [1] * (16 - n))
        # new tokens were sampled with the new weights: their log-probs say so
        lp_new = _recompute(new_model, [r.prompt], [c.tokens], 1.0)[0]
        np.testing.assert_allclose(c.logprobs[n:], lp_new[n:], atol=2e-5)
        lp_old = _recompute(old_model, [r.prompt], [c.tokens], 1.0)[0]
        np.testing.assert_allclose(c.logprobs[:n], lp_old[:n], atol=2e-5)
        assert not np.allclose(c.logprobs[n:], lp_old[n:], atol=1e-3)


def test_resumed_request_continues_a_given_prefix(make_model) -> None:
    engine = TorchRolloutEngine(make_model())
    params = SamplingParams(max_new_tokens=8, eos_id=EOS, seed=2)
    prompt = np.array([5, 6, 7], dtype=np.int64)
    prefix = np.array([8, 9], dtype=np.int64)
    done_prefix = np.array([8, EOS], dtype=np.int64)
    engine.add(
        [
            GenerationRequest(
                0, prompt, prefix, np.array([-1.0, -2.0], np.float32), np.array([4, 5])
            ),
            GenerationRequest(1, prompt, done_prefix, np.zeros(2, np.float32), np.array([4, 4])),
        ],
        params,
    )
    out: list[Completion] = []
    _drain(engine, out)
    by_id = {c.id: c for c in out}
    np.testing.assert_array_equal(by_id[0].tokens[:2], prefix)
    np.testing.assert_array_equal(by_id[0].logprobs[:2], [-1.0, -2.0])
    np.testing.assert_array_equal(by_id[0].versions[:2], [4, 5])
    assert len(by_id[0].tokens) <= 8
    np.testing.assert_array_equal(by_id[1].tokens, done_prefix)  # already ended: as it was


def test_rollout_rejects_bad_requests(make_model) -> None:
    engine = TorchRolloutEngine(make_model())
    params = SamplingParams(max_new_tokens=4)
    engine.add(_requests(range(2)), params)
    with pytest.raises(ConfigError, match="already pending"):
        engine.add(_requests(range(1, 3)), params)
    with pytest.raises(ConfigError, match="exceeds the model's 48 positions"):
        engine.add(_requests(range(5, 6)), SamplingParams(max_new_tokens=47))
    assert engine.pending == 2  # unchanged
    with pytest.raises(ConfigError, match="does not fit the model"):
        engine.load_weights([("nonexistent.weight", torch.zeros(2))])


# --- update engines ----------------------------------------------------------------


def _train_batch(n: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, VOCAB, (int(k),), generator=g)
        for k in torch.randint(2, 6, (n,), generator=g)
    ]
    responses = [
        torch.randint(4, VOCAB, (int(k),), generator=g)
        for k in torch.randint(1, 9, (n,), generator=g)
    ]
    return TrainBatch.pack(prompts, responses, advantages=torch.randn(n, generator=g))


def _nll(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    return -logprobs.mean(), {"tokens": float(batch.n_tokens)}


def test_train_step_lowers_the_loss_of_a_fixed_batch(make_model) -> None:
    engine = TorchUpdateEngine(make_model(), OptimConfig(lr=3e-3))
    batch = _train_batch()
    losses = [engine.train_step(batch.split(2), _nll)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1
    assert engine.version == 8
    assert float(-engine.logprobs(batch).mean()) < losses[0] - 0.1


def test_step_does_not_depend_on_the_micro_batch_split(make_model) -> None:
    model = make_model()
    whole = TorchUpdateEngine(copy.deepcopy(model), OptimConfig(lr=1e-2, max_grad_norm=0.5))
    split = TorchUpdateEngine(copy.deepcopy(model), OptimConfig(lr=1e-2, max_grad_norm=0.5))
    batch = _train_batch()
    for _ in range(3):
        a = whole.train_step([batch], _nll)
        b = split.train_step(batch.split(3), _nll)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["tokens"] == pytest.approx(batch.n_tokens)  # micro-batch metrics, token-weighted
    for (n1, p1), (n2, p2) in zip(whole.named_weights(), split.named_weights(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, atol=1e-4, rtol=0)


def test_named_weights_load_into_a_rollout_engine(make_model) -> None:
    model = make_model()
    trainer = TorchUpdateEngine(copy.deepcopy(model), OptimConfig(lr=1e-2))
    batch = _train_batch()
    trainer.train_step([batch], _nll)
    rollout = TorchRolloutEngine(copy.deepcopy(model))
    rollout.update_weights(trainer.named_weights(), trainer.version)
    assert rollout.version == 1
    requests = _requests(range(4))
    rollout.add(requests, SamplingParams(max_new_tokens=6, seed=0))
    out: list[Completion] = []
    _drain(rollout, out)
    out.sort(key=lambda c: c.id)
    check = TrainBatch.pack([r.prompt for r in requests], [c.tokens for c in out])
    np.testing.assert_allclose(
        trainer.logprobs(check).numpy(), np.concatenate([c.logprobs for c in out]), atol=2e-5
    )


def test_state_dict_round_trips(make_model) -> None:
    model = make_model()
    a = TorchUpdateEngine(copy.deepcopy(model), OptimConfig(lr=1e-2))
    batch = _train_batch()
    a.train_step([batch], _nll)
    b = TorchUpdateEngine(copy.deepcopy(model), OptimConfig(lr=1e-2))
    b.load_state_dict(a.state_dict())
    assert b.version == 1
    assert a.train_step([batch], _nll)["loss"] == pytest.approx(b.train_step([batch], _nll)["loss"])
    with pytest.raises(ConfigError, match="lacks"):
        b.load_state_dict({"model": {}})


def test_train_batch_pack_validates_and_splits() -> None:
    batch = _train_batch(5)
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 3] or [len(p) for p in parts] == [3, 2]
    assert sum(p.n_tokens for p in parts) == batch.n_tokens
    torch.testing.assert_close(torch.cat([p.responses for p in parts]), batch.responses)
    with pytest.raises(ConfigError, match="one value per response token"):
        TrainBatch.pack([[4, 5]], [[6, 7]], old_logprobs=[[0.0]])
    with pytest.raises(ConfigError, match="one float per sample"):
        TrainBatch.pack([[4, 5]], [[6, 7]], advantages=[1.0, 2.0])
    with pytest.raises(ConfigError, match="at least one token"):
        TrainBatch.pack([[]], [[6, 7]])


def test_per_request_draws_follow_the_distribution_and_skip_zero_probability_tokens() -> None:
    """Seeded requests draw by the inverse of their CDF (one uniform from each request's
    own generator) instead of a torch.multinomial per row: the same distribution."""
    from flowrl.engines.torch_rollout import _draw, _Running

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 4000)
    rows = [_Running(None, np.random.default_rng(i)) for i in range(4000)]  # type: ignore[arg-type]
    tokens = _draw(probs, rows).numpy()
    counts = np.bincount(tokens, minlength=6) / tokens.size
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]  # never a token of probability 0
    np.testing.assert_allclose(counts, probs[0].numpy(), atol=0.03)  # 4.4 standard errors
    again = _draw(probs[:3], [_Running(None, np.random.default_rng(i)) for i in range(3)])  # type: ignore[arg-type]
    assert again.tolist() == tokens[:3].tolist()  # each row's own stream

"""TinyLM and its KV-cache sampler: cached decoding equals the full forward, sampler
log-probabilities equal recomputed ones, EOS stops rows and the loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from flowrl.models import GenerationResult, TinyLM, TinyLMConfig, generate, left_pad
from flowrl.rl import build_batch, token_logprobs

VOCAB = 11
EOS = 2


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add sync cost (and stall on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    cfg = TinyLMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
    return TinyLM(cfg).eval()


def _random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_config_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="divisible"):
        TinyLMConfig(vocab_size=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        TinyLMConfig(vocab_size=0)


def test_forward_shape_and_tied_head(model: TinyLM) -> None:
    ids = torch.randint(0, VOCAB, (3, 7))
    assert model(ids).shape == (3, 7, VOCAB)
    # Tied head: the token embedding is the only (vocab, d_model) matrix.
    assert sum(p.shape == (VOCAB, 32) for p in model.parameters()) == 1


def test_left_padding_does_not_change_logits(model: TinyLM) -> None:
    prompts = _random_prompts([3, 7, 5])
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        for i, p in enumerate(prompts):
            alone = model(torch.tensor([p]))[0]
            torch.testing.assert_close(padded[i, -len(p) :], alone, atol=1e-5, rtol=1e-5)


def test_kv_cache_decoding_equals_full_forward(model: TinyLM) -> None:
    prompts = _random_prompts([2, 6, 4], seed=1)
    ids, mask = left_pad(prompts)
    cont = torch.randint(3, VOCAB, (3, 5))
    full_ids = torch.cat([ids, cont], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(cont, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        full = model(full_ids, attention_mask=full_mask)
        cache = model.new_cache(3, full_ids.shape[1])
        keys_ptr = cache.keys.data_ptr()
        steps = [model(ids, attention_mask=mask, cache=cache)]
        for t in range(cont.shape[1]):
            steps.append(model(cont[:, t : t + 1], cache=cache))
    incremental = torch.cat(steps, dim=1)
    real = full_mask
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=1e-5)
    assert cache.keys.data_ptr() == keys_ptr, "cache must be reused, not reallocated"
    assert cache.length == full_ids.shape[1]
    assert cache.positions.tolist() == full_mask.sum(1).tolist()


def test_kv_cache_overflow_or_batch_mismatch_raises_and_leaves_cache_unchanged(
    model: TinyLM,
) -> None:
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="cannot take 1 new tokens"):
            model(torch.ones(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="batch 2"):
            model(torch.ones(2, 1, dtype=torch.long), cache=model.new_cache(1, 4))
    assert cache.length == 4 and cache.positions.tolist() == [4]


def test_positions_beyond_max_seq_len_raise(model: TinyLM) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.ones(1, 33, dtype=torch.long))


def _check_ragged(res: GenerationResult, batch: int, max_new: int) -> None:
    assert res.cu_seqlens.dtype == torch.long and res.cu_seqlens.shape == (batch + 1,)
    assert res.cu_seqlens[0] == 0 and res.cu_seqlens[-1] == res.token_ids.numel()
    assert torch.equal(res.cu_seqlens.diff(), res.lengths)
    assert res.logprobs.dtype == torch.float32 and res.logprobs.shape == res.token_ids.shape
    for row, lp, done in zip(res.responses(), res.response_logprobs(), res.finished, strict=True):
        assert 1 <= row.numel() <= max_new and lp.shape == row.shape
        assert (row[:-1] != EOS).all()
        assert bool(done) == (row[-1].item() == EOS)
        if not done:
            assert row.numel() == max_new
        assert (lp <= 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_recomputed(model: TinyLM, temperature: float) -> None:
    prompts = _random_prompts([1, 4, 9, 3, 6], seed=2)
    gen = torch.Generator().manual_seed(0)
    res = generate(model, prompts, 8, temperature=temperature, eos_id=EOS, generator=gen)
    _check_ragged(res, len(prompts), 8)
    batch = build_batch([torch.tensor(p) for p in prompts], res.responses())
    with torch.no_grad():
        recomputed = token_logprobs(model, *batch, temperature=temperature)
    torch.testing.assert_close(recomputed, res.logprobs, atol=1e-4, rtol=0)


def test_tensor_prompts_match_list_prompts(model: TinyLM) -> None:
    prompts = _random_prompts([5, 2, 7], seed=3)
    padded = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    a = generate(model, prompts, 6, eos_id=EOS, generator=torch.Generator().manual_seed(4))
    b = generate(
        model,
        padded,
        6,
        prompt_lengths=lengths,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(4),
    )
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    torch.testing.assert_close(a.logprobs, b.logprobs)


def test_greedy_is_deterministic(model: TinyLM) -> None:
    prompts = _random_prompts([3, 5], seed=5)
    a = generate(model, prompts, 6, temperature=0.0, eos_id=EOS)
    b = generate(model, prompts, 6, temperature=0.0, eos_id=EOS)
    assert torch.equal(a.token_ids, b.token_ids)


def test_eos_stops_rows_and_the_loop(model: TinyLM) -> None:
    # Make EOS the overwhelming choice everywhere: the head is tied, so bias ln_f's output
    # toward EOS's (enlarged) embedding.
    with torch.no_grad():
        model.tok_emb.weight[EOS] *= 10
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(model.tok_emb.weight[EOS] * 100)
    res = generate(
        model,
        _random_prompts([2, 5, 3]),
        10,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(0),
    )
    assert res.lengths.tolist() == [1, 1, 1]
    assert res.token_ids.tolist() == [EOS, EOS, EOS]
    assert res.finished.all()


def test_rows_without_eos_run_to_max_new_tokens(model: TinyLM) -> None:
    res = generate(
        model,
        _random_prompts([2, 4]),
        5,
        eos_id=VOCAB + 5,  # unreachable id
        generator=torch.Generator().manual_seed(0),
    )
    assert res.lengths.tolist() == [5, 5] and not res.finished.any()


def test_generate_validates_arguments(model: TinyLM) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[3]], 0, eos_id=EOS)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[3], []], 2, eos_id=EOS)
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model, torch.ones(2, 3, dtype=torch.long), 2, eos_id=EOS)

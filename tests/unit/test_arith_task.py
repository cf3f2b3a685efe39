"""The addition task: tokenizer round trips, seeded problem streams, the rule-based
reward on correct / wrong / truncated responses, and the noisy supervised warm-up."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from flowrl.models import TinyLM, TinyLMConfig
from flowrl.tasks import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ArithProblem,
    ArithTask,
    decode,
    encode,
    pretrain,
    verify,
)
from flowrl.tasks.arith import _noisy_answer


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add sync cost (and stall on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_encode_decode_round_trip() -> None:
    ids = encode("12+345=", bos=True, eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert len({PAD_ID, BOS_ID, EOS_ID, *encode("0123456789+=")}) == VOCAB_SIZE
    assert decode(ids) == "12+345="
    assert decode(torch.tensor(ids)) == "12+345="


def test_encode_rejects_unknown_characters() -> None:
    with pytest.raises(ValueError, match="'x'"):
        encode("1x2")


def test_problem_tokens() -> None:
    p = ArithProblem(12, 345)
    assert p.answer == 357
    assert p.prompt_ids == encode("12+345=", bos=True)
    assert p.answer_ids == encode("357", eos=True)


def test_task_is_seeded_and_respects_digit_range() -> None:
    a = ArithTask(digits=(1, 3), seed=7).sample(200)
    b = ArithTask(digits=(1, 3), seed=7).sample(200)
    assert a == b
    assert a != ArithTask(digits=(1, 3), seed=8).sample(200)
    lengths = {len(str(n)) for p in a for n in (p.a, p.b)}
    assert lengths == {1, 2, 3}
    it = iter(ArithTask(digits=(2, 2), seed=0))
    assert all(10 <= n <= 99 for _ in range(50) for p in [next(it)] for n in (p.a, p.b))
    assert ArithTask(digits=(1, 3)).max_response_len == 5  # "1998" + EOS
    with pytest.raises(ValueError, match="digits"):
        ArithTask(digits=(2, 1))


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("357E", 1.0),  # exact answer then EOS
        ("357E12", 1.0),  # anything after the first EOS is ignored
        ("358E", 0.0),  # wrong digit
        ("35E", 0.0),  # too short
        ("0357E", 0.0),  # leading zero is not the canonical answer
        ("357", 0.0),  # truncated: no EOS
        ("E", 0.0),  # empty answer
        ("35+7E", 0.0),  # not a number
    ],
)
def test_verify(response: str, expected: float) -> None:
    prompt = encode("12+345=", bos=True)
    ids = encode(response.split("E")[0]) + ([EOS_ID] if "E" in response else [])
    if "E" in response:
        ids += encode(response.split("E", 1)[1])
    assert verify(prompt, ids) == expected
    assert verify(torch.tensor(prompt), torch.tensor(ids, dtype=torch.long)) == expected


def test_verify_format_reward_is_partial_credit_for_well_formed_wrong_answers() -> None:
    prompt = encode("1+1=", bos=True)
    assert verify(prompt, encode("3", eos=True), format_reward=0.1) == 0.1
    assert verify(prompt, encode("3"), format_reward=0.1) == 0.0
    assert verify(prompt, encode("2", eos=True), format_reward=0.1) == 1.0


def test_verify_rejects_malformed_prompts() -> None:
    with pytest.raises(ValueError, match="prompt"):
        verify(encode("12+", bos=True), encode("1", eos=True))


def test_noisy_answers_keep_the_format_and_are_always_wrong_at_full_noise() -> None:
    rng = random.Random(0)
    for p in ArithTask(seed=1).sample(200):
        noisy = _noisy_answer(p, 1.0, rng)
        assert verify(p.prompt_ids, noisy) == 0.0
        assert verify(p.prompt_ids, noisy, format_reward=0.5) == 0.5
        assert len(noisy) == len(p.answer_ids)
        assert _noisy_answer(p, 0.0, rng) == p.answer_ids


def test_pretrain_lowers_the_loss() -> None:
    torch.manual_seed(0)
    model = TinyLM(
        TinyLMConfig(
            vocab_size=VOCAB_SIZE, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16
        )
    )
    losses = pretrain(model, ArithTask(digits=(1, 1), seed=0), 30, batch_size=32, noise=0.0)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    with pytest.raises(ValueError, match="noise"):
        pretrain(model, ArithTask(), 1, noise=1.5)

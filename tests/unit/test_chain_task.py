"""The chain-sum task: its worked solutions, the strict verifier, the heavy-tailed spread
of its response lengths (the long tail the disaggregated placement hides), and the noisy
warm-up targets."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flowrl.tasks import EOS_ID, ChainProblem, ChainTask, decode, encode


def test_the_worked_solution_is_the_running_sums() -> None:
    problem = ChainProblem((3, 5, 2, 8))
    assert decode(problem.prompt_ids) == "3+5+2+8="
    assert problem.answer_ids == encode("8=10=18", eos=True)


def test_only_the_exact_worked_solution_is_rewarded() -> None:
    task = ChainTask()
    prompt = ChainProblem((3, 5, 2, 8)).prompt_ids
    assert task.verify(prompt, encode("8=10=18", eos=True)) == 1.0
    assert task.verify(prompt, [*encode("8=10=18", eos=True), EOS_ID, 5]) == 1.0  # after EOS
    assert task.verify(prompt, encode("8=11=18", eos=True)) == 0.0  # a wrong step
    assert task.verify(prompt, encode("18", eos=True)) == 0.0  # no work shown
    assert task.verify(prompt, encode("8=10=18")) == 0.0  # truncated: no EOS
    assert task.verify(prompt, encode("8=10=018", eos=True)) == 0.0  # a leading zero


def test_a_prompt_that_is_not_a_chain_sum_is_refused() -> None:
    with pytest.raises(ValueError, match="'12\\+345='"):
        ChainTask().verify(encode("12+345=", bos=True), encode("357", eos=True))


def test_the_stream_is_seeded() -> None:
    assert ChainTask(seed=3).sample(20) == ChainTask(seed=3).sample(20)
    assert ChainTask(seed=3).sample(20) != ChainTask(seed=4).sample(20)


def test_response_lengths_are_heavy_tailed_within_the_bounds() -> None:
    task = ChainTask(seed=0)
    problems = task.sample(4000)
    lengths = np.array([len(p.answer_ids) for p in problems])
    assert lengths.min() >= 2 and lengths.max() <= task.max_response_len
    assert max(len(p.prompt_ids) for p in problems) <= task.max_prompt_len
    p10, median, p90, p99 = np.percentile(lengths, [10, 50, 90, 99])
    assert lengths.max() / lengths.min() >= 10  # the ~10x spread the issue asks for
    assert p99 / median >= 5 and p90 / p10 >= 5
    assert median <= 10  # most are short: the long ones are a tail
    assert all(task.verify(p.prompt_ids, p.answer_ids) == 1.0 for p in problems[:200])


def test_noisy_answers_keep_the_format_and_are_wrong_at_full_noise() -> None:
    task, rng = ChainTask(seed=1), random.Random(0)
    for problem in task.sample(200):
        noisy = task.noisy_answer(problem, 1.0, rng)
        assert len(noisy) == len(problem.answer_ids) and noisy[-1] == EOS_ID
        assert task.verify(problem.prompt_ids, noisy) == 0.0
        assert all(not n.startswith("0") or n == "0" for n in decode(noisy).split("="))
        assert task.noisy_answer(problem, 0.0, rng) == problem.answer_ids


@pytest.mark.parametrize("kwargs", [{"max_terms": 1}, {"max_terms": 2.5}, {"alpha": -1.0}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="ChainTask"):
        ChainTask(**kwargs)  # type: ignore[arg-type]

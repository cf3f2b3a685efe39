"""Chain sums: multi-step addition with a worked solution, its lengths heavy-tailed.

A problem adds ``k`` one-digit numbers: the prompt is ``BOS "3+5+2+8="`` and the correct
response is the worked solution, the running sum after each addition joined by ``=``:
``"8=10=18" EOS``. The number of terms ``k`` is drawn from ``[2, max_terms]`` with
probability proportional to ``k ** -alpha`` (a truncated power law), so most problems are
short and a few are long: with the defaults (16 terms at most, alpha 1.5) a response is 2
to 50 tokens, median 7 and 99th percentile 44 (``tests/unit/test_chain_task.py`` checks
the spread). That is the long tail of real reasoning traces: one long response holds back
the micro-batch it is sampled in.

The tokenizer is the addition task's (``flowrl.tasks.arith``: digits, ``+``, ``=``), so a
model of that vocabulary learns either task.

Reward (:meth:`ChainTask.verify`): 1.0 when the response, up to its first EOS, is exactly
the worked solution (every running sum right, in decimal without leading zeros); 0.0
otherwise, including a right final sum reached through a wrong step and a truncated
response without EOS.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from torch import Tensor

from flowrl.tasks.arith import EOS_ID, decode, encode, noisy_digits

__all__ = ["ChainProblem", "ChainTask"]

_PROMPT_RE = re.compile(r"\d(?:\+\d)+=")


@final
@dataclass(frozen=True)
class ChainProblem:
    """One chain sum: its terms (one digit each, at least two)."""

    terms: tuple[int, ...]

    @property
    def running_sums(self) -> list[int]:
        """The sum after each addition; the last is the answer."""
        return list(itertools.accumulate(self.terms))[1:]

    @property
    def prompt_ids(self) -> list[int]:
        """``BOS t1 + t2 + ... + tk =`` as token ids."""
        return encode("+".join(map(str, self.terms)) + "=", bos=True)

    @property
    def answer_ids(self) -> list[int]:
        """The worked solution: the running sums joined by ``=``, then EOS."""
        return encode("=".join(map(str, self.running_sums)), eos=True)


@final
class ChainTask:
    """An endless, seeded stream of chain sums with heavy-tailed lengths (module doc)."""

    def __init__(self, *, max_terms: int = 16, alpha: float = 1.5, seed: int = 0) -> None:
        if not isinstance(max_terms, int) or isinstance(max_terms, bool) or max_terms < 2:
            raise ValueError(f"ChainTask max_terms expects an int >= 2, got {max_terms!r}")
        if not alpha >= 0:
            raise ValueError(f"ChainTask alpha expects a number >= 0, got {alpha!r}")
        self.max_terms = max_terms
        self.alpha = alpha
        self._counts = list(range(2, max_terms + 1))
        self._weights = [k**-alpha for k in self._counts]
        self._rng = random.Random(seed)

    def sample(self, n: int) -> list[ChainProblem]:
        """The next ``n`` problems of the stream."""
        ks = self._rng.choices(self._counts, self._weights, k=n)
        return [ChainProblem(tuple(self._rng.randint(0, 9) for _ in range(k))) for k in ks]

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens: BOS, the terms, the ``+`` between them and ``=``."""
        return 2 * self.max_terms + 1

    @property
    def max_response_len(self) -> int:
        """Longest worked solution in tokens (every term a 9), EOS included."""
        return len(ChainProblem((9,) * self.max_terms).answer_ids)

    def verify(
        self, prompt_ids: Sequence[int] | Tensor, response_ids: Sequence[int] | Tensor
    ) -> float:
        """Rule-based reward of ``response_ids`` for the problem in ``prompt_ids`` (module doc)."""
        text = decode(prompt_ids)
        if _PROMPT_RE.fullmatch(text) is None:
            raise ValueError(f"ChainTask.verify expects a prompt like BOS '3+5+2=', got {text!r}")
        response = response_ids.tolist() if isinstance(response_ids, Tensor) else list(response_ids)
        if EOS_ID not in response:
            return 0.0
        problem = ChainProblem(tuple(int(c) for c in text[:-1].split("+")))
        return 1.0 if response[: response.index(EOS_ID) + 1] == problem.answer_ids else 0.0

    def noisy_answer(self, problem: ChainProblem, noise: float, rng: random.Random) -> list[int]:
        """The worked solution, with probability ``noise`` one digit of one running sum
        replaced by a different digit (the warm-up's noisy targets)."""
        sums = [str(s) for s in problem.running_sums]
        if rng.random() < noise:
            i = rng.randrange(len(sums))
            sums[i] = noisy_digits(sums[i], rng)
        return encode("=".join(sums), eos=True)

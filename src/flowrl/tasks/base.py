"""What the GRPO job needs of a task: problems as token ids and a rule-based reward.

:class:`~flowrl.tasks.ArithTask` (addition) and :class:`~flowrl.tasks.ChainTask` (chain
sums with heavy-tailed worked solutions) implement it; the job and the supervised warm-up
(:func:`~flowrl.tasks.pretrain`) see a task only through it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

from torch import Tensor

__all__ = ["Problem", "Task"]


class Problem(Protocol):
    """One problem: its prompt and its correct response, as token ids."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def answer_ids(self) -> list[int]: ...


P = TypeVar("P", bound=Problem)


class Task(Protocol[P]):
    """An endless, seeded stream of verifiable problems of type ``P``."""

    def sample(self, n: int) -> Sequence[P]:
        """The next ``n`` problems of the stream."""
        ...

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens, BOS included."""
        ...

    @property
    def max_response_len(self) -> int:
        """Longest correct response in tokens, EOS included."""
        ...

    def verify(
        self, prompt_ids: Sequence[int] | Tensor, response_ids: Sequence[int] | Tensor
    ) -> float:
        """The reward of ``response_ids`` for the problem in ``prompt_ids``."""
        ...

    def noisy_answer(self, problem: P, noise: float, rng: random.Random) -> list[int]:
        """The correct response, corrupted with probability ``noise`` (warm-up targets)."""
        ...

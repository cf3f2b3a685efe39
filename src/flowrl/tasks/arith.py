"""Multi-digit addition: a verifiable synthetic task with a character-level tokenizer.

A problem is ``BOS "12+345="``; its correct response is ``"357" EOS``. Operands get a
number of digits drawn uniformly from ``digits`` (one-digit numbers include 0), then a
value uniformly among numbers of that many digits.

Reward (:func:`verify`): 1.0 when the response, up to its first EOS, is exactly the
decimal sum (no leading zeros) and an EOS is present; ``format_reward`` (default 0.0,
i.e. no partial credit) when it is a well-formed but wrong number followed by EOS; 0.0
otherwise, including truncated responses without EOS.

:func:`pretrain` is a short supervised warm-up on *noisy* answers: with probability
``noise`` one digit of the target is replaced by a different digit. A model fit to that
data samples the right answer only part of the time, which gives GRPO a low but
non-zero starting reward to improve on.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowrl.models.causal import as_causal_lm
from flowrl.tasks.base import Task

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ArithProblem",
    "ArithTask",
    "decode",
    "encode",
    "pretrain",
    "verify",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
_CHARS = "0123456789+="
_CHAR_TO_ID = {c: i + 3 for i, c in enumerate(_CHARS)}
_ID_TO_CHAR = {i: c for c, i in _CHAR_TO_ID.items()}
VOCAB_SIZE = 3 + len(_CHARS)
_PROMPT_RE = re.compile(r"(\d+)\+(\d+)=")


def encode(text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """Token ids of ``text`` (characters among ``0-9+=``), optionally framed by BOS/EOS."""
    try:
        ids = [_CHAR_TO_ID[c] for c in text]
    except KeyError as exc:
        raise ValueError(
            f"encode() got character {exc.args[0]!r} in {text!r}; the arith tokenizer "
            f"only knows {_CHARS!r}"
        ) from None
    return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])


def decode(ids: Sequence[int] | Tensor) -> str:
    """Text of ``ids``; special tokens are dropped, unknown ids become ``?``."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    return "".join(
        _ID_TO_CHAR.get(int(i), "?") for i in values if i not in (PAD_ID, BOS_ID, EOS_ID)
    )


@final
@dataclass(frozen=True)
class ArithProblem:
    """One addition problem with its tokenized prompt and reference response."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        """The correct sum."""
        return self.a + self.b

    @property
    def prompt_ids(self) -> list[int]:
        """``BOS a + b =`` as token ids."""
        return encode(f"{self.a}+{self.b}=", bos=True)

    @property
    def answer_ids(self) -> list[int]:
        """The correct response: the sum's digits then EOS."""
        return encode(str(self.answer), eos=True)


@final
class ArithTask:
    """An endless, seeded stream of addition problems."""

    def __init__(self, digits: tuple[int, int] = (1, 3), seed: int = 0) -> None:
        lo, hi = digits
        if not 1 <= lo <= hi:
            raise ValueError(f"ArithTask digits expects 1 <= lo <= hi, got {digits!r}")
        self.digits = (lo, hi)
        self._rng = random.Random(seed)

    def _number(self) -> int:
        n = self._rng.randint(*self.digits)
        low = 0 if n == 1 else 10 ** (n - 1)
        return self._rng.randint(low, 10**n - 1)

    def sample(self, n: int) -> list[ArithProblem]:
        """The next ``n`` problems of the stream."""
        return [ArithProblem(self._number(), self._number()) for _ in range(n)]

    def __iter__(self) -> Iterator[ArithProblem]:
        while True:
            yield ArithProblem(self._number(), self._number())

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens: BOS, two addends and ``+``, ``=``."""
        return 2 * self.digits[1] + 3

    @property
    def max_response_len(self) -> int:
        """Longest correct response in tokens: digits of the largest sum, plus EOS."""
        return len(str(2 * (10 ** self.digits[1] - 1))) + 1

    def verify(
        self, prompt_ids: Sequence[int] | Tensor, response_ids: Sequence[int] | Tensor
    ) -> float:
        """:func:`verify` (the task interface :class:`flowrl.tasks.Task`)."""
        return verify(prompt_ids, response_ids)

    def noisy_answer(self, problem: ArithProblem, noise: float, rng: random.Random) -> list[int]:
        """The answer, with probability ``noise`` one digit replaced (the warm-up's targets)."""
        return _noisy_answer(problem, noise, rng)


def verify(
    prompt_ids: Sequence[int] | Tensor,
    response_ids: Sequence[int] | Tensor,
    *,
    format_reward: float = 0.0,
) -> float:
    """Rule-based reward of ``response_ids`` for the problem in ``prompt_ids`` (see module doc)."""
    match = _PROMPT_RE.fullmatch(decode(prompt_ids))
    if match is None:
        raise ValueError(
            f"verify() expects a prompt like BOS '12+345=', got {decode(prompt_ids)!r}"
        )
    response = response_ids.tolist() if isinstance(response_ids, Tensor) else list(response_ids)
    if EOS_ID not in response:
        return 0.0
    body = response[: response.index(EOS_ID)]
    if not body or any(i not in _ID_TO_CHAR or not _ID_TO_CHAR[i].isdigit() for i in body):
        return 0.0
    expected = str(int(match[1]) + int(match[2]))
    return 1.0 if decode(body) == expected else format_reward


def noisy_digits(number: str, rng: random.Random) -> str:
    """``number`` (decimal digits) with one digit replaced by a different one, never
    giving it a leading zero."""
    digits = list(number)
    pos = rng.randrange(len(digits))
    low = 1 if pos == 0 and len(digits) > 1 else 0
    digits[pos] = rng.choice([str(d) for d in range(low, 10) if str(d) != digits[pos]])
    return "".join(digits)


def _noisy_answer(problem: ArithProblem, noise: float, rng: random.Random) -> list[int]:
    answer = str(problem.answer)
    if rng.random() < noise:
        answer = noisy_digits(answer, rng)
    return encode(answer, eos=True)


def pretrain(
    model: nn.Module,
    task: Task[Any],
    steps: int,
    *,
    batch_size: int = 128,
    lr: float = 3e-3,
    noise: float = 0.5,
    seed: int = 0,
    on_step: Callable[[], object] | None = None,
) -> list[float]:
    """Supervised warm-up on noisy answers (loss on response tokens only); returns losses.

    AdamW at ``lr`` with a short linear warm-up and cosine decay to ``lr / 10``.
    ``on_step`` is called after every step (e.g. a progress bar's ``update``).

    ``model``: a :class:`~flowrl.models.TinyLM` or a ``transformers`` causal LM, called
    through :func:`~flowrl.models.as_causal_lm`.
    """

    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"pretrain expects 0 <= noise <= 1, got {noise}")
    rng = random.Random(seed)
    lm = as_causal_lm(model)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(20, max(steps // 10, 1))

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 10 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        rows, targets = [], []
        for problem in task.sample(batch_size):
            prompt = problem.prompt_ids
            answer = task.noisy_answer(problem, noise, rng)
            rows.append(prompt + answer)
            targets.append([-100] * (len(prompt) - 1) + answer)
        width = max(map(len, rows))
        ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
        labels = torch.full((batch_size, width - 1), -100, dtype=torch.long)
        for i, (row, tgt) in enumerate(zip(rows, targets, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, : len(tgt)] = torch.tensor(tgt)
        ids, labels = ids.to(device), labels.to(device)
        logits = lm(ids, attention_mask=ids != PAD_ID)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step()
    return losses

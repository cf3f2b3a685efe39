"""Verifiable synthetic tasks generated in code, with rule-based rewards (``Task``)."""

from flowrl.tasks.arith import (
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
from flowrl.tasks.base import Problem, Task
from flowrl.tasks.chain import ChainProblem, ChainTask

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ArithProblem",
    "ArithTask",
    "ChainProblem",
    "ChainTask",
    "Problem",
    "Task",
    "decode",
    "encode",
    "pretrain",
    "verify",
]

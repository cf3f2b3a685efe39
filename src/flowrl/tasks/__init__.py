"""Verifiable synthetic tasks generated in code, with rule-based rewards."""

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

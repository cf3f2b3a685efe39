"""DeepSpeed ZeRO-1/2/3 on two CPU ranks (gloo on loopback) trains like the torch engine.

Two spawned processes each train on their half of a fixed batch (split again into
micro-batches) through stages 1, 2 and 3 in turn; every stage's loss trajectory and
gathered weights must match :class:`TorchUpdateEngine` on the whole batch in one process,
and ZeRO-3's ``named_weights`` must be the full tensors. Skipped without deepspeed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

STAGES = (1, 2, 3)
STEPS = 3


def _model() -> torch.nn.Module:
    from flowrl.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64, max_seq_len=32))


def _batch() -> Any:
    from flowrl.engines import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (8,), generator=g)
    prompts = [torch.randint(4, 16, (3,), generator=g) for _ in range(8)]
    responses = [torch.randint(4, 16, (int(n),), generator=g) for n in lengths]
    return TrainBatch.pack(prompts, responses)


def _nll(logprobs: torch.Tensor, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    return -logprobs.mean(), {}


def _optim() -> Any:
    from flowrl.engines import OptimConfig

    return OptimConfig(lr=1e-2, max_grad_norm=0.5)


def _rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from flowrl.engines import DeepSpeedUpdateEngine

    mine = _batch().split(2)[rank].split(2)
    for stage in STAGES:
        engine = DeepSpeedUpdateEngine(_model(), _optim(), zero_stage=stage)
        losses = [engine.train_step(mine, _nll)["loss"] for _ in range(STEPS)]
        weights = {n: t.numpy().copy() for n, t in engine.named_weights()}
        if rank == 0:
            out.put((stage, losses, weights, engine.version))
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_zero_stages_match_the_torch_engine() -> None:
    from flowrl.engines import TorchUpdateEngine

    torch.set_num_threads(1)
    reference = TorchUpdateEngine(_model(), _optim())
    expected = [reference.train_step([_batch()], _nll)["loss"] for _ in range(STEPS)]
    assert expected[-1] < expected[0]
    want = {n: t.numpy() for n, t in reference.named_weights()}

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        results = [out.get(timeout=400) for _ in STAGES]
        for p in ranks:
            p.join(60)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for stage, losses, weights, version in results:
        assert version == STEPS, stage
        assert losses == pytest.approx(expected, abs=1e-4), stage
        assert weights.keys() == want.keys(), stage
        for name, w in want.items():
            assert weights[name].shape == w.shape, (stage, name)  # full, even under ZeRO-3
            torch.testing.assert_close(
                torch.from_numpy(weights[name]), torch.from_numpy(w), atol=5e-4, rtol=0
            )

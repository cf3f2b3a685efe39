"""DeepSpeed ZeRO-1/2/3 on two CPU ranks (gloo on loopback) trains like the torch engine
and resumes from its state exactly.

Two spawned processes each train on their half of a fixed batch (split again into
micro-batches) through stages 1, 2 and 3 in turn; every stage's loss trajectory and
gathered weights must match :class:`TorchUpdateEngine` on the whole batch in one process,
and ZeRO-3's ``named_weights`` must be the full tensors. Under ZeRO-1 and ZeRO-3 each rank
also saves its ``state_dict()`` after the first step (through ``torch.save`` /
``torch.load(weights_only=True)``), restores it into a fresh engine and trains the
remaining steps: losses and weights must be the uninterrupted run's. Before that, rank 1
is handed rank 0's shard: both ranks must refuse (rank 0 too, instead of waiting for rank
1 in a collective, which is how a bad restore used to hang). Skipped without deepspeed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import re
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

STAGES = (1, 2, 3)
RESTORED_STAGES = (1, 3)
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
        losses = [engine.train_step(mine, _nll)["loss"]]
        saved = _through_a_file(engine.state_dict())  # a checkpoint after the first step
        losses += [engine.train_step(mine, _nll)["loss"] for _ in range(STEPS - 1)]
        weights = _numpy(engine.named_weights())
        version = engine.version
        engine.close()
        restored = None
        if stage in RESTORED_STAGES:
            resumed = DeepSpeedUpdateEngine(_model(), _optim(), zero_stage=stage)
            refusal = _refusal(resumed, _as_rank_zeros(saved) if rank == 1 else saved)
            resumed.load_state_dict(saved)
            later = [resumed.train_step(mine, _nll)["loss"] for _ in range(STEPS - 1)]
            restored = (refusal, later, _numpy(resumed.named_weights()), resumed.version)
            resumed.close()
        out.put((rank, stage, losses, weights, version, restored))


def _numpy(weights: Any) -> dict[str, Any]:
    return {n: t.numpy().copy() for n, t in weights}


def _through_a_file(state: dict[str, Any]) -> dict[str, Any]:
    from flowrl.engines.deepspeed import checkpoint_globals

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(checkpoint_globals()):
        return dict(torch.load(buffer, weights_only=True))


def _as_rank_zeros(state: dict[str, Any]) -> dict[str, Any]:
    """The state as if rank 0 had saved it (what loading rank 0's file on rank 1 gives)."""
    return {**state, "optimizer": {**state["optimizer"], "rank": 0}}


def _refusal(engine: Any, state: dict[str, Any]) -> str | None:
    from flowrl.errors import ConfigError

    try:
        engine.load_state_dict(state)
    except ConfigError as exc:
        return str(exc)
    return None


def test_zero_stages_match_the_torch_engine() -> None:
    from flowrl.engines import TorchUpdateEngine
    from flowrl.engines._distributed import free_port

    torch.set_num_threads(1)
    reference = TorchUpdateEngine(_model(), _optim())
    expected = [reference.train_step([_batch()], _nll)["loss"] for _ in range(STEPS)]
    assert expected[-1] < expected[0]
    want = {n: t.numpy() for n, t in reference.named_weights()}

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        results = [out.get(timeout=400) for _ in range(2 * len(STAGES))]
        for p in ranks:
            p.join(60)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank, stage, losses, weights, version, restored in results:
        assert version == STEPS, stage
        assert losses == pytest.approx(expected, abs=1e-4), stage
        _assert_weights(weights, want, stage, atol=5e-4)
        if stage not in RESTORED_STAGES:
            assert restored is None
            continue
        refusal, later, weights_after, version_after = restored
        if rank == 1:
            assert refusal is not None and "got rank 0's optimizer shard" in refusal
        else:
            assert refusal is not None and "1 other rank(s) refused" in refusal
        assert version_after == STEPS, stage
        assert later == pytest.approx(losses[1:], abs=1e-6), stage  # the run not interrupted
        _assert_weights(weights_after, weights, stage, atol=1e-6)


def _assert_weights(got: dict[str, Any], want: dict[str, Any], stage: int, atol: float) -> None:
    assert got.keys() == want.keys(), stage
    for name, w in want.items():
        assert got[name].shape == w.shape, (stage, name)  # full, even under ZeRO-3
        torch.testing.assert_close(
            torch.from_numpy(got[name]), torch.from_numpy(w), atol=atol, rtol=0
        )


def test_a_state_from_another_setup_is_refused_and_changes_nothing() -> None:
    # One rank in this process: the ZeRO-1 state of a 2-rank run, a ZeRO-3 state, and a
    # bare optimizer state (the format before shards were labelled) are each refused.
    from flowrl.engines import DeepSpeedUpdateEngine
    from flowrl.errors import ConfigError

    torch.set_num_threads(1)
    engine = DeepSpeedUpdateEngine(_model(), _optim(), zero_stage=1)
    try:
        engine.train_step([_batch()], _nll)
        state = engine.state_dict()
        before = _numpy(engine.named_weights())
        label = state["optimizer"]
        cases = {
            "saved by 2 rank(s) under ZeRO-1, this engine runs 1 under ZeRO-1": {
                **label,
                "world_size": 2,
            },
            "saved by 1 rank(s) under ZeRO-3, this engine runs 1 under ZeRO-1": {
                **label,
                "zero_stage": 3,
            },
            "the optimizer entry is not a DeepSpeedUpdateEngine shard": label["shard"],
        }
        for says, optimizer in cases.items():
            fresh = {n: w * 0 for n, w in state["model"].items()}
            with pytest.raises(ConfigError, match=re.escape(says)):
                engine.load_state_dict({"model": fresh, "optimizer": optimizer, "version": 9})
        assert engine.version == 1
        after = _numpy(engine.named_weights())
        assert all((after[n] == before[n]).all() for n in before)  # nothing loaded
        engine.load_state_dict(state)  # its own state still loads
    finally:
        engine.close()

"""A rollout engine in another process picks up a published weight version between
decoding steps, without dropping its running requests."""

from __future__ import annotations

import multiprocessing as mp
import secrets
from typing import Any

import numpy as np
import pytest
import torch

import flowrl

pytestmark = pytest.mark.integration


def _model(seed: int) -> torch.nn.Module:
    from flowrl.models import TinyLM, TinyLMConfig

    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64, max_seq_len=80))


def _rollout(channel: str, started: Any, published: Any, out: Any) -> None:
    torch.set_num_threads(1)
    from flowrl.engines import GenerationRequest, SamplingParams, TorchRolloutEngine

    engine = TorchRolloutEngine(_model(0))
    sub = flowrl.WeightSubscriber(channel)
    prompts = [np.array([4, 5, 6 + i], dtype=np.int64) for i in range(3)]
    engine.add(
        [GenerationRequest(i, p) for i, p in enumerate(prompts)],
        SamplingParams(max_new_tokens=60, seed=0),
    )
    done = engine.step()
    started.set()
    published.wait(60)  # the update lands while every request is running
    while engine.pending:
        sub.sync(engine)  # loads a newer version, if any, between two steps
        done += engine.step()
    weights = {n: p.detach().numpy().copy() for n, p in engine.model.named_parameters()}
    sub.close()
    out.put(([(c.id, c.versions.tolist()) for c in done], weights))


def test_rollout_process_loads_a_published_version_mid_stream() -> None:
    channel = f"test-{secrets.token_hex(4)}"
    ctx = mp.get_context("spawn")
    started, published, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_rollout, args=(channel, started, published, out))
    child.start()
    pub = flowrl.WeightPublisher(channel)
    try:
        assert started.wait(120)
        new = _model(1)
        pub.publish(new.named_parameters(), version=1)
        published.set()
        completions, weights = out.get(timeout=120)
        child.join(30)
    finally:
        pub.close()
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert sorted(i for i, _ in completions) == [0, 1, 2]
    for _, versions in completions:
        assert len(versions) == 60
        assert versions[0] == 0 and versions[-1] == 1  # started on v0, finished on v1
        assert versions == sorted(versions)
    for name, p in new.named_parameters():
        np.testing.assert_array_equal(weights[name], p.detach().numpy())

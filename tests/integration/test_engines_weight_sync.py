"""A rollout engine in another process picks up a published weight version between
decoding steps, without dropping its running requests; SIGKILLed publishers leave
nothing behind once a new one starts."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
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


def _publish_forever(channel: str, numel: int, ready: Any) -> None:
    """A trainer that publishes version after version until it is killed: each version's
    every element equals the version."""
    torch.set_num_threads(1)
    pub = flowrl.WeightPublisher(channel)
    weights = torch.empty(numel)
    version = 0
    while True:
        version += 1
        weights.fill_(float(version))
        pub.publish([("w", weights)], version=version)
        if version == 3:
            ready.set()


def _channel_files(channel: str) -> list[str]:
    return sorted(e.name for e in os.scandir("/dev/shm") if channel in e.name)


def test_a_restarted_publisher_reclaims_what_killed_ones_left() -> None:
    """Issue 26, item 2: SIGKILLed publishers (mid-write, 32 MB versions) left their
    arenas in /dev/shm for ever; now each new publisher of the channel removes its dead
    predecessor's, keeping the last complete version readable until it publishes. A
    subscriber reading through the kills never sees a torn version."""
    channel = f"test-{secrets.token_hex(4)}"
    numel = 8 << 20  # 32 MB of float32
    ctx = mp.get_context("spawn")
    sub = flowrl.WeightSubscriber(channel)
    most = 0
    try:
        for _ in range(5):
            ready = ctx.Event()
            child = ctx.Process(target=_publish_forever, args=(channel, numel, ready))
            child.start()
            assert ready.wait(120)
            with sub.poll() as snap:  # read while the publisher goes on writing
                w = dict(snap.tensors())["w"]
                assert w.min() == w.max() == snap.version  # complete, never torn
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
            most = max(most, len(_channel_files(channel)))
        left = _channel_files(channel)
        assert any(n.endswith(".arena") for n in left)  # the last one's, not removed
        last = sub.poll()
        assert last is not None
        last.release()
        pub = flowrl.WeightPublisher(channel)  # reclaims: only the newest version stays
        assert sorted(n.rsplit(".", 1)[1] for n in _channel_files(channel)) == [
            "arena",
            "header",
            "lock",
        ]
        with sub.poll() as snap:  # still readable, whole
            assert snap.version == last.version
            w = dict(snap.tensors())["w"]
            assert w.min() == w.max() == last.version
        pub.publish([("w", torch.zeros(4))], version=last.version + 1)
        assert sub.poll().version == last.version + 1
        sub.release()
        assert len(_channel_files(channel)) <= 4  # lock, header, its own two arenas
        pub.close()
    finally:
        sub.close()
    assert _channel_files(channel) == []
    # a killed publisher holds at most 2 arenas, a header draft, the header and the lock;
    # with its dead predecessor's newest version kept: one more
    assert most <= 6

"""Weight sync through the Ray object store: a rollout engine in an actor on another node
of a local 3-node cluster loads versions a publisher in the driver puts, between decoding
steps and without dropping its running requests; the transfer dtype; a closed publisher."""

from __future__ import annotations

import secrets
import sys
from typing import Any

import numpy as np
import pytest
import torch

import flowrl
from flowrl.errors import ConfigError

pytestmark = [pytest.mark.integration, pytest.mark.ray]

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests


def _model(seed: int) -> torch.nn.Module:
    from flowrl.models import TinyLM, TinyLMConfig

    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64, max_seq_len=40))


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout engine that syncs weights from ``channel`` between its decoding steps."""

    def __init__(self, channel: str) -> None:
        from flowrl.engines import GenerationRequest, SamplingParams, TorchRolloutEngine

        torch.set_num_threads(1)
        self.node = ray.get_runtime_context().get_node_id()
        self.engine = TorchRolloutEngine(_model(0))
        self.sub = flowrl.RayWeightSubscriber(channel)
        self.done: list[Any] = []
        prompts = [np.array([4, 5, 6 + i], dtype=np.int64) for i in range(3)]
        self.engine.add(
            [GenerationRequest(i, p) for i, p in enumerate(prompts)],
            SamplingParams(max_new_tokens=30, seed=0),
        )

    def step(self, n: int) -> tuple[str, int, bool]:
        """``n`` decoding steps, syncing before each; where it runs, its version, and
        whether a sync found nothing to load (a poll before any publish)."""
        loaded = False
        for _ in range(n):
            loaded |= self.sub.sync(self.engine)
            self.done += self.engine.step()
        return self.node, self.engine.version, loaded

    def finish(self) -> tuple[list[tuple[int, list[int]]], dict[str, np.ndarray]]:
        while self.engine.pending:
            self.sub.sync(self.engine)
            self.done += self.engine.step()
        self.sub.close()
        weights = {n: p.detach().numpy().copy() for n, p in self.engine.model.named_parameters()}
        return [(c.id, c.versions.tolist()) for c in self.done], weights


@pytest.fixture(scope="module")
def cluster(ray_runtime: Any) -> Any:
    return ray_runtime.cluster()


def test_rollout_on_another_node_loads_each_version_mid_stream(cluster: Any) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    channel = f"test-{secrets.token_hex(4)}"
    here = ray.get_runtime_context().get_node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    rollout = Rollout.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False)
    ).remote(channel)
    pub = flowrl.RayWeightPublisher(channel)
    try:
        node, version, loaded = ray.get(rollout.step.remote(2), timeout=120)
        assert node == other and version == 0 and not loaded  # nothing published yet
        with pytest.raises(ConfigError, match="already has a publisher"):
            flowrl.RayWeightPublisher(channel)
        pub.publish(_model(1).named_parameters(), version=1)
        assert ray.get(rollout.step.remote(3), timeout=120)[1:] == (1, True)
        newest = _model(2)
        pub.publish_async(newest.named_parameters(), version=2).result(timeout=120)
        completions, weights = ray.get(rollout.finish.remote(), timeout=120)
    finally:
        pub.close()
        ray.kill(rollout)
    assert sorted(i for i, _ in completions) == [0, 1, 2]
    for _, versions in completions:  # two steps of v0, three of v1, the rest v2
        assert versions == [0] * 2 + [1] * 3 + [2] * 25
    for name, p in newest.named_parameters():
        np.testing.assert_array_equal(weights[name], p.detach().numpy())


def test_transfer_dtype_and_a_closed_publisher(cluster: Any) -> None:
    channel = f"test-{secrets.token_hex(4)}"
    pub = flowrl.RayWeightPublisher(channel, dtype=torch.bfloat16)
    sub = flowrl.RayWeightSubscriber(channel)
    weights = [("w", torch.randn(3, 5)), ("count", torch.arange(4)), ("empty", torch.zeros(0))]
    try:
        pub.publish(weights, version=1)
        with sub.poll() as snap:
            got = dict(snap.tensors())
        assert got["w"].dtype == torch.bfloat16
        assert torch.equal(got["w"], weights[0][1].to(torch.bfloat16))
        assert torch.equal(got["count"], weights[1][1]) and got["empty"].shape == (0,)
        assert sub.poll(have=1) is None
    finally:
        pub.close()
    assert sub.poll() is None  # the publisher is gone: nothing newer
    sub.close()

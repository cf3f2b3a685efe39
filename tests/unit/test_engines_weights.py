"""Weight sync through shared memory (WeightPublisher / WeightSubscriber) in one process:
versions, reused arenas, torn-read safety, the transfer dtype, asynchronous publish; and
the Hugging Face model's save / load round trip. The cross-process case is in
tests/integration/test_engines_weight_sync.py, Ray's in test_engines_weight_sync_ray.py."""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest
import torch

import flowrl
from flowrl.engines import GenerationRequest, SamplingParams, TorchRolloutEngine
from flowrl.errors import ConfigError, TransportError
from flowrl.models import TinyLM, TinyLMConfig


@pytest.fixture
def channel() -> str:
    return f"test-{secrets.token_hex(4)}"


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64))


def _shm_files(channel: str) -> list[str]:
    return [s for s in os.listdir("/dev/shm") if channel in s]


def test_subscriber_sees_each_new_version_and_its_exact_tensors(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel)
    sub = flowrl.WeightSubscriber(channel)
    try:
        assert sub.poll() is None  # nothing published yet
        a, b = _model(0), _model(1)
        pub.publish(a.named_parameters(), version=1)
        snap = sub.poll(have=0)
        assert snap is not None and snap.version == 1
        got = dict(snap.tensors())
        assert got.keys() == dict(a.named_parameters()).keys()
        for name, p in a.named_parameters():
            assert torch.equal(got[name], p.detach())
        assert sub.poll(have=1) is None  # and that poll released the snapshot
        with pytest.raises(TransportError, match="released"):
            next(snap.tensors())
        pub.publish(b.named_parameters(), version=2)
        with sub.poll(have=1) as snap2:
            assert snap2.version == 2
            loaded = _model(7)
            loaded.load_state_dict(dict(snap2.tensors()))
        for (_, p), (_, q) in zip(loaded.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(p, q)
        for version in range(3, 8):  # every later version reuses the two arenas
            pub.publish(a.named_parameters(), version=version)
            assert sub.poll(have=version - 1).version == version
        assert pub.arenas == 2
    finally:
        sub.close()
        pub.close()
    assert not _shm_files(channel)


def test_a_held_snapshot_is_never_rewritten(channel: str) -> None:
    """A subscriber holding version 1 keeps reading version 1's bytes while the publisher
    goes on: it writes only into arenas nobody reads, adding one when needed."""
    pub = flowrl.WeightPublisher(channel, max_arenas=3, wait_s=0.2)
    slow, fast = flowrl.WeightSubscriber(channel), flowrl.WeightSubscriber(channel)
    zeros = [("w", torch.zeros(1000))]
    try:
        pub.publish(zeros, version=1)
        held = slow.poll()
        for version in range(2, 6):
            pub.publish([("w", torch.full((1000,), float(version)))], version=version)
            with fast.poll() as newest:
                assert newest.version == version
                assert (dict(newest.tensors())["w"] == version).all()
            assert (dict(held.tensors())["w"] == 0).all()  # untouched by later versions
        assert pub.arenas == 3
        pinned = fast.poll()  # version 5, the newest: arena 3 is free ...
        pub.publish(zeros, version=6)
        with pytest.raises(TransportError, match="held by subscribers"):
            pub.publish(zeros, version=7)  # ... now two are read, one is the newest
        pinned.release()
        pub.publish(zeros, version=7)  # the version that failed may be published again
        assert (dict(held.tensors())["w"] == 0).all()
    finally:
        slow.close()
        fast.close()
        pub.close()


def test_readers_never_see_a_half_written_version(channel: str) -> None:
    """A publisher thread writes versions whose every element equals the version as fast
    as it can while a subscriber reads them slowly: each snapshot stays uniform and its
    own (without the arena locks the writer overwrites the snapshot being read)."""
    pub = flowrl.WeightPublisher(channel)
    sub = flowrl.WeightSubscriber(channel)
    shapes = [(512, 512)] * 4
    pub.publish([(f"w{i}", torch.zeros(s)) for i, s in enumerate(shapes)], version=1)
    done = threading.Event()

    def publish() -> None:
        try:
            for version in range(2, 40):
                pub.publish(
                    [(f"w{i}", torch.full(s, float(version))) for i, s in enumerate(shapes)],
                    version,
                )
        finally:
            done.set()

    writer = threading.Thread(target=publish)
    writer.start()
    seen: set[int] = set()
    try:
        while not done.is_set():
            snap = sub.poll()
            expected = 0.0 if snap.version == 1 else float(snap.version)
            for name, t in snap.tensors():  # a slow reader: a writer would overtake it
                assert t.min() == t.max() == expected, (name, snap.version)
                time.sleep(0.002)
            seen.add(snap.version)
    finally:
        writer.join()
        sub.close()
        pub.close()
    assert len(seen) > 1


def test_transfer_dtype_casts_floats_and_keeps_integers(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel, dtype=torch.bfloat16)
    sub = flowrl.WeightSubscriber(channel)
    weights = [("w", torch.randn(3, 5)), ("count", torch.arange(4))]
    try:
        pub.publish(weights, version=1)
        with sub.poll() as snap:
            got = dict(snap.tensors())
            assert got["w"].dtype == torch.bfloat16 and got["count"].dtype == torch.int64
            assert torch.equal(got["w"], weights[0][1].to(torch.bfloat16))
            assert torch.equal(got["count"], weights[1][1])
    finally:
        sub.close()
        pub.close()


def test_publish_async_and_sync_into_a_rollout_engine(channel: str) -> None:
    """The trainer is not held by the copy; the rollout engine loads the version between
    steps with ``sync``, its running request resuming under it."""
    pub = flowrl.WeightPublisher(channel)
    sub = flowrl.WeightSubscriber(channel)
    engine = TorchRolloutEngine(_model(0))
    engine.add([GenerationRequest(0, np.array([4, 5]))], SamplingParams(max_new_tokens=8))
    engine.step()
    new = _model(1)
    try:
        assert not sub.sync(engine)  # nothing published
        future = pub.publish_async(new.named_parameters(), version=1)
        with pytest.raises(ConfigError, match="not newer"):  # checked at once
            pub.publish_async(new.named_parameters(), version=1)
        future.result(timeout=30)
        assert sub.sync(engine) and engine.version == 1
        assert not sub.sync(engine)
        done = []
        while engine.pending:
            done += engine.step()
        assert done[0].versions.tolist() == [0] + [1] * 7  # one step: one token
        for (_, p), (_, q) in zip(
            engine.model.named_parameters(), new.named_parameters(), strict=True
        ):
            assert torch.equal(p, q)
    finally:
        sub.close()
        pub.close()


def test_larger_weights_get_a_larger_arena(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel)
    sub = flowrl.WeightSubscriber(channel)
    try:
        for version, n in enumerate([10, 10, 5000, 10], start=1):
            pub.publish([("w", torch.full((n,), float(version)))], version=version)
            with sub.poll() as snap:
                assert torch.equal(dict(snap.tensors())["w"], torch.full((n,), float(version)))
        assert pub.arenas == 2
    finally:
        sub.close()
        pub.close()
    assert not _shm_files(channel)


def test_publisher_rejects_bad_input(channel: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        flowrl.WeightPublisher("../etc")
    with pytest.raises(ConfigError, match="floating torch"):
        flowrl.WeightPublisher(channel, dtype=torch.int8)
    with pytest.raises(ConfigError, match="max_arenas expects >= 2"):
        flowrl.WeightPublisher(channel, max_arenas=1)
    pub = flowrl.WeightPublisher(channel)
    try:
        pub.publish(_model(0).named_parameters(), version=3)
        with pytest.raises(ConfigError, match="not newer"):
            pub.publish(_model(0).named_parameters(), version=3)
        with pytest.raises(ConfigError, match=r"expects \(name, tensor\) pairs"):
            pub.publish(_model(0).state_dict(), version=4)  # its keys alone
        pub.publish([("w", torch.ones(2))], version=4)  # a refused version is not taken
        sub = flowrl.WeightSubscriber(channel)
        assert sub.poll().version == 4
        sub.close()
    finally:
        pub.close()


def test_hf_llama_saves_a_directory_that_loads_back(tmp_path) -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from flowrl.models.hf import HFCausalLM, tiny_llama

    model = tiny_llama(vocab_size=16, hidden_size=32, n_heads=4, n_kv_heads=2)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(HFCausalLM(again)(ids), HFCausalLM(model)(ids))

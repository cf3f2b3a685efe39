"""Weight sync through shared memory (WeightPublisher / WeightSubscriber) in one process,
and the Hugging Face model's save / load round trip; the cross-process case is in
tests/integration/test_engines_weight_sync.py."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

import flowrl
from flowrl.errors import ConfigError
from flowrl.models import TinyLM, TinyLMConfig


@pytest.fixture
def channel() -> str:
    return f"test-{secrets.token_hex(4)}"


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=4, d_ff=64))


def test_subscriber_sees_each_new_version_and_its_exact_tensors(channel: str) -> None:
    pub = flowrl.WeightPublisher(channel, keep=0)
    sub = flowrl.WeightSubscriber(channel)
    try:
        assert sub.poll() is None  # nothing published yet
        a, b = _model(0), _model(1)
        first = pub.publish(a.named_parameters(), version=1)
        snap = sub.poll(have=0)
        assert snap is not None and snap.version == 1
        got = dict(snap.tensors())
        assert got.keys() == dict(a.named_parameters()).keys()
        for name, p in a.named_parameters():
            assert torch.equal(got[name], p.detach())
        assert sub.poll(have=1) is None
        header = pub.publish(b.named_parameters(), version=2)
        assert not os.path.exists(first.segment)  # keep=0: unlinked
        assert os.path.exists(header.segment)
        for name, p in a.named_parameters():  # the mapped old version still reads the same
            assert torch.equal(got[name], p.detach())
        snap2 = sub.poll(have=1)
        assert snap2 is not None and snap2.version == 2
        loaded = _model(7)
        assert len(header.tensors) == len(list(loaded.parameters()))
        loaded.load_state_dict(dict(snap2.tensors()))
        for (_, p), (_, q) in zip(loaded.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(p, q)
    finally:
        pub.close()
    assert not [s for s in os.listdir("/dev/shm") if channel in s]


def test_publisher_rejects_bad_input(channel: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        flowrl.WeightPublisher("../etc")
    pub = flowrl.WeightPublisher(channel)
    try:
        pub.publish(_model(0).named_parameters(), version=3)
        with pytest.raises(ConfigError, match="not newer"):
            pub.publish(_model(0).named_parameters(), version=3)
        assert flowrl.WeightSubscriber(channel).poll().version == 3
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

"""RolloutEngine.update_weights (the base class) resumes every interrupted request: shown
on the built-in torch engine, so it runs in CI; tests/integration/test_engine_vllm.py
checks the same on vLLM. Regression: abort() forgets a request's prompt and params, and
update_weights used to look them up after calling it (KeyError on the first resume)."""

from __future__ import annotations

import numpy as np
import torch

from flowrl.engines import GenerationRequest, SamplingParams, TorchRolloutEngine
from flowrl.models import TinyLM, TinyLMConfig


def test_update_weights_resumes_each_request_with_its_own_params_and_prefix() -> None:
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_heads=2, d_ff=64, max_seq_len=64))
    engine = TorchRolloutEngine(model)
    short, long = SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=12)
    engine.add([GenerationRequest(0, np.array([1, 2, 3]))], short)
    engine.add([GenerationRequest(1, np.array([4, 5])), GenerationRequest(2, np.array([6]))], long)
    for _ in range(3):
        assert engine.step() == []
    new = {name: p.detach() + 0.01 for name, p in model.named_parameters()}
    assert engine.update_weights(new.items(), version=1) == 3
    assert engine.version == 1
    done = {}
    while engine.pending:
        done.update((c.id, c) for c in engine.step())
    assert sorted(done) == [0, 1, 2]
    for i, c in done.items():
        n = 6 if i == 0 else 12
        assert len(c.tokens) == n and c.finished
        k = int((c.versions == 0).sum())
        assert k >= 1
        np.testing.assert_array_equal(c.versions, [0] * k + [1] * (n - k))

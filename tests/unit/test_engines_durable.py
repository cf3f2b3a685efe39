"""Durable generation on a rollout engine (``flowrl.engines.durable.generate_durable``) with
the torch engine and a real embedded hub: appends are each response's prefix and change
nothing that is sampled, a weight update mid-stream tags each append with the version that
sampled it, a preempted micro-batch resumes from its stored prefix with per-token
versions, missing stored log-probs are recomputed, bad arguments are refused before
anything is stored. (A SIGKILLed worker under the process executor:
tests/integration/test_engine_durable_kill.py; vLLM: tests/integration/test_engine_vllm.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from preemption import Preempted, PreemptedAfter

import flowrl
from flowrl import Column
from flowrl.engines import SamplingParams, TorchRolloutEngine
from flowrl.engines.durable import generate_durable
from flowrl.errors import ConfigError
from flowrl.models import TinyLM, TinyLMConfig
from flowrl.rl import build_batch, token_logprobs

EOS = 2
MAX_NEW = 8
COLS = [
    Column.ragged("prompt", "int64"),
    Column.ragged("response", "int64"),
    Column.ragged("sample_logprobs", "float32"),
    Column.ragged("response_versions", "int64"),
]
TASKS = {
    "generate": ["prompt"],
    "train": ["prompt", "response", "sample_logprobs", "response_versions"],
}
PROMPTS = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12], [4, 4], [5, 6, 7]]
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, eos_id=EOS, seed=0)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, max_seq_len=16)
    return TinyLM(cfg).eval()


def _claim(hub: flowrl.Hub, n: int, lease_timeout: float = 60) -> Any:
    meta = hub.claim("generate", n, min_n=n, lease_timeout=lease_timeout, timeout=10)
    assert len(meta) == n
    return meta


def _durable(engine: TorchRolloutEngine, hub: Any, meta: Any, prompts: list, **kw: Any) -> Any:
    return generate_durable(
        engine, hub, meta, prompts, PARAMS, ids=meta.indices.tolist(), **{"append_every": 2, **kw}
    )


def test_appends_are_each_response_in_order_and_change_nothing_sampled() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    hub.put({"prompt": PROMPTS})
    meta = _claim(hub, len(PROMPTS))
    recording = PreemptedAfter(hub, n=-1)  # never preempted: records every append
    out = _durable(TorchRolloutEngine(_model()), recording, meta, PROMPTS)
    plain = _durable(TorchRolloutEngine(_model()), hub, meta, PROMPTS, append_every=0)
    assert [r.tolist() for r in out.responses] == [r.tolist() for r in plain.responses]
    assert out.resumed == 0 and recording.appended
    stored = hub.partial(meta, "response")
    for k in range(len(PROMPTS)):
        response, sent = out.responses[k].tolist(), recording.appended["response"][k]
        assert stored.values[k].tolist() == sent == response[: len(sent)]
        assert recording.appended["sample_logprobs"][k] == out.logprobs[k][: len(sent)].tolist()
        assert len(sent) >= len(response) - 2  # nothing waits more than 2 steps
    assert all(v == [0] * len(v) for v in stored.versions.tolist())
    hub.close()


def test_a_weight_update_mid_stream_tags_each_append_with_its_sampler() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    hub.put({"prompt": PROMPTS})
    meta = _claim(hub, len(PROMPTS))
    engine = TorchRolloutEngine(_model(1))
    newer = _model(2)
    polls = iter(range(100))

    def poll(have: int) -> tuple[int, Any] | None:  # poll 0 comes before the requests are
        # added, poll k before engine step k: version 1 lands after 3 tokens
        return (1, list(newer.named_parameters())) if next(polls) == 4 and have == 0 else None

    out = _durable(engine, hub, meta, PROMPTS, append_every=5, poll_weights=poll)
    stored = hub.partial(meta, "response")
    mixed = 0
    for k in range(len(PROMPTS)):
        n_stored = len(stored.values[k])
        assert stored.values[k].tolist() == out.responses[k][:n_stored].tolist()
        assert stored.versions[k].tolist() == out.versions[k][:n_stored].tolist()
        versions = out.versions[k].tolist()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        mixed += versions.count(0) == 3 and 1 in versions  # 3 tokens of v0, then v1
    assert mixed >= 1
    hub.close()


def test_a_preempted_batch_resumes_from_its_prefix_with_mixed_versions() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    model = _model(2)
    hub.put({"prompt": PROMPTS})
    first = _claim(hub, len(PROMPTS), lease_timeout=0.2)
    engine = TorchRolloutEngine(model)
    cut = PreemptedAfter(hub, 1)  # the tokens and log-probs of the first append, then gone
    with pytest.raises(Preempted):
        _durable(engine, cut, first, PROMPTS, append_every=3)
    assert engine.pending == 0  # the engine let go of the micro-batch
    stored = hub.partial(first, "response")
    assert stored.values.tolist() == cut.appended["response"]

    second = _claim(hub, len(PROMPTS))  # the same samples come back, to a v1 worker
    assert sorted(second.indices.tolist()) == sorted(first.indices.tolist())
    order = [first.indices.tolist().index(i) for i in second.indices.tolist()]
    resumer = TorchRolloutEngine(_model(2), version=1)
    out = _durable(resumer, hub, second, [PROMPTS[j] for j in order], append_every=3)
    assert out.resumed == sum(1 for r in cut.appended["response"] if r)
    mixed = 0
    for k, j in enumerate(order):
        prefix = cut.appended["response"][j]
        response = out.responses[k].tolist()
        assert response[: len(prefix)] == prefix  # resumed, not sampled again
        assert out.logprobs[k][: len(prefix)].tolist() == cut.appended["sample_logprobs"][j]
        assert out.versions[k].tolist() == [0] * len(prefix) + [1] * (len(response) - len(prefix))
        assert len(response) <= MAX_NEW and EOS not in response[:-1]
        mixed += 0 < len(prefix) < len(response)
    assert mixed >= 1
    versions = out.sample_versions(default=1)
    hub.put(
        {"response": out.responses, "sample_logprobs": out.logprobs,
         "response_versions": out.versions},
        indices=second, version=versions, ack=second,
    )  # fmt: skip
    assert all(not r for r in hub.partial(second, "response").values.tolist())  # dropped
    batch = hub.get(hub.claim("train", len(PROMPTS), timeout=5))
    assert sorted(batch.indices.tolist()) == sorted(first.indices.tolist())
    stats = hub.statistics().tasks["generate"]
    assert stats.consumed == len(PROMPTS) and stats.ready == stats.leased == 0
    hub.close()


def test_missing_stored_logprobs_are_recomputed_with_the_policy_or_refused() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    model = _model(3)
    hub.put({"prompt": PROMPTS[:2]})
    meta = _claim(hub, 2)
    hub.append(meta, "response", [[4, 5], []], version=0)  # tokens stored without all
    hub.append(meta, "sample_logprobs", [[-0.5], []], version=0)  # their log-probs
    with pytest.raises(ConfigError, match="no policy to recompute them with"):
        _durable(TorchRolloutEngine(model), hub, meta, PROMPTS[:2])
    engine = TorchRolloutEngine(model, version=1)
    out = _durable(engine, hub, meta, PROMPTS[:2], policy=lambda: (model, 1))
    assert out.responses[0][:2].tolist() == [4, 5] and out.versions[0][:2].tolist() == [0, 0]
    ids, mask, starts, cu = build_batch([torch.tensor(PROMPTS[0])], [torch.tensor([4, 5])])
    with torch.no_grad():
        recomputed = token_logprobs(model, ids, mask, starts, cu)
    assert out.logprobs[0][0] == pytest.approx(-0.5)  # the stored one is kept
    assert out.logprobs[0][1] == pytest.approx(float(recomputed[1]), abs=1e-5)  # refilled
    tokens = hub.partial(meta, "response").values.lengths
    assert tokens.tolist() == hub.partial(meta, "sample_logprobs").values.lengths.tolist()
    hub.close()


def test_bad_arguments_are_refused_before_anything_is_stored() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    hub.put({"prompt": PROMPTS[:2]})
    meta = _claim(hub, 2)
    engine = TorchRolloutEngine(_model())
    with pytest.raises(ConfigError, match="append_every expects an int >= 0"):
        _durable(engine, hub, meta, PROMPTS[:2], append_every=-1)
    with pytest.raises(ConfigError, match="one of each per sample of the claim"):
        _durable(engine, hub, meta, PROMPTS[:1])
    assert engine.pending == 0
    assert hub.partial(meta, "response").values.tolist() == [[], []]
    hub.close()

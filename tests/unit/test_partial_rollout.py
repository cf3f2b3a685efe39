"""Partial rollouts end to end: the sampler resumes prefixes and reports chunks, and
``generate_resumable`` stores a micro-batch token by token in a real hub and resumes it
after a preemption (an expired lease), with each token's policy version."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from preemption import Preempted, PreemptedAfter

import flowrl
from flowrl import Column
from flowrl.models import TinyLM, TinyLMConfig, generate
from flowrl.rl import build_batch, generate_resumable, token_logprobs

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


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, max_seq_len=16)
    return TinyLM(cfg).eval()


def _rows(out: Any) -> list[list[int]]:
    return [r.tolist() for r in out.responses()]


def test_a_resumed_prefix_decodes_as_if_never_interrupted() -> None:
    model = _model()
    full = generate(model, PROMPTS, MAX_NEW, temperature=0.0, eos_id=EOS)
    whole = _rows(full)
    cut = [min(3, len(r)) for r in whole]
    prefixes = [r[:c] for r, c in zip(whole, cut, strict=True)]
    prefixes[0] = whole[0]  # a prefix that is already the whole response: nothing more
    rest = generate(model, PROMPTS, MAX_NEW, temperature=0.0, eos_id=EOS, prefixes=prefixes)
    for i, (p, r) in enumerate(zip(prefixes, _rows(rest), strict=True)):
        assert p + r == whole[i], i
    assert rest.finished.tolist() == full.finished.tolist()
    lps = torch.split(full.logprobs, full.lengths.tolist())
    for i, lp in enumerate(rest.response_logprobs()):
        torch.testing.assert_close(lp, lps[i][len(prefixes[i]) :], atol=1e-5, rtol=1e-5)
    # Prefixes that end with EOS or use the whole budget: nothing is decoded.
    done = generate(model, PROMPTS[:2], 4, eos_id=EOS, prefixes=[[7, EOS], [1, 1, 1, 1]])
    assert done.token_ids.numel() == 0 and done.lengths.tolist() == [0, 0]
    assert done.finished.tolist() == [True, False]


def test_chunks_are_the_response_in_order_and_do_not_change_what_is_sampled() -> None:
    model = _model(1)
    plain = generate(
        model, PROMPTS, MAX_NEW, eos_id=EOS, generator=torch.Generator().manual_seed(7)
    )
    chunks: list[tuple[list[int], torch.Tensor]] = []

    def keep(tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor) -> None:
        assert tokens.numel() == logprobs.numel() == int(counts.sum())
        chunks.append((counts.tolist(), tokens.clone()))

    chunked = generate(
        model,
        PROMPTS,
        MAX_NEW,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(7),
        on_chunk=keep,
        chunk_steps=3,
    )
    assert torch.equal(plain.token_ids, chunked.token_ids)
    assert torch.equal(plain.logprobs, chunked.logprobs)
    sent: list[list[int]] = [[] for _ in PROMPTS]
    for counts, tokens in chunks:
        for i, piece in enumerate(torch.split(tokens, counts)):
            sent[i].extend(piece.tolist())
    steps = int(plain.lengths.max())
    assert len(chunks) == (steps - 1) // 3  # every 3 steps, never after the last one
    for i, row in enumerate(_rows(plain)):
        assert row[: len(sent[i])] == sent[i]
        assert len(sent[i]) == min(len(row), 3 * len(chunks))


def _claim(hub: flowrl.Hub, n: int, lease_timeout: float) -> Any:
    meta = hub.claim("generate", n, min_n=n, lease_timeout=lease_timeout, timeout=10)
    assert len(meta) == n
    return meta


def test_a_preempted_batch_resumes_from_its_prefix_with_mixed_versions() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    model = _model(2)
    hub.put({"prompt": PROMPTS})
    first = _claim(hub, len(PROMPTS), lease_timeout=0.2)
    cut = PreemptedAfter(hub, 1)  # the tokens and log-probs of the first chunk, then gone
    with pytest.raises(Preempted):
        generate_resumable(
            model, cut, first, PROMPTS, MAX_NEW, version=0, eos_id=EOS, append_every=3,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    stored = hub.partial(first, "response")
    assert stored.values.tolist() == cut.appended["response"]
    assert all(v == [0] * len(v) for v in stored.versions.tolist())

    second = _claim(hub, len(PROMPTS), lease_timeout=60)  # the same samples come back
    assert sorted(second.indices.tolist()) == sorted(first.indices.tolist())
    order = [first.indices.tolist().index(i) for i in second.indices.tolist()]
    prompts = [PROMPTS[j] for j in order]
    out = generate_resumable(
        model, hub, second, prompts, MAX_NEW, version=1, eos_id=EOS, append_every=3,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    assert out.resumed == sum(1 for r in cut.appended["response"] if r)
    mixed = 0
    for k, j in enumerate(order):
        prefix = cut.appended["response"][j]
        response = out.responses[k].tolist()
        versions = out.versions[k].tolist()
        assert response[: len(prefix)] == prefix  # resumed, not sampled again
        assert out.logprobs[k][: len(prefix)].tolist() == cut.appended["sample_logprobs"][j]
        assert versions == [0] * len(prefix) + [1] * (len(response) - len(prefix))
        assert len(response) <= MAX_NEW and len(out.logprobs[k]) == len(response)
        mixed += 0 < len(prefix) < len(response)
    assert mixed >= 1
    versions = out.sample_versions(default=1)  # each sample as old as its oldest token
    assert versions.tolist() == [0 if cut.appended["response"][j] else 1 for j in order]

    hub.put(
        {"response": out.responses, "sample_logprobs": out.logprobs,
         "response_versions": out.versions},
        indices=second, version=versions,
    )  # fmt: skip
    assert all(not r for r in hub.partial(second, "response").values.tolist())  # dropped
    hub.ack(second)
    batch = hub.get(hub.claim("train", len(PROMPTS), timeout=5))
    assert sorted(batch.indices.tolist()) == sorted(first.indices.tolist())
    version_of = dict(zip(second.indices.tolist(), versions.tolist(), strict=True))
    assert batch.meta.versions.tolist() == [version_of[i] for i in batch.indices.tolist()]
    stats = hub.statistics()
    assert stats.tasks["generate"].consumed == len(PROMPTS)
    assert stats.tasks["generate"].ready == stats.tasks["generate"].leased == 0
    hub.close()


def test_fewer_stored_logprobs_than_tokens_are_repaired() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    model = _model(3)
    idx = hub.put({"prompt": PROMPTS[:2]})
    meta = hub.claim("generate", 2, min_n=2, timeout=5)
    # Tokens stored without all their log-probs (appended alone, or a persistent unit that
    # died between logging the two columns).
    hub.append(meta, "response", [[4, 5], []], version=0)
    hub.append(meta, "sample_logprobs", [[-0.5], []], version=0)
    out = generate_resumable(
        model, hub, meta, PROMPTS[:2], MAX_NEW, version=1, eos_id=EOS, append_every=1
    )
    assert out.responses[0][:2].tolist() == [4, 5]
    assert out.versions[0][:2].tolist() == [0, 0]
    for k in range(2):
        assert len(out.logprobs[k]) == len(out.responses[k])
    ids, mask, starts, cu = build_batch(
        [torch.tensor(PROMPTS[0])], [torch.from_numpy(out.responses[0][:2].copy())]
    )
    with torch.no_grad():
        recomputed = token_logprobs(model, ids, mask, starts, cu)
    assert out.logprobs[0][0] == pytest.approx(-0.5)  # the stored one is kept
    assert out.logprobs[0][1] == pytest.approx(float(recomputed[1]), abs=1e-5)  # refilled
    tokens = hub.partial(meta, "response").values.lengths
    lps = hub.partial(meta, "sample_logprobs").values.lengths
    assert tokens.tolist() == lps.tolist()  # the stored prefixes line up again
    hub.put(
        {"response": out.responses, "sample_logprobs": out.logprobs,
         "response_versions": out.versions},
        indices=meta,
    )  # fmt: skip
    hub.ack(meta)
    assert hub.statistics().tasks["generate"].consumed == len(idx)
    hub.close()


def test_bad_arguments_are_refused_before_anything_is_stored() -> None:
    hub = flowrl.Hub(COLS, tasks=TASKS)
    hub.put({"prompt": PROMPTS[:2]})
    meta = hub.claim("generate", 2, min_n=2, timeout=5)
    with pytest.raises(ValueError, match="append_every"):
        generate_resumable(_model(), hub, meta, PROMPTS[:2], 4, version=0, eos_id=EOS,
                           append_every=-1)  # fmt: skip
    with pytest.raises(ValueError, match="one prompt per sample"):
        generate_resumable(_model(), hub, meta, PROMPTS[:1], 4, version=0, eos_id=EOS)
    with pytest.raises(ValueError, match="chunk_steps"):
        generate(_model(), PROMPTS, 4, eos_id=EOS, chunk_steps=0)
    assert hub.partial(meta, "response").values.tolist() == [[], []]
    hub.close()

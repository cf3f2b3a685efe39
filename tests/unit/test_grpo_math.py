"""GRPO math: group advantages against a naive loop, the clipped objective and its
gradient against hand computations, log-prob recompute against a plain forward."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.models import TinyLM, TinyLMConfig
from flowrl.rl import build_batch, group_advantages, grpo_loss, token_logprobs


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add sync cost (and stall on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _naive_advantages(rewards: list[float], groups: list[int], eps: float) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = torch.tensor(
            [x for x, h in zip(rewards, groups, strict=True) if h == g], dtype=torch.float64
        )
        if members.numel() == 1:
            out.append(0.0)
            continue
        out.append((r - members.mean().item()) / (members.std().item() + eps))
    return out


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.floats(-10, 10, allow_nan=False, width=32),
            st.integers(-3, 4).map(lambda g: g * 1000),  # arbitrary, non-contiguous ids
        ),
        min_size=1,
        max_size=40,
    )
)
def test_group_advantages_matches_naive_loop(data: list[tuple[float, int]]) -> None:
    rewards = [r for r, _ in data]
    groups = [g for _, g in data]
    got = group_advantages(torch.tensor(rewards), torch.tensor(groups), eps=1e-6)
    want = torch.tensor(_naive_advantages(rewards, groups, 1e-6), dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_group_advantages_binary_rewards() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # Bessel-corrected
    torch.testing.assert_close(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std)
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal in a uniform group
    biased = group_advantages(rewards, groups, unbiased=False)
    torch.testing.assert_close(biased[0], torch.tensor(0.75 / math.sqrt(0.75 * 0.25)))


def test_group_advantages_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


# Two samples: A (2 tokens, advantage +1) and B (1 token, advantage -0.5).
LOGPROBS = [-1.0, -0.5, -2.0]
OLD = [-1.2, -0.5, -1.5]
REF = [-1.0, -0.7, -2.0]
ADV = [1.0, -0.5]
CU = [0, 2, 3]


def _loss(aggregation: str = "token-mean", **kw: object) -> tuple[torch.Tensor, dict, torch.Tensor]:
    lp = torch.tensor(LOGPROBS, requires_grad=True)
    loss, metrics = grpo_loss(
        lp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(CU), aggregation=aggregation, **kw
    )  # type: ignore[arg-type]
    loss.backward()
    assert lp.grad is not None
    return loss, metrics, lp.grad


def test_clipped_objective_matches_hand_computation() -> None:
    # ratios: e^0.2 = 1.221 (A > 0, clipped to 1.2), 1.0, e^-0.5 = 0.607 (A < 0, clipped to 0.8)
    tok = [-1.0 * 1.2, -1.0 * 1.0, 0.5 * 0.8]
    loss, m, grad = _loss()
    assert loss.item() == pytest.approx(sum(tok) / 3)
    assert m["pg_loss"] == pytest.approx(sum(tok) / 3)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["kl_ref"] == 0.0 and m["n_tokens"] == 3.0
    assert m["ratio_max"] == pytest.approx(math.exp(0.2))
    # Clipped tokens get no gradient; the unclipped one gets -A * ratio / n_tokens.
    torch.testing.assert_close(grad, torch.tensor([0.0, -1.0 / 3, 0.0]))
    k3_old = [math.exp(0.2) - 1 - 0.2, 0.0, math.exp(-0.5) - 1 + 0.5]
    assert m["approx_kl"] == pytest.approx(sum(k3_old) / 3)

    seq_loss, _, seq_grad = _loss("seq-mean")
    assert seq_loss.item() == pytest.approx(((tok[0] + tok[1]) / 2 + tok[2]) / 2)
    torch.testing.assert_close(seq_grad, torch.tensor([0.0, -1.0 / 4, 0.0]))


def test_asymmetric_clip_and_k3_reference_penalty() -> None:
    k3 = [0.0, math.exp(-0.2) + 0.2 - 1, 0.0]  # exp(ref - lp) - (ref - lp) - 1
    loss, m, _ = _loss(ref_logprobs=torch.tensor(REF), kl_coef=0.5, clip_eps_high=0.3)
    tok = [-1.0 * math.exp(0.2), -1.0, 0.5 * 0.8]  # 1.221 < 1.3: token 1 is unclipped now
    assert m["kl_ref"] == pytest.approx(sum(k3) / 3)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(sum(tok) / 3 + 0.5 * sum(k3) / 3)


def test_positive_advantage_raises_logprobs() -> None:
    lp = torch.zeros(4, requires_grad=True)
    loss, _ = grpo_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), torch.tensor([0, 2, 4]))
    loss.backward()
    assert lp.grad is not None
    assert (lp.grad[:2] < 0).all() and (lp.grad[2:] > 0).all()


def test_grpo_loss_validates_shapes() -> None:
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="per sample"):
        grpo_loss(lp, lp, torch.zeros(3), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        grpo_loss(lp, lp, torch.zeros(2), torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(lp, lp, torch.zeros(2), torch.tensor([0, 2, 3]), aggregation="sum")  # type: ignore[arg-type]


def test_build_batch_layout() -> None:
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    responses = [torch.tensor([9]), torch.tensor([3, 4, 2])]
    ids, mask, starts, cu = build_batch(prompts, responses, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 9], [8, 3, 4, 2]]
    assert mask.all() and starts.tolist() == [3, 1] and cu.tolist() == [0, 1, 4]
    ids, mask, _, _ = build_batch(
        prompts[:1] * 2, [torch.tensor([1]), torch.tensor([], dtype=torch.long)]
    )
    assert mask.tolist() == [[True] * 4, [True] * 3 + [False]]


def test_token_logprobs_match_a_plain_forward() -> None:
    torch.manual_seed(0)
    model = TinyLM(
        TinyLMConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16)
    )
    prompts = [torch.tensor([1, 4, 5]), torch.tensor([1, 6]), torch.tensor([1, 7, 8, 9])]
    responses = [torch.tensor([3, 2]), torch.tensor([4, 4, 4, 2]), torch.tensor([5])]
    batch = build_batch(prompts, responses)
    got = token_logprobs(model, *batch, temperature=0.5)
    want = []
    for p, r in zip(prompts, responses, strict=True):
        seq = torch.cat([p, r])
        logp = torch.log_softmax(model(seq[None])[0] / 0.5, dim=-1)
        want += [logp[len(p) + j - 1, tok] for j, tok in enumerate(r.tolist())]
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.requires_grad
    got.sum().backward()
    assert model.tok_emb.weight.grad is not None

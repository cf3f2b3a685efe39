"""Behaviour-policy correction in grpo_loss: truncated importance sampling (TIS)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.rl import grpo_loss

CU = torch.tensor([0, 2, 5])
ADV = torch.tensor([1.0, -0.5])


def test_tis_weights_each_token_by_the_truncated_ratio() -> None:
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
    behav = old - torch.tensor([math.log(0.5), math.log(3.0), 0.0, math.log(1.5), math.log(9.0)])
    # pi_old / pi_behav = 0.5, 3, 1, 1.5, 9; truncated at C = 2
    logprobs = old.clone().requires_grad_(True)
    loss, m = grpo_loss(logprobs, old, ADV, CU, sample_logprobs=behav, tis_cap=2.0)
    w = torch.tensor([0.5, 2.0, 1.0, 1.5, 2.0])
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5])
    assert loss.item() == pytest.approx((-adv * w).mean().item(), rel=1e-6)  # ratio 1
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv * w / 5)  # the weight is a constant
    assert m["is_ratio_mean"] == pytest.approx((0.5 + 3 + 1 + 1.5 + 9) / 5, rel=1e-5)
    assert m["is_ratio_max"] == pytest.approx(9.0, rel=1e-5)
    assert m["is_truncated_fraction"] == pytest.approx(2 / 5)


def test_tis_is_the_plain_loss_when_sampler_and_trainer_agree() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.4, -1.5, -2.5])
    old = torch.tensor([-1.1, -2.0, -0.5, -1.5, -3.0])
    plain, m0 = grpo_loss(logprobs, old, ADV, CU)
    tis, m1 = grpo_loss(logprobs, old, ADV, CU, sample_logprobs=old, tis_cap=2.0)
    assert tis.item() == pytest.approx(plain.item())
    assert m1["is_ratio_mean"] == pytest.approx(1.0) and m1["is_truncated_fraction"] == 0.0
    assert "is_ratio_mean" not in m0


def test_tis_rejects_incomplete_input() -> None:
    lp = torch.zeros(5)
    with pytest.raises(ValueError, match="pass both"):
        grpo_loss(lp, lp, ADV, CU, tis_cap=2.0)
    with pytest.raises(ValueError, match="pass both"):
        grpo_loss(lp, lp, ADV, CU, sample_logprobs=lp, tis_cap=0.0)
    with pytest.raises(ValueError, match="sample_logprobs shaped like"):
        grpo_loss(lp, lp, ADV, CU, sample_logprobs=torch.zeros(4), tis_cap=2.0)

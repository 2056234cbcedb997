import math

import pytest
import torch

from distflow.algorithms.advantages import grpo_advantages
from distflow.algorithms.kl import kl_k3
from distflow.algorithms.losses import ppo_clip_loss


def test_grpo_advantages_by_hand():
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([7, 7, 7, 9, 9, 9])
    adv, zero = grpo_advantages(reward, group)
    # group 7: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [2 / 3 / std, -1 / 3 / std, -1 / 3 / std, -2 / 3 / std, 1 / 3 / std, 1 / 3 / std]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    assert not zero.any()


def test_dr_grpo_does_not_divide_by_std():
    adv, _ = grpo_advantages(torch.tensor([2.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0]), norm_by_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_zero_variance_groups_are_exactly_zero():
    # 0.1 + 0.2 style non-round rewards: float32 statistics would leave a residue / eps.
    reward = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0], dtype=torch.float32)
    adv, zero = grpo_advantages(reward, torch.tensor([1, 1, 1, 2, 2]))
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert zero.tolist() == [True, True, True, False, False]
    # centred ±0.5, unbiased std sqrt(0.5): ±0.5 / sqrt(0.5)
    assert adv[3:].tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], rel=1e-5)


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
    adv = torch.tensor([1.0])
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.3)
    # A > 0: loss = -min(r, clip(r)) → r=1.5 clipped to 1.3; r=0.5 unclipped (min picks 0.5).
    assert loss.tolist()[0] == pytest.approx([-1.3, -0.5, -1.1, -0.7], rel=1e-6)
    assert clipped.tolist()[0] == [True, False, False, False]
    loss_neg, clipped_neg = ppo_clip_loss(logp, old, -adv, clip_low=0.2, clip_high=0.3)
    # A < 0: loss = max(r, clip(r)) → r=0.5 clipped up to 0.8, r=0.7 up to 0.8.
    assert loss_neg.tolist()[0] == pytest.approx([1.5, 0.8, 1.1, 0.8], rel=1e-6)
    assert clipped_neg.tolist()[0] == [False, True, False, True]


def test_ppo_gradient_on_policy_is_the_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, logp.detach(), torch.tensor([0.5]), clip_low=0.2, clip_high=0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == [[-0.5, -0.5]]


def test_kl_k3_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    d = ref - logp
    expected = (torch.exp(d) - d - 1).tolist()[0]
    assert kl_k3(logp, ref).tolist()[0] == pytest.approx(expected)
    assert kl_k3(logp, ref)[0, 0] == 0.0
    assert expected[1] == pytest.approx(math.exp(-1) + 1 - 1)


def test_extreme_log_ratios_stay_finite_under_a_zero_mask():
    logp = torch.tensor([[0.0, -1e4]], requires_grad=True)  # second token: a masked, absurd position
    old = torch.tensor([[0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = ppo_clip_loss(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.2)
    total = (loss * mask).sum() + (kl_k3(logp, old + 1e4) * mask).sum()
    total.backward()
    assert torch.isfinite(logp.grad).all()

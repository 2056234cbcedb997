"""Advantage estimators against hand-computed values: RLOO, REINFORCE++(-baseline), GAE, whitening."""

import math

import pytest
import torch

from distflow.algorithms.advantages import reinforce_pp_baseline_advantages, rloo_advantages
from distflow.algorithms.kl import kl_penalized_reward
from distflow.algorithms.returns import gae_advantages, outcome_to_token_rewards, reinforce_pp_advantages
from distflow.algorithms.whitening import masked_sums, masked_whiten


def test_rloo_by_hand():
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 5.0, 0.3, 0.3, 0.3])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    adv, zero = rloo_advantages(reward, group)
    # group 0: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3; group 1: 3 - 1, 1 - 3;
    # group 2 has one sample: baseline 0; group 3 is all equal: exactly 0 and flagged.
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 5.0, 0.0, 0.0, 0.0], rel=1e-6)
    assert adv[7:].tolist() == [0.0, 0.0, 0.0]
    assert zero.tolist() == [False] * 7 + [True] * 3


def test_reinforce_pp_baseline_by_hand():
    reward = torch.tensor([1.0, 0.0, 2.0, -2.0])
    group = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 have one sample: baseline 0
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
    centred = reinforce_pp_baseline_advantages(reward, group, mask, whiten=False)
    assert centred.tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, 0.0], [2.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
    # Valid tokens 0.5, 0.5, -0.5, -0.5, 2, -2: mean 0, Σx² = 9, unbiased var 9/5.
    std = math.sqrt(9 / 5)
    adv = reinforce_pp_baseline_advantages(reward, group, mask)
    expected = [[0.5 / std, 0.5 / std, 0.0], [-0.5 / std, -0.5 / std, 0.0], [2 / std, 0.0, 0.0], [-2 / std, 0.0, 0.0]]
    for row, expected_row in zip(adv.tolist(), expected, strict=True):
        assert row == pytest.approx(expected_row, rel=1e-6)


def test_masked_sums_and_whiten_by_hand():
    value = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_sums(value, mask).tolist() == [6.0, 14.0, 3.0]
    # mean 2, unbiased var ((-1)² + 0 + 1²) / 2 = 1; the masked 99 plays no part.
    assert masked_whiten(value, mask).tolist()[0] == pytest.approx([-1.0, 0.0, 1.0, 0.0], rel=1e-6)


def test_whitening_with_global_sums_matches_one_shot():
    generator = torch.Generator().manual_seed(0)
    value = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    mask = torch.arange(5).expand(6, 5) < torch.tensor([[5], [3], [1], [0], [4], [2]])
    one_shot = masked_whiten(value, mask)
    shards = [slice(0, 1), slice(1, 4), slice(4, 6)]  # three "ranks" of unequal size
    global_sums = sum(masked_sums(value[s], mask[s]) for s in shards)  # stands in for all_reduce
    sharded = torch.cat([masked_whiten(value[s], mask[s], sums=global_sums) for s in shards])
    torch.testing.assert_close(sharded, one_shot, rtol=1e-12, atol=1e-12)
    local_only = torch.cat([masked_whiten(value[s], mask[s]) for s in shards])
    assert not torch.allclose(local_only, one_shot)


def test_outcome_to_token_rewards_lands_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    reward = outcome_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert reward.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]]


def test_gae_by_hand():
    reward = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    value = torch.tensor([[0.5, 0.25, 0.5], [1.0, 1.0, 9.0]])  # 9.0: padding, never bootstrapped
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(reward, value, mask, gamma=0.5, lam=0.5, whiten=False)
    # row 0: δ2 = 1 - .5 = .5, A2 = .5; δ1 = .5·.5 - .25 = 0, A1 = .25·.5 = .125;
    #        δ0 = .5·.25 - .5 = -.375, A0 = -.375 + .25·.125 = -.34375.
    # row 1: δ1 = 2 - 1 = 1, A1 = 1; δ0 = .5·1 - 1 = -.5, A0 = -.5 + .25·1 = -.25.
    assert adv.tolist() == [[-0.34375, 0.125, 0.5], [-0.25, 1.0, 0.0]]
    assert ret.tolist() == [[0.15625, 0.375, 1.0], [0.75, 2.0, 0.0]]


def test_gae_with_gamma_lambda_one_is_monte_carlo_minus_value():
    adv, ret = gae_advantages(
        torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3), torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False
    )
    assert adv.tolist() == [[5.0, 4.0, 2.0]]
    assert ret.tolist() == [[6.0, 5.0, 3.0]]


def test_gae_skips_masked_tokens_inside_a_response():
    # Multi-turn: token 1 is tool output. Its reward and value are ignored, as if it were absent.
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 5.0, 1.0]]),
        torch.tensor([[0.5, 7.0, 0.5]]),
        torch.tensor([[1, 0, 1]]),
        gamma=1.0,
        lam=1.0,
        whiten=False,
    )
    assert adv.tolist() == [[0.5, 0.0, 0.5]]
    assert ret.tolist() == [[1.0, 0.0, 1.0]]


def test_gae_whitened_over_valid_tokens_only():
    reward = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    value = torch.tensor([[0.5, 0.25, 0.5], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    raw, ret_raw = gae_advantages(reward, value, mask, gamma=0.5, lam=0.5, whiten=False)
    adv, ret = gae_advantages(reward, value, mask, gamma=0.5, lam=0.5)
    valid = adv[mask.bool()].double()
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert valid.std().item() == pytest.approx(1.0, rel=1e-6)  # unbiased, like masked_whiten
    assert adv[1, 2].item() == 0.0
    assert torch.equal(ret, ret_raw)  # the critic's target is taken before whitening
    assert torch.equal(torch.argsort(adv[mask.bool()]), torch.argsort(raw[mask.bool()]))


def test_reinforce_pp_by_hand():
    reward = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 3.0]])  # 3.0 is on padding: never counted
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_pp_advantages(reward, mask, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]
    # valid returns .25 .5 1 .5 1: mean .65, Σ(x - mean)² = .45, unbiased var .45 / 4 = .1125
    std = math.sqrt(0.1125)
    expected = [[-0.4 / std, -0.15 / std, 0.35 / std], [-0.15 / std, 0.35 / std, 0.0]]
    for row, expected_row in zip(adv.tolist(), expected, strict=True):
        assert row == pytest.approx(expected_row, rel=1e-6)


def test_reinforce_pp_accumulates_kl_in_reward():
    mask = torch.ones(1, 3)
    reward = kl_penalized_reward(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.2, 0.3]]), mask, beta=0.5)
    assert reward.tolist()[0] == pytest.approx([-0.05, -0.1, 0.85])
    _, ret = reinforce_pp_advantages(reward, mask, gamma=1.0, whiten=False)
    assert ret.tolist()[0] == pytest.approx([0.7, 0.75, 0.85])

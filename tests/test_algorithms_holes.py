"""Algorithms over multi-turn masks: interior zero spans (observation tokens) inside the
response. Values computed by hand in the comments."""

import math

import torch

from distflow.algorithms import aggregation
from distflow.algorithms.advantages import grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from distflow.algorithms.aggregation import aggregate_loss
from distflow.algorithms.returns import gae_advantages, reinforce_pp_advantages
from distflow.dag.advantage_stages import _token_reward_BR
from distflow.data.batch import Batch

# model tokens | observation | model tokens: positions 1-2 are a hole
HOLE_R = torch.tensor([[1, 0, 0, 1, 1]])


def test_gae_skips_observation_tokens():
    """γ = 0.9, λ = 0.5, reward 1 on the last token, V = [0.5, 9, 0.25]; the hole's value 9 is never used.
    t=2: δ = 1 + 0 - 0.25 = 0.75, A = 0.75, R = 1.0
    t=0: δ = 0 + 0.9·0.25 - 0.5 = -0.275 (V of the next *model* token), A = -0.275 + 0.45·0.75 = 0.0625, R = 0.5625
    """
    adv_BR, ret_BR = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 0.25]]),
        torch.tensor([[1, 0, 1]]),
        gamma=0.9,
        lam=0.5,
        whiten=False,
    )
    assert torch.allclose(adv_BR, torch.tensor([[0.0625, 0.0, 0.75]]))
    assert torch.allclose(ret_BR, torch.tensor([[0.5625, 0.0, 1.0]]))


def test_gae_with_a_hole_equals_gae_without_the_hole_tokens():
    torch.manual_seed(0)
    reward_BR, value_BR = torch.randn(3, 7), torch.randn(3, 7)
    mask_BR = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1]])
    reward_BR = reward_BR * mask_BR  # rewards sit on model tokens
    adv_BR, ret_BR = gae_advantages(reward_BR, value_BR, mask_BR, gamma=0.95, lam=0.9, whiten=False)
    for b in range(3):
        keep = mask_BR[b].bool()
        dense_adv, dense_ret = gae_advantages(
            reward_BR[b, keep][None],
            value_BR[b, keep][None],
            torch.ones(1, int(keep.sum())),
            gamma=0.95,
            lam=0.9,
            whiten=False,
        )
        assert torch.allclose(adv_BR[b, keep], dense_adv[0]) and torch.allclose(ret_BR[b, keep], dense_ret[0])
        assert (adv_BR[b, ~keep] == 0).all() and (ret_BR[b, ~keep] == 0).all()


def test_reinforce_pp_returns_skip_the_hole():
    """γ = 0.5; per-turn reward 1 on token 0 (end of turn 1), outcome 1 on token 4.
    G4 = 1, G3 = 0.5·1 = 0.5, G0 = 1 + 0.5·G3 = 1.25 (no discount through the hole)."""
    reward_BR = torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0]])
    _, ret_BR = reinforce_pp_advantages(reward_BR, HOLE_R, gamma=0.5, whiten=False)
    assert ret_BR.tolist() == [[1.25, 0.0, 0.0, 0.5, 1.0]]


def test_outcome_estimators_broadcast_over_model_tokens_only():
    """GRPO / RLOO are per sequence: the hole changes nothing but which tokens carry them.
    Rewards [1, 0, 0] in one group: mean 1/3, unbiased std √(1/3)."""
    reward_B, group_B = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([7, 7, 7])
    adv_B, _ = grpo_advantages(reward_B, group_B)
    assert torch.allclose(adv_B, torch.tensor([2 / 3, -1 / 3, -1 / 3]) / math.sqrt(1 / 3), atol=1e-5)
    loo_B, _ = rloo_advantages(reward_B, group_B)
    assert torch.allclose(loo_B, torch.tensor([1.0, -0.5, -0.5]))
    # The policy-gradient loss of sequence 0 (-A·ratio at ratio 1) over a holed mask, seq-mean-token-mean:
    # its three model tokens average to -A; the two observation tokens (huge values) count for nothing.
    loss_BR = torch.tensor([[-1.0, 1e6, 1e6, -1.0, -1.0]]) * adv_B[0]
    assert torch.allclose(aggregate_loss(loss_BR, HOLE_R, aggregation.SeqMeanTokenMean), -adv_B[0])
    assert torch.allclose(aggregate_loss(loss_BR, HOLE_R, aggregation.TokenSum), -3 * adv_B[0])


def test_reinforce_pp_baseline_whitens_over_model_tokens():
    """Rewards [1, 0] (one group): centred [0.5, -0.5] on the model tokens: 0.5, 0.5, -0.5.
    Mean 1/6, unbiased var ((1/3)² + (1/3)² + (2/3)²)/2 = 1/3 → [1/3, 1/3, -2/3]·√3."""
    mask_BR = torch.tensor([[1, 0, 1], [1, 0, 0]])
    adv_BR = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask_BR)
    s = math.sqrt(3)
    assert torch.allclose(adv_BR, torch.tensor([[s / 3, 0.0, s / 3], [-2 * s / 3, 0.0, 0.0]]), atol=1e-6)


def test_kl_aggregation_over_holes():
    """The step KL of a sequence is the mean over its model tokens (here (0.2 + 0.4 + 0.6)/3)."""
    kl_BR = torch.tensor([[0.2, 5.0, 5.0, 0.4, 0.6]])
    assert torch.allclose(aggregate_loss(kl_BR, HOLE_R, aggregation.TokenMean), torch.tensor(0.4))


def test_turn_rewards_stay_on_their_turn():
    """reward = 3 (2 from the task's reward function + 1 the environment gave turn 1 on its
    last token): token rewards [1, 0, 0, 0, 2], the remainder on the last model token."""
    batch = Batch(
        {
            "reward": torch.tensor([3.0]),
            "response_mask": HOLE_R,
            "turn_reward": torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]]),
        },
        {},
    )
    assert _token_reward_BR(batch).tolist() == [[1.0, 0.0, 0.0, 0.0, 2.0]]

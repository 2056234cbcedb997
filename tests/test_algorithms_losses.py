"""Dual-clip PPO, GSPO, clipped value loss, entropy, KL estimators and controllers, by hand."""

import math

import pytest
import torch

from distflow.algorithms import aggregation
from distflow.algorithms.aggregation import aggregate_loss
from distflow.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_reward,
)
from distflow.algorithms.losses import (
    dual_clip_ppo_loss,
    entropy_bonus,
    gspo_loss,
    value_clip_loss,
)


def test_dual_clip_caps_negative_advantages_by_hand():
    logp = torch.log(torch.tensor([[4.0, 0.5, 1.0, 2.5]])).requires_grad_()
    old = torch.zeros(1, 4)
    loss, clipped, dual = dual_clip_ppo_loss(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.2)
    # A = -1: PPO gives max(r, clip(r)) = 4, .8, 1, 2.5; the cap -A·c = 3 bounds the first.
    assert loss.tolist()[0] == pytest.approx([3.0, 0.8, 1.0, 2.5], rel=1e-6)
    assert clipped.tolist()[0] == [False, True, False, False]
    assert dual.tolist()[0] == [True, False, False, False]
    loss.sum().backward()
    # d(-A·r)/dlogp = r where unclipped; the cap and the clip are constants.
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 1.0, 2.5], rel=1e-6)


def test_dual_clip_leaves_positive_advantages_to_ppo():
    logp = torch.log(torch.tensor([[4.0, 0.5, 1.0]]))
    loss, _, dual = dual_clip_ppo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), clip_low=0.2, clip_high=0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, -1.0], rel=1e-6)
    assert not dual.any()


def test_dual_clip_bound_holds_for_any_ratio():
    generator = torch.Generator().manual_seed(0)
    logp = 3 * torch.randn(4, 16, generator=generator)
    advantage = torch.tensor([-2.0, -0.5, 0.5, 2.0])
    loss, _, _ = dual_clip_ppo_loss(logp, torch.zeros(4, 16), advantage, clip_low=0.2, clip_high=0.28)
    assert (loss[:2] <= -advantage[:2, None] * 3.0).all()


def test_dual_clip_rejects_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        dual_clip_ppo_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), clip_low=0.2, clip_high=0.2, clip_ratio_c=1.0
        )


def _gspo_inputs():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # row 0: log-ratios ln 2, 0 → s = √2; row 1: 3e-4, 1e-4 → s = e^(2e-4). The 5.0 is padding.
    logp = torch.tensor([[math.log(2.0), 0.0, 0.0], [3e-4, 1e-4, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    return logp, old, mask


def test_gspo_by_hand():
    logp, old, mask = _gspo_inputs()
    loss, clipped = gspo_loss(logp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask)
    # row 0: A > 0 and √2 > 1 + 4e-4, so the clipped term -1.0004 wins on every token.
    assert loss[0].tolist() == pytest.approx([-1.0004] * 3, rel=1e-12)
    assert clipped[0].tolist() == [True, True, True]
    # row 1: s = e^(2e-4) = 1.000200020001333 is inside [1 - 3e-4, 1 + 4e-4]: -A·s.
    assert loss[1].tolist() == pytest.approx([-2.000400040002667] * 3, rel=1e-12)
    assert not clipped[1].any()


def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient():
    logp, old, mask = _gspo_inputs()
    loss, _ = gspo_loss(logp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask)
    aggregate_loss(loss, mask, aggregation.SeqMeanTokenMean).backward()
    # Clipped row 0: no gradient. Row 1: -A·s / |y| / (2 sequences) = -2·e^(2e-4) / 2 / 2 per valid token.
    assert logp.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert logp.grad[1].tolist() == pytest.approx([-0.5001000100006667, -0.5001000100006667, 0.0], rel=1e-12)
    # The same as differentiating GSPO's sequence objective -A·exp(mean_t(logp - old)) directly.
    direct = logp.detach()[1, :2].clone().requires_grad_()
    (-2.0 * torch.exp(direct.mean()) / 2).backward()
    assert logp.grad[1, :2].tolist() == pytest.approx(direct.grad.tolist(), rel=1e-12)


def test_gspo_clips_low_for_negative_advantage():
    logp = torch.tensor([[-1e-3, -1e-3]], dtype=torch.float64)
    loss, clipped = gspo_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([-1.0]), torch.ones(1, 2))
    # s = e^-1e-3 = 0.9990005 < 1 - 3e-4: max(s, 0.9997) = 0.9997.
    assert loss.tolist()[0] == pytest.approx([0.9997, 0.9997], rel=1e-12)
    assert clipped.all()


def test_value_clip_loss_by_hand():
    value = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.5]])
    returns = torch.tensor([[1.0, 0.0, 2.0]])
    loss, clipped = value_clip_loss(value, old, returns, clip=0.2)
    # token 0: clip(1, .3, .7) = .7, max(0, .09) / 2; token 1: 4 / 2; token 2: max(4, (.3 - 2)²) / 2.
    assert loss.tolist()[0] == pytest.approx([0.045, 2.0, 2.0], rel=1e-6)
    assert clipped.tolist()[0] == [True, False, False]
    loss.sum().backward()
    assert value.grad.tolist()[0] == pytest.approx([0.0, 2.0, -2.0])  # clipped: none; else V - R


def _entropy_BR(logits_BTV: torch.Tensor) -> torch.Tensor:
    """The entropy the policy's update sees (training/logprobs.py), of a model that outputs these
    logits; every column but the first is the response, so the last column predicts nothing."""
    from types import SimpleNamespace

    from distflow.training.logprobs import response_logprobs

    B, T, _ = logits_BTV.shape
    ids_BT, mask_BT = torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long)
    _, entropy_BR = response_logprobs(
        lambda **_: SimpleNamespace(logits=logits_BTV), ids_BT, mask_BT, T - 1, with_entropy=True
    )
    return entropy_BR


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [0.0, 0.0]]])  # p = (1/4, 3/4) and (1/2, 1/2)
    expected = [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]
    assert _entropy_BR(logits).tolist()[0] == pytest.approx(expected, rel=1e-6)
    assert _entropy_BR(torch.zeros(1, 2, 4)).item() == pytest.approx(math.log(4.0))
    assert entropy_bonus(torch.tensor([[0.5, 2.0]]), coef=0.01).tolist()[0] == pytest.approx([-0.005, -0.02])


def test_kl_estimators_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -2.0, -1.0]])
    assert kl_k1(logp, ref).tolist()[0] == [0.0, 1.0, -1.0]
    assert kl_k2(logp, ref).tolist()[0] == [0.0, 0.5, 0.5]
    # d = ref - logp = 0, -1, 1: e^d - d - 1 = 0, e^-1, e - 2
    assert kl_k3(logp, ref).tolist()[0] == pytest.approx([0.0, 0.36787944117, 0.71828182846], rel=1e-6)
    kl_k3(logp, ref).sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.63212055883, -1.71828182846], rel=1e-6)  # 1 - e^d


def test_kl_penalized_reward_leaves_masked_tokens_alone():
    reward = torch.tensor([[0.0, 0.0, 1.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    shaped = kl_penalized_reward(reward, kl, torch.tensor([[1, 1, 0]]), beta=0.5)
    assert shaped.tolist()[0] == pytest.approx([-0.05, -0.1, 1.0])


def test_fixed_kl_controller():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=256)
    assert controller.value == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_adaptive_kl_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5, clipped to 0.2: × (1 + .2·256/1e4)
    assert controller.value == pytest.approx(0.100512)
    controller.update(current_kl=3.0, n_steps=100)  # error -0.5, clipped to -0.2: × (1 - .2·100/1e4)
    assert controller.value == pytest.approx(0.100512 * 0.998)
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=6.6, n_steps=1000)  # error 0.1, within bounds: × 1.01
    assert controller.value == pytest.approx(0.101)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)

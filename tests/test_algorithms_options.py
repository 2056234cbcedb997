"""Options matching verl / OpenRLHF settings, by hand: singleton groups, ReMax, reward
clipping, the abs and straight-through KL estimators, GSPO's clamp, the ppo_kl metric, and
the config tables that name them."""

import math
import re

import pytest
import torch

from distflow.algorithms import kl
from distflow.algorithms.advantages import (
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from distflow.algorithms.aggregation import SeqMeanTokenMean, aggregate_loss
from distflow.algorithms.losses import gspo_loss, ppo_kl
from distflow.algorithms.returns import reinforce_pp_advantages
from distflow.algorithms.shaping import clip_reward
from distflow.config import ConfigError, load_config
from distflow.config.algorithm import ALGORITHMS, AlgorithmConfig, KLConfig
from distflow.config.components import (
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
)

# Group 0 has one sample (reward 3); group 1 has two (1 and 0).
REWARD = torch.tensor([3.0, 1.0, 0.0])
GROUP = torch.tensor([0, 1, 1])


def test_a_group_of_one_keeps_its_reward_in_every_group_estimator():
    # verl's convention: baseline 0 (and std 1) for a group of one, and it is not flagged.
    grpo, grpo_zero = grpo_advantages(REWARD, GROUP)
    # group 1: centred ±0.5, unbiased std sqrt(0.5); ε = 1e-6 is added to every std
    std = math.sqrt(0.5) + 1e-6
    assert grpo.tolist() == pytest.approx([3 / (1 + 1e-6), 0.5 / std, -0.5 / std], rel=1e-6)
    dr_grpo, dr_zero = grpo_advantages(REWARD, GROUP, norm_by_std=False)
    assert dr_grpo.tolist() == [3.0, 0.5, -0.5]
    rloo, rloo_zero = rloo_advantages(REWARD, GROUP)
    assert rloo.tolist() == [3.0, 1.0, -1.0]  # 1 - 0, 0 - 1
    mask = torch.tensor([[1, 0], [1, 1], [1, 0]])
    centred = reinforce_pp_baseline_advantages(REWARD, GROUP, mask, whiten=False)
    assert centred.tolist() == [[3.0, 0.0], [0.5, 0.5], [-0.5, 0.0]]
    for zero in (grpo_zero, dr_zero, rloo_zero):
        assert zero.tolist() == [False, False, False]


def test_equal_groups_of_two_or_more_are_still_flagged():
    reward = torch.tensor([0.0, 0.7, 0.7])
    for estimator in (grpo_advantages, rloo_advantages):
        adv, zero = estimator(reward, torch.tensor([0, 1, 1]))
        assert adv.tolist() == [0.0, 0.0, 0.0]  # the singleton's reward is 0 too, but it is not flagged
        assert zero.tolist() == [False, True, True]


def test_reinforce_pp_whitens_before_rounding_to_float32():
    # 2^24 + 1 has no float32: rounded first, the two returns would be equal and whiten to 0.
    reward = torch.tensor([[2.0**24 + 1], [2.0**24]], dtype=torch.float64)
    adv, returns = reinforce_pp_advantages(reward, torch.ones(2, 1))
    # mean 2^24 + 0.5, deviations ±0.5, unbiased variance 2·0.25 / 1 = 0.5
    expected = 0.5 / math.sqrt(0.5 + 1e-8)
    assert adv.dtype == torch.float32
    assert adv.flatten().tolist() == pytest.approx([expected, -expected], rel=1e-6)
    assert returns.flatten().tolist() == [2.0**24, 2.0**24]  # the returns themselves are float32


def test_remax_by_hand():
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 2.0])
    group = torch.tensor([4, 4, 4, 8, 8, 9])
    baseline = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.5])  # each group's greedy reward
    adv, no_signal = remax_advantages(reward, group, baseline)
    assert adv.tolist() == [0.0, -1.0, 0.0, 0.0, 0.0, 1.5]
    # group 8 equals its baseline everywhere: no signal; group 4 has one sample that differs.
    assert no_signal.tolist() == [False, False, False, True, True, False]


def test_reward_clip_by_hand():
    assert clip_reward(torch.tensor([-5.0, -1.0, 0.25, 1.5]), limit=1.0).tolist() == [-1.0, -1.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="> 0"):
        clip_reward(torch.zeros(1), limit=0.0)


LOGP = [0.0, -1.0, -2.0]
REF = [0.0, -2.0, -1.0]  # log-ratio logp - ref = 0, 1, -1


def _value_and_grad(estimator):
    logp = torch.tensor([LOGP], requires_grad=True)
    value = estimator(logp, torch.tensor([REF]))
    value.sum().backward()
    return value.detach().tolist()[0], logp.grad.tolist()[0]


def test_abs_estimator_by_hand():
    value, grad = _value_and_grad(kl.kl_abs)
    assert value == [0.0, 1.0, 1.0]
    assert grad == [0.0, 1.0, -1.0]  # sign of the log-ratio (0 at 0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("k1+", [0.0, 1.0, -1.0]),  # k1 = log-ratio
        ("k3+", [0.0, math.exp(-1.0), math.e - 2.0]),  # k3 = e^d - d - 1 with d = -1, 1
    ],
)
def test_straight_through_estimators_have_k2_gradient(name, value):
    got_value, got_grad = _value_and_grad(KL_ESTIMATORS[name])
    assert got_value == pytest.approx(value, rel=1e-6)
    # k2 = ½ (logp - ref)²: its gradient is the log-ratio 0, 1, -1 (k1's would be 1, 1, 1).
    assert got_grad == pytest.approx([0.0, 1.0, -1.0], abs=1e-7)


def test_gspo_clamps_the_sequence_log_ratio_at_ten_from_above_only():
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[15.0, 15.0], [-30.0, -30.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 2)
    loss, _ = gspo_loss(logp, old, torch.tensor([-1.0, 1.0], dtype=torch.float64), mask)
    # Row 0: log s = 15 → 10; A = -1: max(e^10, clip(e^10) = 1.0004) = e^10, as verl.
    assert loss[0].tolist() == pytest.approx([math.exp(10.0)] * 2, rel=1e-12)
    # Row 1: log s = -30 is not clamped (a ±20 clamp would give e^-20); A = 1: max(-e^-30, -0.9997).
    assert loss[1].tolist() == pytest.approx([-math.exp(-30.0)] * 2, rel=1e-12)
    aggregate_loss(loss, mask, SeqMeanTokenMean).backward()
    # Row 0 is past the clamp: no gradient. Row 1: -A·s / |y| / 2 sequences per token.
    assert logp.grad[0].tolist() == [0.0, 0.0]
    assert logp.grad[1].tolist() == pytest.approx([-math.exp(-30.0) / 4] * 2, rel=1e-12)


def test_ppo_kl_by_hand():
    logp = torch.tensor([[0.5, -0.25, 30.0]])
    per_token = ppo_kl(logp, torch.zeros(1, 3))
    assert per_token.tolist()[0] == [-0.5, 0.25, -20.0]  # -(logp - old), clamped at ±20 as verl's PPO loss
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert ((per_token * mask).sum() / mask.sum()).item() == -0.125  # the logged mean over loss tokens


def test_config_choices_are_the_registries_names():
    """One list per option: the check at load names exactly the registry's names, in its order."""
    for option, value, registry in [
        ("loss_agg", "mean", LOSS_AGGREGATIONS),
        ("kl.estimator", "k4", KL_ESTIMATORS),
        ("policy_loss", "grpo", POLICY_LOSSES),
        ("off_policy_correction", "clip", OFF_POLICY_CORRECTIONS),
    ]:
        names = ", ".join(registry)  # the plain names (a `module:name` imported by an earlier test is not listed)
        with pytest.raises(ConfigError, match=re.escape(f"algorithm.{option} must be one of: {names} ")):
            load_config(None, [f"algorithm.{option}={value}"])
    load_config(None)
    assert all(builtin.estimator in ESTIMATORS for builtin in ALGORITHMS.values())
    assert all(builtin.policy_loss in POLICY_LOSSES for builtin in ALGORITHMS.values())
    assert all(builtin.loss_agg in LOSS_AGGREGATIONS for builtin in ALGORITHMS.values())
    assert "remax" in ESTIMATORS


def test_reward_clip_and_remax_config():
    assert AlgorithmConfig().reward_clip == 0.0
    assert AlgorithmConfig(name="remax").skip_zero_variance_groups is False
    assert AlgorithmConfig(kl=KLConfig(estimator="k3+"), loss_agg="token-sum").kl.estimator == "k3+"
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="reward_clip"):
            AlgorithmConfig(reward_clip=bad)
    with pytest.raises(ConfigError, match="k1\\+, k3\\+"):  # checked with the registry, when the config is loaded
        load_config(None, ["algorithm.kl.estimator=low_var_kl++"])

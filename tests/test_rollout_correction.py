"""The rollout-correction toolkit (algorithms/correction_levels.py, algorithms/off_policy.py) against
verl's `rollout_corr` formulas (verl/trainer/ppo/rollout_corr_helper.py), in float64 on shared random
inputs. verl's formulas are written out below from its documentation, one line each:

    IS, token:      w_t = min(exp(clamp(lr_t, ±20)), thr)
    IS, sequence:   w_t = min(exp(clamp(Σ_s m_s·lr_s, ±20)), thr)
    RS, token_k1:   keep_t ⇔ log(lower) ≤ -lr_t ≤ log(upper)
    RS, seq_sum_k1: keep ⇔ log(lower) ≤ Σ_s m_s·(-lr_s) ≤ log(upper)
    RS, seq_mean_k1 (the geometric level): the same with the mean over the sequence's tokens

with lr = old_log_prob − rollout_log_prob = log π_p/π_b. Conventions that differ, documented in
docs/features/async.md: verl's k1 bounds are on π_b/π_p (−lr), distflow's floor and cap on π_p/π_b,
so verl's `lower_upper` is distflow's floor 1/upper and cap 1/lower; a distflow mask weighs a kept
token by its ratio (verl multiplies its RS mask by the separate IS weight); and a masked token stays
in the loss's normaliser (verl drops it from the response mask)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import REPO, run_cli

from distflow.algorithms.correction_levels import level_ratio_BR
from distflow.algorithms.off_policy import GEO_MASK, GEO_TIS, MASK, SEQ_MASK, SEQ_TIS, TIS, OffPolicyCorrection
from distflow.config import load_config
from distflow.config.algorithm import AlgorithmConfig
from distflow.config.errors import ConfigError
from distflow.dag.update_stages import OffPolicyTally, PolicyObjective
from distflow.data.batch import Batch

SAFETY_BOUND = 20.0  # verl's


def _inputs(seed: int = 0, rows: int = 64, width: int = 24):
    g = torch.Generator().manual_seed(seed)
    prox_BR = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    behav_BR = prox_BR + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    lengths_B = torch.randint(1, width + 1, (rows,), generator=g)
    mask_BR = (torch.arange(width)[None, :] < lengths_B[:, None]).to(torch.float64)
    behav_BR[:4] = prox_BR[:4] + 30.0  # a few far-off rows: the ±20 clamp is exercised
    return prox_BR, behav_BR, mask_BR


def _verl_is(lr_BR, mask_BR, level: str, thr: float):
    if level == "token":
        weights_BR = torch.exp(lr_BR.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        total_B1 = (lr_BR * mask_BR).sum(-1, keepdim=True)
        weights_BR = torch.exp(total_B1.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr_BR)
    return (weights_BR * mask_BR).clamp(max=thr)


def _verl_rs_k1(lr_BR, mask_BR, option: str, lower: float, upper: float):
    k1_BR = -lr_BR.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if option == "token_k1":
        stat_BR = k1_BR
    else:
        total_B = (k1_BR * mask_BR).sum(-1)
        if option == "seq_mean_k1":
            total_B = total_B / mask_BR.sum(-1).clamp(min=1)
        stat_BR = total_B[:, None].expand_as(lr_BR)
    return ((stat_BR >= math.log(lower)) & (stat_BR <= math.log(upper))).to(lr_BR.dtype)


@pytest.mark.parametrize(("correction", "level"), [(TIS, "token"), (SEQ_TIS, "sequence")])
@pytest.mark.parametrize("cap", [1.5, 2.0, 10.0])
def test_truncated_weights_are_verl_s_truncated_is(correction, level, cap):
    prox_BR, behav_BR, mask_BR = _inputs()
    ratio_BR = correction.ratio_BR(prox_BR, behav_BR, mask_BR)
    ours_BR = correction(ratio_BR, cap) * mask_BR
    assert correction.level == level
    torch.testing.assert_close(ours_BR, _verl_is(prox_BR - behav_BR, mask_BR, level, cap), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("correction", "option"), [(MASK, "token_k1"), (SEQ_MASK, "seq_sum_k1"), (GEO_MASK, "seq_mean_k1")]
)
@pytest.mark.parametrize(("lower", "upper"), [(0.5, 2.0), (0.2, 5.0), (0.8, 1.1)])
def test_masks_keep_verl_s_k1_rejection_with_its_bounds_inverted(correction, option, lower, upper):
    prox_BR, behav_BR, mask_BR = _inputs(seed=1)
    algo = AlgorithmConfig(off_policy_correction="mask", off_policy_floor=1 / upper, off_policy_cap=1 / lower)
    ratio_BR = correction.ratio_BR(prox_BR, behav_BR, mask_BR)
    loss_BR = torch.ones_like(prox_BR)
    ours_BR = correction.apply(loss_BR, ratio_BR, algo) * mask_BR
    keep_BR = _verl_rs_k1(prox_BR - behav_BR, mask_BR, option, lower, upper) * mask_BR
    # A kept token weighs its ratio at the correction's level, a dropped one 0: verl's RS mask times the
    # level's (untruncated) ratio. Bounds meet the statistic exactly only on a measure-zero set.
    assert 0 < float(keep_BR.sum()) < float(mask_BR.sum())  # the band cuts somewhere in these inputs
    torch.testing.assert_close(ours_BR, keep_BR * ratio_BR, rtol=1e-12, atol=0)


def test_the_geometric_ratio_is_the_sequences_per_token_geometric_mean():
    prox_BR, behav_BR, mask_BR = _inputs(seed=2)
    geo_BR = GEO_TIS.ratio_BR(prox_BR, behav_BR, mask_BR)
    token_BR = level_ratio_BR(prox_BR, behav_BR, mask_BR, "token")
    for b in range(4, 12):  # rows within the ±20 clamp
        n = int(mask_BR[b].sum())
        expected = math.prod(token_BR[b, :n].tolist()) ** (1 / n)
        assert geo_BR[b].tolist() == pytest.approx([expected] * geo_BR.shape[1], rel=1e-9)
    # on-policy (the same log-probs) every level's ratio is exactly 1
    for correction in (TIS, SEQ_TIS, GEO_TIS):
        assert torch.equal(correction.ratio_BR(prox_BR, prox_BR, mask_BR), torch.ones_like(prox_BR))


def test_a_user_correction_is_token_level_and_truncates_with_the_cap():
    user = OffPolicyCorrection.named("tis")
    assert user.level == "token" and not user.takes_floor
    with pytest.raises(ValueError, match="level is one of token, sequence, geometric"):
        OffPolicyCorrection(lambda r, c: r, level="batch")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.off_policy_floor=1.5"], "algorithm.off_policy_floor must be in [0, 1] (got 1.5)"),
        (
            ["algorithm.off_policy_correction=tis", "algorithm.off_policy_floor=0.5"],
            "algorithm.off_policy_floor applies to the masks (mask, seq_mask, geo_mask), not to "
            "algorithm.off_policy_correction=tis",
        ),
    ],
)
def test_a_floor_outside_the_masks_is_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_icepop_s_band_loads_and_the_cli_refuses_a_floored_tis_in_one_line(tmp_path):
    algo = load_config(
        None, ["algorithm.off_policy_correction=mask", "algorithm.off_policy_floor=0.5", "algorithm.off_policy_cap=5"]
    ).algorithm
    assert (algo.off_policy_floor, algo.off_policy_cap) == (0.5, 5.0)
    recipe, floored = str(REPO / "examples/arith_grpo.yaml"), "algorithm.off_policy_floor=0.5"
    result = run_cli("train", recipe, "algorithm.off_policy_correction=geo_tis", floored, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "algorithm.off_policy_floor applies to the masks" in lines[0]


GEO = 1.5 ** (1 / 3)


@pytest.mark.parametrize(
    ("correction", "floor", "ratios", "weights", "under_floor"),
    [
        ("seq_tis", 0.0, [1.5] * 3, [1.5] * 3, None),  # the product 1·3·0.5, under the cap 2
        ("geo_tis", 0.0, [GEO] * 3, [GEO] * 3, None),
        ("mask", 0.6, [1.0, 3.0, 0.5], [1.0, 0.0, 0.0], 1.0),  # 3 is above the cap, 0.5 below the floor
        ("seq_mask", 0.6, [1.5] * 3, [1.5] * 3, 0.0),
        ("geo_mask", 0.0, [GEO] * 3, [GEO] * 3, 0.0),
    ],
)
def test_the_policy_update_weighs_each_token_by_its_levels_ratio(correction, floor, ratios, weights, under_floor):
    """One on-policy micro-batch of three tokens with A = +1 and π_p/π_b = 1, 3, 0.5: the loss per token
    is -A·w, its gradient -w (the ratio to the proximal policy is 1 with derivative 1); the tally counts
    the level's ratios (`off_policy/is_weight_*`) and a mask's tokens under its floor."""
    algo = AlgorithmConfig(off_policy_correction=correction, off_policy_cap=2.0, off_policy_floor=floor)
    logp_BR = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).requires_grad_()
    behav_BR = logp_BR.detach() - torch.log(torch.tensor([[1.0, 3.0, 0.5]]))
    tensors = {"response_mask": torch.ones(1, 3), "sample_mask": torch.ones(1), "advantage": torch.ones(1)}
    micro = Batch(tensors={**tensors, "rollout_logp": behav_BR})
    tally = OffPolicyTally()
    total, _ = PolicyObjective(algo, has_old=False, tally=tally)(micro, logp_BR, torch.zeros(1, 3))
    total.backward()
    assert logp_BR.grad.tolist()[0] == pytest.approx([-w for w in weights])
    assert tally.ratio_sum == pytest.approx(sum(ratios)) and tally.ratio_max == pytest.approx(max(ratios))
    assert tally.num_under_floor == under_floor

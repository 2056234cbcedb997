"""The advantage estimators (`algorithm.estimator`): each one stage, with the stages it needs besides;
and the policy losses (`algorithm.policy_loss`), the pure losses of algorithms/losses.py given their settings.

    Estimator(fn, reads, writes, after_rollout=(...), before_advantage=(...), after_update=(...))
        the advantage stage itself, and the pieces (dag/pieces.py) it adds to the skeleton:
        remax   after the rollout: the greedy baseline (its completion's reward)
        gae     before the advantage: the critic's values; after the policy update: the critic's

A built-in pipeline (dag/pipelines.py) is the skeleton with the estimator's stages where it
declares them, so an estimator of one's own with a stage of its own is one file:
`algorithm.estimator: 'package.module:NAME'` (an `Estimator`), found through config/components.py.
So is a policy loss of one's own: `algorithm.policy_loss: 'package.module:function'`, with the
signature of `ppo_policy_loss` below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.dag import pieces
from distflow.dag.advantage_stages import (
    gae_advantage,
    grpo_advantage,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from distflow.dag.pieces import Estimator
from distflow.data.fields import ADVANTAGE, BASELINE_REWARD, GROUP, RESPONSE_MASK, RETURNS, REWARD, SAMPLE_MASK, VALUES

if TYPE_CHECKING:
    import torch

    from distflow.config.algorithm import AlgorithmConfig

GRPO = Estimator(grpo_advantage, (REWARD, GROUP, RESPONSE_MASK))
RLOO = Estimator(rloo_advantage, (REWARD, GROUP, RESPONSE_MASK))
REMAX = Estimator(
    remax_advantage, (REWARD, BASELINE_REWARD, GROUP, RESPONSE_MASK), after_rollout=(pieces.add_greedy_baseline,)
)
REINFORCE_PP = Estimator(reinforce_pp_advantage, (REWARD, RESPONSE_MASK))
REINFORCE_PP_BASELINE = Estimator(reinforce_pp_baseline_advantage, (REWARD, GROUP, RESPONSE_MASK))
GAE = Estimator(
    gae_advantage,
    (REWARD, RESPONSE_MASK, VALUES),
    (ADVANTAGE, RETURNS, SAMPLE_MASK),
    before_advantage=(pieces.add_values,),
    after_update=(pieces.add_critic_update,),
)


def ppo_policy_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage: torch.Tensor,
    mask_BR: torch.Tensor,
    algo: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ppo`: the clipped token ratio (dual-clip with `algorithm.clip.dual_c` > 0) as (loss_BR, clipped_BR),
    unreduced; `advantage` per sequence `[B]` or per token `[B, R]`, `mask_BR` the loss tokens."""
    from distflow.algorithms.losses import dual_clip_ppo_loss, ppo_clip_loss

    if algo.clip.dual_c > 0:
        loss_BR, clipped_BR, _ = dual_clip_ppo_loss(
            logp_BR,
            old_logp_BR,
            advantage,
            clip_low=algo.clip.low,
            clip_high=algo.clip.high,
            clip_ratio_c=algo.clip.dual_c,
        )
        return loss_BR, clipped_BR
    return ppo_clip_loss(logp_BR, old_logp_BR, advantage, clip_low=algo.clip.low, clip_high=algo.clip.high)


def gspo_policy_loss(
    logp_BR: torch.Tensor,
    old_logp_BR: torch.Tensor,
    advantage: torch.Tensor,
    mask_BR: torch.Tensor,
    algo: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gspo`: the clipped sequence ratio (a geometric mean over `mask_BR`'s tokens)."""
    from distflow.algorithms.losses import gspo_loss

    return gspo_loss(logp_BR, old_logp_BR, advantage, mask_BR, clip_low=algo.clip.low, clip_high=algo.clip.high)

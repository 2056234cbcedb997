"""The advantage estimators (`algorithm.estimator`): each one stage, with the stages it needs besides (the
policy losses, `algorithm.policy_loss`, are algorithms/policy_losses.py's).

    Estimator(fn, reads, writes, after_rollout=(...), before_advantage=(...), after_update=(...))
        the advantage stage itself, and the pieces (dag/pieces.py) it adds to the skeleton:
        remax   after the rollout: the greedy baseline (its completion's reward)
        gae     before the advantage: the critic's values; after the policy update: the critic's

A built-in pipeline (dag/pipelines.py) is the skeleton with the estimator's stages where it
declares them, so an estimator of one's own with a stage of its own is one file:
`algorithm.estimator: 'package.module:NAME'` (an `Estimator`), found through config/components.py.
"""

from __future__ import annotations

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

"""One GRPO step as one file: the graph every rank runs, stage by stage, with what each does and why.

Run it (from the repository's root; `distflow train` puts the working directory on sys.path):

    distflow train examples/arith_grpo.yaml pipeline.builder=examples.grpo_one_file:build
    distflow train examples/arith_grpo.yaml pipeline.builder=examples.grpo_one_file:build --nproc 2

`tests/test_grpo_one_file.py` checks that its run logs the built-in GRPO's metrics bit for bit. The
built-in (`distflow.dag.pipelines:builtin`) is the same skeleton with more optional pieces: a KL
term, a critic, dynamic sampling, reward clipping; copy this file to change one of these stages.

Every rank builds this graph from the config, identically, and runs its own copy of it: there is
no driver. A stage is a function `(batch, ctx) -> batch` of the rank's share of the step's samples
(`ctx` holds the config, the step, the rank's models and its communicator). A stage declares the
fields it reads and writes, so the graph is checked before anything runs, and the planner knows
where data must move when the next stage runs on other ranks.

    loader (each rank reads its own prompts) → rollout → reward → advantage → policy_update → weight_sync
"""

from __future__ import annotations

import torch

from distflow.algorithms.advantages import grpo_advantages
from distflow.algorithms.losses import per_token
from distflow.dag import stages, update_stages
from distflow.dag.context import StageContext
from distflow.dag.graph import Graph, Stage
from distflow.data.batch import Batch
from distflow.data.fields import (
    ADVANTAGE,
    COMPLETION,
    GROUP,
    PROMPT,
    PROMPT_IDS,
    RESPONSE_MASK,
    REWARD,
    SAMPLE,
    SAMPLE_MASK,
    SEQUENCE,
    UID,
)


def grpo_advantage(batch: Batch, ctx: StageContext) -> Batch:
    """GRPO's advantage: each sample's reward against its own group's (the n samples of one prompt).

    A_i = (r_i - mean of its group) / (std of its group + eps), the same for every token of sample i.
    No critic: the group is the baseline. The planner keeps a prompt's samples on one rank for this
    stage, so the group statistics never depend on the world size. A group whose rewards are all
    equal carries no signal (A = 0 everywhere); with `algorithm.skip_zero_variance_groups` it is
    also left out of the loss's normaliser (its `sample_mask` is 0).
    """
    reward_B = batch[REWARD].double()  # composed in float64, rounded to float32 once, at the end
    advantage_B, zero_variance_B = grpo_advantages(
        reward_B.cpu(), batch[GROUP].cpu(), norm_by_std=ctx.config.algorithm.norm_adv_by_std
    )
    ctx.metrics.mean("advantage/zero_variance_fraction", float(zero_variance_B.sum()), len(zero_variance_B))
    skip = ctx.config.algorithm.skip_zero_variance_groups
    keep_B = (~zero_variance_B if skip else torch.ones_like(zero_variance_B)).float()
    # The mean advantage over the tokens that enter the loss (0 for a std-normalised group, by design).
    mask_BR = batch[RESPONSE_MASK].cpu() * keep_B.unsqueeze(-1)
    ctx.metrics.mean("advantage/mean", float((per_token(advantage_B) * mask_BR).sum()), float(mask_BR.sum()))
    device = ctx.comm.device
    return batch.updated(advantage=advantage_B.to(device), sample_mask=keep_B.to(device))


def build(config) -> Graph:
    """The step's graph: each stage after the previous one (`deps`), on the ranks its `group` names
    (`placement.rollout` and `placement.train`; the same ranks by default, so nothing moves)."""
    _check(config)
    graph = Graph()
    behaviour = stages.behaviour_fields(config)  # the rollout's own log-probs, where the loss corrects for them

    # 1. Rollout: n completions per prompt (`rollout.num_samples`). Sample u draws token t from the key
    #    (seed, u) at position t, so a sample is the same whichever rank and batch it is decoded in. Each
    #    sample gets its own uid, and its prompt's uid as its `group`.
    rollout_writes = (*SEQUENCE, COMPLETION, GROUP, *behaviour)
    graph.add(
        Stage("rollout", stages.rollout, "rollout", (), (UID, PROMPT, PROMPT_IDS), rollout_writes, group="rollout")
    )

    # 2. Reward: the task's reward functions on each completion (`task.reward` or `task.rewards`), each
    #    call contained: one that raises or returns no number scores the default and is counted.
    graph.add(Stage("reward", stages.reward, "reward", ("rollout",), (PROMPT, COMPLETION, SAMPLE), (REWARD,)))

    # 3. Advantage: above. On the train ranks: when they are not the rollout's, the samples move here
    #    (whole prompt groups to one rank), rank to rank, with one all_to_all.
    advantage_reads = (REWARD, GROUP, RESPONSE_MASK)
    graph.add(Stage("advantage", grpo_advantage, "advantage", ("reward",), advantage_reads, (ADVANTAGE, SAMPLE_MASK)))

    # 4. Policy update: the clipped surrogate (`algorithm.policy_loss`, PPO's by default) over the step's
    #    tokens, in mini-batches (`algorithm.num_mini_batches`), each split into micro-batches by token
    #    budget; the gradients are normalised by the global token count, so the update does not depend
    #    on how the batch is split or on the world size. With one optimizer step per batch the ratio's
    #    denominator is the detached current log-prob: no separate old-log-prob pass is needed.
    update_reads = (*SEQUENCE, ADVANTAGE, SAMPLE_MASK, *behaviour)
    graph.add(Stage("policy_update", update_stages.policy_update, "train", ("advantage",), update_reads,
                    uses=("policy",)))  # fmt: skip

    # 5. Weight sync: the next rollout samples from the new weights. Colocated, the rollout engine
    #    shares the policy's tensors and is only told of the new version; disaggregated, each train rank
    #    sends its share of the parameters to every rollout rank.
    graph.add(Stage("weight_sync", stages.weight_sync, "sync", ("policy_update",), group="sync"))
    return graph


def _check(config) -> None:
    """What this file leaves out is refused in one line, not silently dropped (the built-in has it)."""
    from distflow.config import ConfigError
    from distflow.dag.pieces import needs_old_logprob

    algo, rollout = config.algorithm, config.rollout
    left_out = {
        f"algorithm.estimator={algo.estimator}": algo.estimator != "grpo",
        "a KL term (algorithm.kl.coef > 0)": algo.kl.coef > 0,
        "several optimizer steps per batch (algorithm.ppo_epochs, num_mini_batches)": needs_old_logprob(config),
        "algorithm.dynamic_sampling": algo.dynamic_sampling.enabled,
        "algorithm.reward_clip": algo.reward_clip > 0,
        "algorithm.overlong": algo.overlong.buffer > 0,
        "rollout.partial": rollout.partial > 0,
        "multi-turn rollouts (env.cls, rollout.agent)": config.env.cls is not None or rollout.agent is not None,
    }
    missing = [name for name, used in left_out.items() if used]
    if missing:
        raise ConfigError(
            f"examples/grpo_one_file.py has no stage for {', '.join(missing)}: leave pipeline.builder unset "
            "(the built-in has them) or add the stage to your copy of this file"
        )


if __name__ == "__main__":  # python examples/grpo_one_file.py: the same run through the Python API
    import distflow

    distflow.train("examples/arith_grpo.yaml", overrides=["pipeline.builder=examples.grpo_one_file:build"])

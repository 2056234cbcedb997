"""The pieces a pipeline is built from: each adds one step of the algorithm (one or a few stages)
to a `Chain`, the stages one after another. The built-in pipelines (dag/pipelines.py) are these
pieces in order; a custom pipeline (`pipeline.builder`) composes the same pieces, leaves some
out, or adds stages of its own between them:

    chain = Chain(config)
    add_rollout(chain)                       rollout (multi-turn when env.cls is set, agent episodes with rollout.agent)
    add_greedy_baseline(chain)               ReMax's baseline reward
    add_rewards(chain)                       reward → [reward_clip] → [dynamic_sampling] → [overlong_penalty]
    add_kl_reward(chain)                     old_logprob → reference_logprob → kl_reward (KL in the reward)
    add_values(chain)                        the critic's values (PPO)
    add_advantage(chain, estimator)
    add_logprobs(chain)                      [old_logprob] → [reference_logprob] (several updates / KL loss)
    add_mismatch_ledger(chain)               [mismatch_ledger]                  (rollout.mismatch_ledger)
    add_policy_update(chain); add_critic_update(chain)
    add_weight_sync(chain)
    chain.graph

A piece whose setting is off (algorithm.reward_clip = 0, ...) adds nothing, so a pipeline
need not repeat the algorithm's conditions. Fields are the constants of data/fields.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distflow.config.schema import Config
from distflow.dag import agent_stage, ledger_stage, multiturn_stage, partial_stage, stages, update_stages
from distflow.dag.dynamic_sampling import DynamicSampling
from distflow.dag.graph import Graph, Stage, StageFn
from distflow.data.fields import (
    ADVANTAGE,
    BASELINE_REWARD,
    COMPLETION,
    GROUP,
    KL_PENALTY,
    LOADER_FIELDS,
    MISMATCH_LEDGER,
    OLD_LOGP,
    PROMPT,
    PROMPT_IDS,
    REF_LOGP,
    RESPONSE_MASK,
    RETURNS,
    REWARD,
    ROUTED_EXPERTS,
    SAMPLE,
    SAMPLE_MASK,
    SEQUENCE,
    UID,
    VALUES,
)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: its stage, and the pieces it adds to the skeleton (dag/estimators.py)."""

    fn: StageFn
    reads: tuple[str, ...]
    writes: tuple[str, ...] = (ADVANTAGE, SAMPLE_MASK)
    after_rollout: tuple[Callable[[Chain], None], ...] = ()
    """Pieces added right after the rollout (ReMax's greedy baseline)."""
    before_advantage: tuple[Callable[[Chain], None], ...] = ()
    """Pieces added after the rewards (and an in-reward KL), right before the advantage (the critic's values)."""
    after_update: tuple[Callable[[Chain], None], ...] = ()
    """Pieces added after the policy update (the critic's update)."""


class Chain:
    """Adds stages one after another, each depending on the previous one."""

    def __init__(self, config: Config, graph: Graph | None = None) -> None:
        self.config = config
        self.graph = graph if graph is not None else Graph()
        self.last: str | None = None

    def add(self, name, fn, role, reads=(), writes=(), group="train", uses=()) -> None:
        deps = (self.last,) if self.last else ()
        self.graph.add(Stage(name, fn, role, deps, tuple(reads), tuple(writes), group=group, uses=tuple(uses)))
        self.last = name

    def has(self, name: str) -> bool:
        return name in self.graph.stages

    def writes(self, field: str) -> bool:
        """Whether a stage added so far writes `field`."""
        return any(field in stage.writes for stage in self.graph.stages.values())


def kl_in_reward(config: Config) -> bool:
    return config.algorithm.kl.coef > 0 and config.algorithm.kl.in_reward


def needs_old_logprob(config: Config) -> bool:
    """One rollout batch feeds several optimizer steps, or the KL is folded into the reward (with a
    single on-policy step the ratio's denominator is the detached current log-prob, bit for bit)."""
    algo = config.algorithm
    return algo.ppo_epochs * algo.num_mini_batches > 1 or kl_in_reward(config)


def add_rollout(chain: Chain) -> None:
    """Samples per prompt (and what the behaviour policy recorded, stages.behaviour_fields); multi-turn
    trajectories against an environment when `env.cls` is set."""
    behaviour = stages.behaviour_fields(chain.config)
    if chain.config.rollout.agent is not None:
        writes = tuple(dict.fromkeys(multiturn_stage.WRITES + behaviour))
        chain.add("rollout", agent_stage.AgentRolloutStage(), "rollout", LOADER_FIELDS, writes, group="rollout")
    elif chain.config.env.cls is not None:
        chain.add(
            "rollout",
            multiturn_stage.env_rollout,
            "rollout",
            LOADER_FIELDS,
            tuple(dict.fromkeys(multiturn_stage.WRITES + behaviour)),
            group="rollout",
        )
    elif chain.config.rollout.partial:
        writes = (*SEQUENCE, *partial_stage.WRITES)
        reads = (UID, PROMPT, PROMPT_IDS)
        chain.add("rollout", partial_stage.PartialRollout(), "rollout", reads, writes, group="rollout")
    else:
        chain.add(
            "rollout",
            stages.rollout,
            "rollout",
            (UID, PROMPT, PROMPT_IDS),
            (*SEQUENCE, COMPLETION, GROUP, *behaviour),
            group="rollout",
        )


def add_greedy_baseline(chain: Chain) -> None:
    """ReMax: on the rollout ranks, where each group's prompt already is."""
    chain.add(
        "greedy_baseline",
        stages.greedy_baseline,
        "rollout",
        (PROMPT, PROMPT_IDS, GROUP, SAMPLE),
        (BASELINE_REWARD,),
        group="rollout",
    )


def add_rewards(chain: Chain) -> None:
    """The reward functions' score, then as the algorithm's settings ask: clipped (before any shaping,
    as OpenRLHF clips the RM's), filtered by dynamic sampling (on the task's reward, before length
    shaping: DAPO keeps 0 < #correct < G), and the overlong penalty."""
    algo = chain.config.algorithm
    chain.add("reward", stages.reward, "reward", (PROMPT, COMPLETION, SAMPLE), (REWARD,))
    if algo.reward_clip > 0:
        chain.add("reward_clip", stages.reward_clip, "reward", (REWARD,), (REWARD,))
    if algo.dynamic_sampling.enabled:
        chain.add("dynamic_sampling", DynamicSampling(), "filter", (REWARD, GROUP))
    if algo.overlong.buffer > 0:
        chain.add("overlong_penalty", stages.overlong_penalty, "reward", (REWARD, RESPONSE_MASK), (REWARD,))


def add_logprobs(chain: Chain) -> None:
    """The behaviour policy's log-probs (when `needs_old_logprob`) and the reference's (with a KL term);
    each once: after `add_kl_reward` (which adds them for the KL in the reward) this adds nothing."""
    if needs_old_logprob(chain.config) and not chain.has("old_logprob"):
        routing = (ROUTED_EXPERTS,) if chain.config.rollout.records_routing else ()  # replayed in its forwards
        chain.add("old_logprob", stages.old_logprob, "logprob", (*SEQUENCE, *routing), (OLD_LOGP,), uses=("policy",))
    if chain.config.algorithm.kl.coef > 0 and not chain.has("reference_logprob"):
        chain.add("reference_logprob", stages.reference_logprob, "logprob", SEQUENCE, (REF_LOGP,), uses=("reference",))


def add_mismatch_ledger(chain: Chain) -> None:
    """The mismatch ledger's train-side recomputes (`rollout.mismatch_ledger`), with the weights the update
    starts from: after the log-prob passes, before the update (dag/ledger_stage.py)."""
    if chain.config.rollout.mismatch_ledger:
        routing = (ROUTED_EXPERTS,) if chain.config.rollout.records_routing else ()
        reads = (*SEQUENCE, MISMATCH_LEDGER, *routing)
        chain.add(
            "mismatch_ledger", ledger_stage.mismatch_ledger, "logprob", reads, (MISMATCH_LEDGER,), uses=("policy",)
        )


def add_kl_reward(chain: Chain) -> None:
    """KL in the reward (`algorithm.kl.in_reward`): both log-prob passes, then the per-token penalty."""
    if kl_in_reward(chain.config):
        add_logprobs(chain)
        chain.add(
            "kl_reward",
            stages.KLPenalty(chain.config.algorithm),
            "reward",
            (OLD_LOGP, REF_LOGP, RESPONSE_MASK),
            (KL_PENALTY,),
        )


def add_values(chain: Chain) -> None:
    chain.add("values", stages.values, "value", SEQUENCE, (VALUES,), uses=("critic",))


def add_advantage(chain: Chain, estimator: Estimator) -> None:
    extra = (KL_PENALTY,) if chain.writes(KL_PENALTY) else ()
    chain.add("advantage", estimator.fn, "advantage", estimator.reads + extra, estimator.writes)


def add_policy_update(chain: Chain) -> None:
    """Reads the behaviour log-probs when a stage writes them, and the reference's for a KL loss."""
    reads = [*SEQUENCE, ADVANTAGE, SAMPLE_MASK, *stages.behaviour_fields(chain.config)]
    if chain.writes(OLD_LOGP):
        reads.append(OLD_LOGP)
    if chain.writes(REF_LOGP) and not kl_in_reward(chain.config):
        reads.append(REF_LOGP)
    chain.add("policy_update", update_stages.policy_update, "train", reads, uses=("policy",))


def add_critic_update(chain: Chain) -> None:
    chain.add("critic_update", update_stages.critic_update, "train", (*SEQUENCE, VALUES, RETURNS), uses=("critic",))


def add_weight_sync(chain: Chain) -> None:
    """After the policy update, on every rank (the rollout samples from the new policy)."""
    chain.graph.add(Stage("weight_sync", stages.weight_sync, "sync", ("policy_update",), group="sync"))

"""The agent rollout stage (`rollout.agent` set): episodes of the user's agent code, each driving
the model through an OpenAI-compatible endpoint that this rank serves over its rollout engine.

    rank r (a rollout rank) ─ engines.agent: its AgentRollout (distflow/agents/; built with the worker,
                              its endpoint started at first use, shared with the held-out evaluation)
        its n samples of each prompt ─► one episode each: fn(openai client of the episode's session, row)
        the episode's model calls ──► one trajectory, token in and token out (the sampled ids and their
                                      log-probs, never the text re-tokenized), the longest chain of calls
                                      that extend each other when the agent branched (counted)
        laid out as the multi-turn rollout's samples: [left pad | prompt | response | right pad],
        `response_mask` 1 on sampled tokens only, the agent's reward on the last one (`turn_reward`)

Each call's sampling key derives from (seed, sample uid, call number in the episode, choice), so a
sample is the same on any rank and in whatever order the agents' requests arrive. Ranks of the
rollout group agree on the prompt width with one all-reduce, as the other rollouts do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.console import say
from distflow.dag.multiturn_stage import layout
from distflow.data.fields import PROMPT_IDS, RESPONSE_MASK, SAMPLE, UID

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch

EMBEDDED_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}{{ call['function']['arguments']['expression'] }}={%- endfor -%}"
    "{%- elif message['content'] -%}{{ message['content'] }}{%- endif -%}{{ eos_token }}"
    "{%- elif message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)
"""How the embedded model (distflow's own character tokenizer, which has no chat roles) reads
messages: their contents one after another, so the addition task's prompt reads as it does alone;
an assistant turn ends with EOS, and its calculator call (the `equals` convention of
`agents/tool_calls.py`) reads as "expression=". An agent's calculator episode is then, token for
token, the calculator environment's transcript: `12+34+56=` `(12+34)=<eos>` `46` `(46+56)=<eos>` ..."""


class AgentRolloutStage:
    """The stage; the endpoint it samples through is this rank's `engines.agent`."""

    def __call__(self, batch: Batch, ctx: StageContext) -> Batch:
        import torch

        from distflow.dag.stages import policy_versions, sample_uids
        from distflow.training.parallelize import gathered

        n = ctx.config.rollout.num_samples
        expanded = batch.repeat_interleave(n)
        uids = sample_uids(expanded[UID], n)
        rows = [dict(row) for row in expanded[SAMPLE]]
        with gathered(ctx.engines.rollout_model):  # the endpoint samples from the whole policy
            result = ctx.engines.agent.run(rows, uids)
        trajs = _one_per_episode(result, expanded[PROMPT_IDS], rows, uids)
        width = int(ctx.comm.all_reduce_max(torch.tensor([max(len(t.prompt_ids) for t in trajs)])).item())
        truncated = [_cut(t, ctx.config.env.max_tokens) for t in trajs]
        tensors = layout(trajs, width, ctx.config.env.max_tokens, ctx.tokenizer.pad_token_id)
        _record(ctx, result, tensors[RESPONSE_MASK], sum(truncated))
        device = ctx.comm.device
        return expanded.updated(
            uid=uids,
            group=torch.tensor(expanded[UID], dtype=torch.long),
            **policy_versions(ctx, len(trajs)),
            completion=[t.actions[-1] if t.actions else "" for t in trajs],
            **{name: value.to(device) for name, value in tensors.items()},
        )


def agent_rollout(config, tokenizer, model, sampling):
    """A rollout rank's `AgentRollout` (`rollout.agent` set) over its rollout engine: the training
    rollout and the held-out evaluation share it; its endpoint starts at the first use."""
    from distflow.agents.backend import EngineBackend
    from distflow.agents.rollout import AgentConfig, AgentRollout
    from distflow.agents.server import ServerConfig

    embedded = config.model.path is None
    server = ServerConfig(
        seed=config.trainer.seed,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        chat_template=EMBEDDED_CHAT_TEMPLATE if embedded else None,
        tool_call_format="equals" if embedded else "hermes",
    )
    agent = AgentConfig(
        fn=config.rollout.agent,
        timeout_s=config.rollout.agent_timeout_s,
        default_reward=config.env.default_reward,
        server=server,
    )
    return AgentRollout(agent, tokenizer, EngineBackend(model, tokenizer, engine=sampling.engine))


def _one_per_episode(result, prompt_ids: list, rows: list, uids: list) -> list:
    """Each episode's trajectory: its longest chain of calls (`AgentResult.longest`); an episode
    without model calls is its prompt with an empty response (it scores the default reward)."""
    from distflow.agents.trajectory import to_trajectory
    from distflow.rollout.multiturn import Trajectory

    return [
        to_trajectory(sample, rows[i], uid=episode.uid, reward=episode.reward)
        if sample is not None
        else Trajectory(sample=rows[i], env=None, env_seconds=0.0, uid=uids[i], prompt_ids=list(prompt_ids[i]))
        for i, (episode, sample) in enumerate(zip(result.episodes, result.longest(), strict=True))
    ]


def _cut(traj, width: int) -> bool:
    """Keep the first `width` response tokens (the layout's width); whether any were cut."""
    if len(traj.ids) <= width:
        return False
    kept_reward = sum(traj.reward)
    traj.ids, traj.mask, traj.logp, traj.reward = (x[:width] for x in (traj.ids, traj.mask, traj.logp, traj.reward))
    sampled = [i for i, m in enumerate(traj.mask) if m]
    if sampled:  # the episode's reward stays on its last sampled token that is kept
        traj.reward = [0.0] * width
        traj.reward[sampled[-1]] = kept_reward
    return True


def _record(ctx: StageContext, result, mask_BR, num_truncated: int) -> None:
    """The rollout's metrics: the episodes' `agent/*` (`AgentResult.metrics`, as the evaluation's), the
    responses' lengths."""
    stats = result.stats
    m, count = ctx.metrics, max(stats["episodes"], 1)
    means, totals = result.metrics()
    for name, (value, episodes) in means.items():
        m.mean(name, value, max(episodes, 1))
    for name, value in totals.items():
        m.total(name, value)
    m.mean("response/length", float(mask_BR.sum()), count)
    m.quantiles("response/length", mask_BR.sum(-1).tolist(), size=mask_BR.shape[1] + 1)  # model tokens only
    m.total("tokens/generated", float(mask_BR.sum()))
    m.mean("agent/truncated", float(num_truncated), count)
    failed = stats["agent_errors"] + stats["timeouts"]
    if failed:
        first = stats["first_error"]
        say(f"distflow: rank {ctx.world.rank}, step {ctx.step}: {failed} agent episode(s) failed; first: {first}")

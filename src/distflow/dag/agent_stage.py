"""The agent rollout stage (`rollout.agent` set): episodes of the user's agent code, each driving
the model through an OpenAI-compatible endpoint that this rank serves over its rollout engine.

    rank r (a rollout rank) ─ AgentRollout (distflow/agents/, started at the first step, kept)
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

PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""How the embedded model (distflow's own character tokenizer, which has no chat roles) reads
messages: their contents one after another, so the addition task's prompt reads as it does alone."""


class AgentRolloutStage:
    """The stage; it keeps this rank's endpoint between steps."""

    def __init__(self) -> None:
        self.rollout = None

    def __call__(self, batch: Batch, ctx: StageContext) -> Batch:
        import torch

        from distflow.dag.stages import policy_versions, sample_uids
        from distflow.engines.parallelize import gathered

        n = ctx.config.rollout.num_samples
        expanded = batch.repeat_interleave(n)
        uids = sample_uids(expanded[UID], n)
        rows = [dict(row) for row in expanded[SAMPLE]]
        with gathered(ctx.engines.rollout_model):  # the endpoint samples from the whole policy
            result = self._rollout(ctx).run(rows, uids)
        trajs = _one_per_episode(result.trajectories(rows), len(rows), expanded[PROMPT_IDS], rows, uids)
        width = int(ctx.comm.all_reduce_max(torch.tensor([max(len(t.prompt_ids) for t in trajs)])).item())
        truncated = [_cut(t, ctx.config.env.max_tokens) for t in trajs]
        tensors = layout(trajs, width, ctx.config.env.max_tokens, ctx.tokenizer.pad_token_id)
        _record(ctx, result.stats, tensors[RESPONSE_MASK], sum(truncated))
        device = ctx.comm.device
        return expanded.updated(
            uid=uids,
            group=torch.tensor(expanded[UID], dtype=torch.long),
            **policy_versions(ctx, len(trajs)),
            completion=[t.actions[-1] if t.actions else "" for t in trajs],
            **{name: value.to(device) for name, value in tensors.items()},
        )

    def _rollout(self, ctx: StageContext):
        """This rank's `AgentRollout` over its rollout engine, made at the first step."""
        if self.rollout is None:
            from distflow.agents.backend import EngineBackend
            from distflow.agents.rollout import AgentConfig, AgentRollout
            from distflow.agents.server import ServerConfig

            cfg, sampling = ctx.config, ctx.engines.sampling
            server = ServerConfig(
                seed=cfg.trainer.seed,
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                chat_template=PLAIN_CHAT_TEMPLATE if cfg.model.path is None else None,
            )
            agent = AgentConfig(
                fn=cfg.rollout.agent,
                timeout_s=cfg.rollout.agent_timeout_s,
                default_reward=cfg.env.default_reward,
                server=server,
            )
            backend = EngineBackend(ctx.engines.rollout_model, ctx.tokenizer, engine=sampling.engine)
            self.rollout = AgentRollout(agent, ctx.tokenizer, backend)
        return self.rollout


def _one_per_episode(found: list, count: int, prompt_ids: list, rows: list, uids: list) -> list:
    """Each episode's trajectory: its longest chain of calls (the one with most sampled tokens); an
    episode without model calls is its prompt with an empty response (it scores the default reward)."""
    from distflow.engines.multiturn import Trajectory

    best: dict[int, object] = {}
    for i, traj in found:
        if i not in best or sum(traj.mask) > sum(best[i].mask):
            best[i] = traj
    return [
        best.get(i)
        or Trajectory(sample=rows[i], env=None, env_seconds=0.0, uid=uids[i], prompt_ids=list(prompt_ids[i]))
        for i in range(count)
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


def _record(ctx: StageContext, stats: dict, mask_BR, num_truncated: int) -> None:
    m, count = ctx.metrics, max(stats["episodes"], 1)
    m.mean("response/length", float(mask_BR.sum()), count)
    m.total("tokens/generated", float(mask_BR.sum()))
    m.mean("agent/model_calls", float(stats["model_calls"]), count)
    m.mean("agent/truncated", float(num_truncated), count)
    for key in ("agent_errors", "timeouts", "no_model_calls", "bad_rewards", "malformed_requests", "over_cap_requests"):
        m.total(f"agent/{key}", float(stats[key]))
    m.total("agent/branched_episodes", float(stats["branched_episodes"]))
    failed = stats["agent_errors"] + stats["timeouts"]
    if failed:
        first = stats["first_error"]
        say(f"distflow: rank {ctx.world.rank}, step {ctx.step}: {failed} agent episode(s) failed; first: {first}")

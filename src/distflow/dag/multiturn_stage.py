"""The multi-turn rollout stage (`env.cls` set): trajectories against an environment.

The loop is `rollout.multiturn`; this stage builds one environment per sample, wires the
loop to the rollout model and the worker group's communicator, and lays the trajectories
out as the single-turn rollout does: ``[left pad | prompt | response | right pad]`` with the
response `env.max_tokens` wide. `response_mask` is 1 on model tokens only (0 on observation
tokens: holes inside the response); `rollout_logp` holds the sampled tokens' log-probs
(0 where the mask is 0); `turn_reward` holds each environment reward on the last model
token of the turn that earned it (the `reward` stage adds their sum to the sample's reward).
`completion` is the last action's text, which the task's reward functions and verifier grade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.data.fields import (
    ATTENTION_MASK,
    COMPLETION,
    GROUP,
    INPUT_IDS,
    PROMPT_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOGP,
    SAMPLE,
    SEQUENCE,
    TURN_REWARD,
    UID,
)
from distflow.seeding import derive_seed

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch

WRITES = (*SEQUENCE, COMPLETION, GROUP, ROLLOUT_LOGP, TURN_REWARD)


def env_rollout(batch: Batch, ctx: StageContext) -> Batch:
    import torch

    from distflow.dag.stages import policy_versions, sample_uids
    from distflow.envs import environment_class
    from distflow.rollout.multiturn import Trajectory, TurnLimits, reset_all, roll_out, turn_generator
    from distflow.training.parallelize import gathered

    cfg, n = ctx.config.env, ctx.config.rollout.num_samples
    expanded = batch.repeat_interleave(n)
    prompt_uids = expanded[UID]
    uids = sample_uids(prompt_uids, n)
    cls = environment_class(cfg.cls)
    limits = TurnLimits(cfg.max_turns, cfg.max_tokens, cfg.default_reward, cfg.num_workers)
    trajs = [
        Trajectory(sample=dict(s), env=cls(**cfg.kwargs), env_seconds=cfg.deadline_s, uid=uid)
        for s, uid in zip(expanded[SAMPLE], uids, strict=True)
    ]
    reset_all(trajs, ctx.tokenizer, expanded[PROMPT_IDS], limits)

    def agree(*values: int) -> tuple[int, ...]:
        out = ctx.comm.all_reduce_max(torch.tensor(values, dtype=torch.long, device=ctx.comm.device))
        return tuple(int(v) for v in out.tolist())

    seed = ctx.config.trainer.seed

    def key_of(traj: Trajectory, turn: int) -> int:
        return derive_seed(seed, "rollout-turn", traj.uid, turn)

    with gathered(ctx.engines.rollout_model):
        roll_out(
            trajs,
            tokenizer=ctx.tokenizer,
            limits=limits,
            agree=agree,
            generate_turn=turn_generator(ctx.engines.rollout_model, ctx.tokenizer, ctx.engines.sampling, key_of),
        )
    (prompt_width,) = agree(max((len(t.prompt_ids) for t in trajs), default=0))
    tensors = layout(trajs, prompt_width, cfg.max_tokens, ctx.tokenizer.pad_token_id)
    _record(ctx, trajs, tensors[RESPONSE_MASK])
    device = ctx.comm.device
    return expanded.updated(
        uid=uids,
        group=torch.tensor(prompt_uids, dtype=torch.long),
        **policy_versions(ctx, len(trajs)),
        completion=[t.actions[-1] if t.actions else "" for t in trajs],
        **{name: value.to(device) for name, value in tensors.items()},
    )


def layout(trajs: list, prompt_width: int, width: int, pad_id: int) -> dict:
    import torch

    from distflow.training.sequences import left_pad

    prompt_ids_BP, prompt_mask_BP = left_pad([t.prompt_ids for t in trajs], pad_id, width=prompt_width)
    shape = (len(trajs), width)
    ids_BR, real_BR = torch.full(shape, pad_id, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    mask_BR, logp_BR, reward_BR = torch.zeros_like(real_BR), torch.zeros(shape), torch.zeros(shape)
    for i, t in enumerate(trajs):
        k = len(t.ids)
        ids_BR[i, :k], real_BR[i, :k] = torch.tensor(t.ids, dtype=torch.long), 1
        mask_BR[i, :k] = torch.tensor(t.mask, dtype=torch.long)
        logp_BR[i, :k], reward_BR[i, :k] = torch.tensor(t.logp), torch.tensor(t.reward)
    return {
        INPUT_IDS: torch.cat([prompt_ids_BP, ids_BR], 1),
        ATTENTION_MASK: torch.cat([prompt_mask_BP, real_BR], 1),
        RESPONSE_MASK: mask_BR,
        ROLLOUT_LOGP: logp_BR * mask_BR,
        TURN_REWARD: reward_BR,
    }


def _record(ctx: StageContext, trajs: list, mask_BR) -> None:
    m, count = ctx.metrics, len(trajs)
    m.mean("response/length", float(mask_BR.sum()), count)
    m.quantiles("response/length", mask_BR.sum(-1).tolist(), size=mask_BR.shape[1] + 1)  # model tokens only
    m.total("tokens/generated", float(mask_BR.sum()))
    m.mean("env/turns", float(sum(len(t.actions) for t in trajs)), count)
    m.mean("env/tool_calls", float(sum(t.tool_calls for t in trajs)), count)
    m.mean("env/tool_call_rate", float(sum(t.tool_calls > 0 for t in trajs)), count)
    m.total("env/tool_errors", float(sum(t.tool_errors for t in trajs)))
    m.total("env/errors", float(sum(t.errors for t in trajs)))
    m.total("env/timeouts", float(sum(t.timeouts for t in trajs)))
    m.mean("env/truncated", float(sum(t.truncated for t in trajs)), count)
    m.mean("env/observation_tokens", float(sum(len(t.ids) - sum(t.mask) for t in trajs)), count)

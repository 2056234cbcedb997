"""Multi-turn rollout: model turns and environment observations in one token sequence.

    reset(sample) ──► prompt ids
    for turn < max_turns, while any trajectory of the worker group runs:
        agree(width, active)                 one all-reduce: same padding on every layout
        generate one turn for the running rows (keys (seed, uid, turn), positions from 0)
        append the sampled ids as they are ─ mask 1, their log-probs kept
        env.step(decoded action) for every running row, concurrently (envs.calls)
        reward of the step ─► on the turn's last model token
        append the observation's ids ─ mask 0, log-prob 0 ─ unless done / over budget

Token in, token out: a model token is appended exactly as sampled and never decoded and
re-encoded (only the action text handed to the environment is decoded); observation tokens
are encoded once, on their own, and appended after it. The sequence a trajectory trains on
is therefore the one it was sampled as. A trajectory ends when the environment says done,
at `max_turns`, at the `max_tokens` budget (the tokens past it are dropped), or when an
environment call raises, returns a turn reward that is not a finite float32 (NaN, inf, 1e308: as
a reward function's, scoring/reward.py) or runs past the environment time the trajectory has left
(`env.deadline_s` for all its calls together; generation does not count) — scored
`default_reward`, counted (`env/errors`, `env/timeouts`). Turn t of sample uid draws token k
from the key (seed, uid, t) at position k, and
each turn pads to the worker group's widest running sequence, so a trajectory does not
depend on the world size or on its batch-mates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distflow.envs.calls import run_calls
from distflow.scoring.reward import as_number, representable
from distflow.training.sequences import encode_prompts, end_of_turn, stop_token_ids

CHARS_PER_TOKEN = 32
"""Text observations are cut to this many characters per token of room left before encoding."""


@dataclass
class Trajectory:
    sample: dict
    env: Any
    env_seconds: float
    """Environment time this trajectory has left (`env.deadline_s` at the start)."""
    uid: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    """Response: model and observation tokens in order."""
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    errors: int = 0
    timeouts: int = 0
    truncated: bool = False
    done: bool = False

    def add(self, ids: list[int], *, model: bool, logp: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        self.reward += [0.0] * len(ids)


_CONTEXT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def encode_observation(tokenizer, observation, *, first: bool) -> list[int]:
    """Ids of an observation: text as is (special tokens only on the first); chat messages
    through the tokenizer's chat template, with the assistant's generation prompt.

    Messages after the first observation are rendered as what the template adds after an
    assistant turn (`_CONTEXT` + messages, minus `_CONTEXT` rendered alone up to the end of its
    assistant turn: the model sampled that turn's end-of-turn token itself, so the observation
    starts with what the template writes after it, e.g. ChatML's newline), so a template that
    opens every conversation with a default system prompt does not repeat it; where that
    rendering is not a prefix of the longer one they are rendered on their own.
    """
    if observation is None or observation == "" or observation == []:
        return []
    if isinstance(observation, str):
        return list(tokenizer(observation, add_special_tokens=first)["input_ids"])
    messages = list(observation)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not first:
        context = tokenizer.apply_chat_template(_CONTEXT, tokenize=False)
        turn_end = end_of_turn(tokenizer)
        if turn_end is not None and turn_end in context:
            context = context[: context.rindex(turn_end) + len(turn_end)]
        extended = tokenizer.apply_chat_template(_CONTEXT + messages, tokenize=False, add_generation_prompt=True)
        text = extended[len(context) :] if extended.startswith(context) else text
    if first:  # the conversation's start: special tokens as for a prompt (never a second BOS)
        return encode_prompts(tokenizer, [text])[0]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _contain(traj: Trajectory, outcome, default_reward: float) -> tuple[Any, float, bool, dict] | None:
    """The step's (observation, reward, done, info), or None after scoring a failed call."""
    traj.env_seconds -= outcome.seconds
    if outcome.timed_out or outcome.error is not None:
        traj.timeouts += outcome.timed_out
        traj.errors += outcome.error is not None
        traj.done = True
        _reward_last(traj, default_reward)
        return None
    try:
        observation, reward, done, info = outcome.value
        step = observation, as_number(reward), bool(done), dict(info or {})
    except (TypeError, ValueError):  # not (obs, reward, done, info): the environment's bug, contained
        step = None
    if step is None or not representable(step[1]):  # NaN, inf or beyond float32: as a reward function's
        traj.errors += 1
        traj.done = True
        _reward_last(traj, default_reward)
        return None
    return step


def _reward_last(traj: Trajectory, reward: float) -> None:
    model_positions = [i for i, m in enumerate(traj.mask) if m]
    if model_positions:
        traj.reward[model_positions[-1]] += reward


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_tokens: int
    default_reward: float
    num_workers: int


def reset_all(trajs: list[Trajectory], tokenizer, prompt_ids: list[list[int]], limits: TurnLimits) -> None:
    """Each environment's first observation (concurrently); the row's prompt ids when it is None."""
    outcomes = run_calls(
        [(lambda t=t: t.env.reset(t.sample), t.env_seconds) for t in trajs], num_workers=limits.num_workers
    )
    for traj, ids, outcome in zip(trajs, prompt_ids, outcomes, strict=True):
        traj.prompt_ids = list(ids)
        traj.env_seconds -= outcome.seconds
        if outcome.timed_out or outcome.error is not None:
            traj.timeouts += outcome.timed_out
            traj.errors += outcome.error is not None
            traj.done = True
        elif outcome.value is not None:
            traj.prompt_ids = encode_observation(tokenizer, outcome.value, first=True)


def roll_out(
    trajs: list[Trajectory],
    *,
    tokenizer,
    limits: TurnLimits,
    generate_turn: Callable[[list[Trajectory], int, int], tuple[list[list[int]], list[list[float]]]],
    agree: Callable[[int, int], tuple[int, int]],
) -> None:
    """Run every trajectory to its end (see the module's diagram), in place.

    `generate_turn(running, turn, width)` samples one turn for the running trajectories
    (their prompt + response ids left-padded to `width`) and returns each one's model ids
    (up to and including EOS) and their log-probs; `agree(width, active)` is the max of both over the worker group.
    """
    for turn in range(limits.max_turns):
        running = [t for t in trajs if not t.done]
        width, any_running = agree(max((len(t.prompt_ids) + len(t.ids) for t in running), default=0), len(running))
        if not any_running:
            return
        if not running:
            continue
        ids, logps = generate_turn(running, turn, width)
        for traj, new_ids, new_logp in zip(running, ids, logps, strict=True):
            kept = new_ids[: limits.max_tokens - len(traj.ids)]
            traj.truncated = len(kept) < len(new_ids)
            traj.add(kept, model=True, logp=new_logp[: len(kept)])
            traj.actions.append(tokenizer.decode(kept, skip_special_tokens=True))
            traj.done = traj.truncated or len(traj.ids) >= limits.max_tokens
        stepping = [t for t in running if not t.done]
        outcomes = run_calls(
            [(lambda t=t: t.env.step(t.actions[-1]), t.env_seconds) for t in stepping], num_workers=limits.num_workers
        )
        for traj, outcome in zip(stepping, outcomes, strict=True):
            _after_step(traj, _contain(traj, outcome, limits.default_reward), tokenizer, limits, turn)


def _after_step(traj: Trajectory, step, tokenizer, limits: TurnLimits, turn: int) -> None:
    if step is None:
        return
    observation, reward, done, info = step
    _reward_last(traj, reward)
    traj.tool_calls += bool(info.get("tool_call"))
    traj.tool_errors += bool(info.get("tool_error"))
    if done or turn == limits.max_turns - 1:
        traj.done = True
        return
    room = limits.max_tokens - len(traj.ids)
    if isinstance(observation, str):  # a flood is cut before it is encoded (no token spans 32 characters here)
        observation = observation[: CHARS_PER_TOKEN * room]
    obs_ids = encode_observation(tokenizer, observation, first=False)
    turn_end = end_of_turn(tokenizer) if obs_ids and not isinstance(observation, str) else None
    if turn_end is not None and (not traj.ids or traj.ids[-1] not in stop_token_ids(tokenizer)):
        # The turn ran out of tokens before its end-of-turn token: close it as the template would
        # (not the model's token, so outside the loss), then the observation as rendered after one.
        obs_ids = [tokenizer.convert_tokens_to_ids(turn_end)] + obs_ids
    traj.add(obs_ids[:room], model=False)
    traj.truncated = len(obs_ids) >= room
    traj.done = traj.truncated


def turn_generator(model, tokenizer, sampling, key_of: Callable[[Trajectory, int], int | None]):
    """`generate_turn` for `roll_out` over a model: one `generate` call per turn, token t of
    trajectory j's turn drawn from key_of(j, turn) at position t (greedy when it is None)."""
    from distflow.rollout.generation import generate

    def generate_turn(running: list[Trajectory], turn: int, width: int):
        rows = [t.prompt_ids + t.ids for t in running]
        keys = [key_of(t, turn) for t in running]
        out = generate(
            model,
            tokenizer,
            [""] * len(rows),
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            sample_keys=None if None in keys else keys,
            prompt_ids=rows,
            prompt_width=width,
            engine=sampling.engine,
            logprobs=True,
        )
        lengths = out.response_mask_BR.sum(-1).tolist()
        response_BR = out.input_ids_BT[:, out.prompt_width :]
        return (
            [response_BR[i, :k].tolist() for i, k in enumerate(lengths)],
            [out.logp_BR[i, :k].tolist() for i, k in enumerate(lengths)],
        )

    return generate_turn


def local_trajectories(
    model,
    tokenizer,
    samples: list[dict],
    env_cfg,
    sampling,
    key_of: Callable[[Trajectory, int], int | None],
    *,
    samples_per_prompt: int = 1,
) -> list[Trajectory]:
    """Finished trajectories of `samples_per_prompt` samples of each row (uid g·n + k), on this
    rank alone (evaluation: no peer to agree with)."""
    from distflow.envs import environment_class

    n, cls = samples_per_prompt, environment_class(env_cfg.cls)
    limits = TurnLimits(env_cfg.max_turns, env_cfg.max_tokens, env_cfg.default_reward, env_cfg.num_workers)
    rows = [s for s in samples for _ in range(n)]
    trajs = [
        Trajectory(sample=dict(s), env=cls(**env_cfg.kwargs), env_seconds=env_cfg.deadline_s, uid=u)
        for u, s in enumerate(rows)
    ]
    reset_all(trajs, tokenizer, encode_prompts(tokenizer, [s["prompt"] for s in rows]), limits)
    roll_out(
        trajs,
        tokenizer=tokenizer,
        limits=limits,
        agree=lambda *values: values,
        generate_turn=turn_generator(model, tokenizer, sampling, key_of),
    )
    return trajs

"""An episode's model calls, laid out as training samples: token in, token out.

    calls, ordered by (turn, choice)
      call 0: prompt P0 ───────────► sampled S0
      call 1: prompt P1 = P0 + S0 + N1 ───► sampled S1        (N1: tool results, template tokens)
    sample:  prompt_ids = P0,  ids = S0 + N1 + S1,  mask = 1…1 0…0 1…1,  logp on the 1s, 0 elsewhere

The layout is `rollout.multiturn`'s `Trajectory` (prompt | response with holes), so a sample
trains like any multi-turn sample (`to_trajectory`). Sampled tokens are kept exactly as they were
sampled; the text the agent sent back is never re-tokenized into the response.

A call joins the sample whose tokens so far (prompt, sampled and inserted) are a token-for-token
prefix of its prompt; of several, the longest. A call that extends none starts a new sample: a
branch (two calls from the same history), a rewritten history, or a template that renders the
assistant's turn back differently from how it was sampled (a tool call's JSON re-serialised,
say). So a branching episode becomes one sample per maximal chain of prefix-extending calls,
and every one of them gets the episode's reward. Calls are taken in turn order, which is causal:
a request can only contain completions returned before it arrived, which have smaller turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from distflow.agents.session import Call


@dataclass
class AgentSample:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    """Response: sampled tokens and the prompt tokens inserted between calls, in order."""
    mask: list[int] = field(default_factory=list)
    """1 exactly on sampled tokens."""
    logp: list[float] = field(default_factory=list)
    """The sampled tokens' log-probs at sampling time (0 where the mask is 0)."""
    calls: list[tuple[int, int]] = field(default_factory=list)
    """(turn, choice) of each call in this sample."""
    completion: str = ""
    """The last call's text."""
    temperatures: set[float] = field(default_factory=set)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        width = len(self.prompt_ids) + len(self.ids)
        return len(prompt_ids) >= width and list(prompt_ids[:width]) == self.input_ids

    def append(self, call: Call) -> None:
        inserted = list(call.prompt_ids[len(self.prompt_ids) + len(self.ids) :])
        self.ids += inserted + list(call.token_ids)
        self.mask += [0] * len(inserted) + [1] * len(call.token_ids)
        self.logp += [0.0] * len(inserted) + list(call.logprobs)
        self.calls.append((call.turn, call.choice))
        self.completion = call.text
        self.temperatures.add(call.temperature)


def assemble(calls: Sequence[Call]) -> list[AgentSample]:
    """The training samples of one episode's calls (see the module's docstring).

    >>> a = Call(0, 0, [1, 2], [3, 4], [-0.5, -0.25], "stop", 1.0)
    >>> b = Call(1, 0, [1, 2, 3, 4, 9], [5], [-1.0], "stop", 1.0)
    >>> [(s.input_ids, s.mask) for s in assemble([b, a])]
    [([1, 2, 3, 4, 9, 5], [1, 1, 0, 1])]
    """
    samples: list[AgentSample] = []
    for call in sorted(calls, key=lambda c: (c.turn, c.choice)):
        if len(call.token_ids) != len(call.logprobs):
            raise ValueError(
                f"call {call.turn}/{call.choice}: {len(call.token_ids)} tokens, {len(call.logprobs)} logprobs"
            )
        extended = [s for s in samples if s.extended_by(call.prompt_ids)]
        if extended:
            sample = max(extended, key=lambda s: len(s.prompt_ids) + len(s.ids))
        else:
            sample = AgentSample(prompt_ids=list(call.prompt_ids))
            samples.append(sample)
        sample.append(call)
    return samples


def to_trajectory(sample: AgentSample, row: dict, *, uid: int, reward: float):
    """`sample` as `rollout.multiturn.Trajectory` (the layout the multi-turn rollout stage trains on),
    `reward` on its last sampled token as an environment's turn reward is."""
    from distflow.rollout.multiturn import Trajectory

    trajectory = Trajectory(sample=dict(row), env=None, env_seconds=0.0, uid=uid, prompt_ids=list(sample.prompt_ids))
    trajectory.ids, trajectory.mask, trajectory.logp = list(sample.ids), list(sample.mask), list(sample.logp)
    trajectory.reward = [0.0] * len(sample.ids)
    sampled = [i for i, m in enumerate(sample.mask) if m]
    if sampled:
        trajectory.reward[sampled[-1]] = float(reward)
    trajectory.actions = [sample.completion]
    trajectory.done = True
    return trajectory

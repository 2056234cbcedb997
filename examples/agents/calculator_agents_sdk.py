"""The calculator agent of calculator_agent.py written with the OpenAI Agents SDK
(in the `agents` extra): the SDK runs the tool loop, distflow serves the model.

    cd examples/agents && distflow train calculator.yaml rollout.agent=calculator_agents_sdk:solve

An async agent gets an `openai.AsyncOpenAI` client bound to its episode, which the SDK's
chat-completions model takes as it is.
"""

from __future__ import annotations

import openai
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from distflow.envs.calculator import CalculatorError, calculate

MAX_TURNS = 4
set_tracing_disabled(True)  # the SDK would send its traces to OpenAI


async def solve(client: openai.AsyncOpenAI, sample: dict) -> dict:
    calls = 0

    @function_tool
    def calculator(expression: str) -> str:
        """Exact integer arithmetic: + - * // % and parentheses."""
        nonlocal calls
        calls += 1
        try:
            return str(calculate(expression))
        except CalculatorError:
            return "()"

    agent = Agent(
        name="adder",
        instructions=None,  # the embedded model reads every message's text: no system prompt
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="distflow-policy", openai_client=client),
    )
    try:
        await Runner.run(agent, sample["prompt"], max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        pass  # still calling the tool after MAX_TURNS: the final reply is a call, which grades as wrong
    return {"tool_calls": calls}  # no "score": the task's reward functions grade the final reply

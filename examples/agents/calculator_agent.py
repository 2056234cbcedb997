"""A calculator agent written with the plain `openai` client: the model may call `calculator`
(OpenAI tool calls) until it answers; the task's reward functions grade the final answer.

    cd examples/agents && distflow train calculator.yaml

distflow serves the endpoint the client is bound to; nothing here is specific to distflow, so
the same function runs against any OpenAI-compatible server.
"""

from __future__ import annotations

import json

import openai

from distflow.envs.calculator import CALCULATOR_TOOL, CalculatorError, calculate

MAX_TURNS = 4
TOOLS = [CALCULATOR_TOOL]  # {"type": "function", "function": {"name": "calculator", "parameters": ...}}


def calculator(expression: str) -> str:
    try:
        return str(calculate(expression))
    except CalculatorError:
        return "()"  # what the calculator environment answers to a malformed call


def solve(client: openai.OpenAI, sample: dict) -> dict:
    messages: list[dict] = [{"role": "user", "content": sample["prompt"]}]
    calls = 0
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="distflow-policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break  # the answer
        for call in message.tool_calls:
            calls += 1
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(arguments["expression"])})
    # No "score": no reward of its own, the task's reward functions grade the final reply.
    # The other numbers are logged (agent/tool_calls).
    return {"tool_calls": calls}

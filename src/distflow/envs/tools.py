"""Built-in tool environments: a calculator and a sandboxed Python interpreter.

Both leave grading to the task: a trajectory ends when the model answers without calling
the tool, and that last action is the `completion` the task's reward functions and
verifier see. Tool calls earn no reward of their own (set `step_reward` to shape them).

    env:
      cls: distflow.envs.tools:CalculatorEnv       # action "12+34=" → observation "46"
      cls: distflow.envs.tools:PythonEnv           # action with a ```python block → its output
"""

from __future__ import annotations

import re

from distflow.envs.calculator import CalculatorError, calculate
from distflow.envs.python_tool import run_python


class CalculatorEnv:
    """An action ending in "=" is a calculator call on the text before it; the exact value
    (or `error_text`) comes back as the observation (as a `tool` chat message with `chat: true`,
    for a chat model: the template then closes the model's turn, shows the result and opens the
    next assistant turn). Any other action is the answer."""

    def __init__(self, *, error_text: str = "()", step_reward: float = 0.0, chat: bool = False) -> None:
        self.error_text = error_text
        self.step_reward = step_reward
        self.chat = chat

    def reset(self, sample: dict) -> None:
        return None  # the row's prompt

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        text = action.strip()
        if not text.endswith("="):
            return None, 0.0, True, {}
        try:
            value, info = str(calculate(text[:-1])), {"tool_call": True}
        except CalculatorError:
            value, info = self.error_text, {"tool_call": True, "tool_error": True}
        return [{"role": "tool", "content": value}] if self.chat else value, self.step_reward, False, info


_CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


class PythonEnv:
    """An action with a ```python block runs it in the sandbox (`envs.python_tool`); its
    output, in an ```output block, is the observation (as a `tool` chat message with
    `chat: true`). An action without code is the answer."""

    def __init__(
        self,
        *,
        cpu_s: int = 5,
        wall_s: float = 10.0,
        memory_mb: int = 512,
        max_output: int = 2048,
        chat: bool = False,
        step_reward: float = 0.0,
    ) -> None:
        self.limits = {"cpu_s": cpu_s, "wall_s": wall_s, "memory_mb": memory_mb, "max_output": max_output}
        self.chat = chat
        self.step_reward = step_reward

    def reset(self, sample: dict) -> None:
        return None

    def step(self, action: str):
        found = _CODE.search(action)
        if found is None:
            return None, 0.0, True, {}
        result = run_python(found.group(1), **self.limits)
        failed = result.timed_out or result.returncode != 0
        text = (
            result.output
            + ("\n[timed out]" if result.timed_out else "")
            + ("\n[truncated]" if result.truncated else "")
        )
        observation = [{"role": "tool", "content": text}] if self.chat else f"\n```output\n{text}\n```\n"
        return observation, self.step_reward, False, {"tool_call": True, "tool_error": failed}

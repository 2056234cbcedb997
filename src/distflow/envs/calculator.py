"""The built-in calculator tool: exact integer arithmetic on an expression, nothing else.

Parsed with `ast` and evaluated node by node (+, -, *, //, %, parentheses, integers), so no
name, call or attribute of Python is reachable, and operands are bounded so `9**9**9`-style
inputs cannot stall a rank.
"""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_ABS = 10**12


class CalculatorError(ValueError):
    """The expression is not integer arithmetic the calculator evaluates."""


def calculate(expression: str) -> int:
    """The value of an integer expression.

    >>> calculate("12+34*2")
    80
    >>> calculate("(1+2)*-3")
    -9
    >>> calculate("__import__('os')")
    Traceback (most recent call last):
    ...
    distflow.envs.calculator.CalculatorError: not integer arithmetic: Call
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"cannot parse {expression!r}") from err
    return _eval(tree.body)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_eval(node.operand) if isinstance(node.op, ast.USub) else _eval(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise CalculatorError(f"not integer arithmetic: {type(node).__name__}")
    if abs(value) > MAX_ABS:
        raise CalculatorError(f"|value| above {MAX_ABS}")
    return value


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Exact integer arithmetic: + - * // % and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The calculator as an OpenAI tool, as `examples/agents/calculator_agent.py` offers it: a real model's
tool warm-start (`tasks/chat_transcripts.py`) renders exactly this signature into its prompts."""

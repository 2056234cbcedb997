"""A multi-turn verifiers environment with a tool: sums of three numbers and a `calculator`.

row    = {"prompt": [{"role": "user", "content": "12+34+56="}], "answer": "102"}
tools  = calculator(expression) -> its value ("12+34" -> "46"); the episode ends at a reply
         without a tool call, or after `max_turns` model calls
reward = 1.0 when the final reply, stripped, is the answer, else 0.0; the calculator's calls are
         counted by the environment's own metrics (total_tool_calls, calculator_calls, num_turns)
"""

from vf_addition import sums


def calculator(expression: str) -> str:
    """Add up the numbers of a sum.

    Args:
        expression: a sum of integers, e.g. 12+34

    >>> calculator("12+34")
    '46'
    >>> calculator(" (46+56) ")
    '102'
    """
    terms = expression.strip().strip("()").split("+")
    return str(sum(int(term) for term in terms))


def load_environment(
    num_train: int = 200, num_eval: int = 20, seed: int = 0, max_turns: int = 4, constant_reward: float | None = None
):
    import verifiers as vf
    from datasets import Dataset

    def exact_answer(parser, completion, answer, **kwargs) -> float:
        reply = parser.parse_answer(completion) or ""
        return 1.0 if reply.strip() == answer else 0.0

    def constant(**kwargs) -> float:
        return float(constant_reward)

    return vf.ToolEnv(
        dataset=Dataset.from_list(sums(num_train, seed, num_operands=3)),
        eval_dataset=Dataset.from_list(sums(num_eval, seed + 1, num_operands=3)) if num_eval else None,
        tools=[calculator],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[exact_answer if constant_reward is None else constant]),
    )

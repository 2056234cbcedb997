"""A single-turn verifiers environment: the embedded task's sums, one user message each.

    row    = {"prompt": [{"role": "user", "content": "12+34="}], "answer": "46"}
    reward = 1.0 when the reply, stripped, is the answer, else 0.0; or `constant_reward` for every reply
             (a score that shows where a logged reward comes from)

The rows are a pure function of (seed, index); `num_eval` of them form the eval dataset.
"""

import random


def sums(count: int, seed: int, num_operands: int = 2) -> list[dict]:
    """`count` rows of sums of two-digit numbers.

    >>> sums(1, seed=0)
    [{'prompt': [{'role': 'user', 'content': '49+97='}], 'answer': '146'}]
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        operands = [rng.randrange(100) for _ in range(num_operands)]
        prompt = [{"role": "user", "content": "+".join(map(str, operands)) + "="}]
        rows.append({"prompt": prompt, "answer": str(sum(operands))})
    return rows


def load_environment(num_train: int = 200, num_eval: int = 20, seed: int = 0, constant_reward: float | None = None):
    import verifiers as vf
    from datasets import Dataset

    def exact_answer(parser, completion, answer, **kwargs) -> float:
        reply = parser.parse_answer(completion) or ""
        return 1.0 if reply.strip() == answer else 0.0

    def constant(**kwargs) -> float:
        return float(constant_reward)

    rubric = vf.Rubric(funcs=[exact_answer if constant_reward is None else constant])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(sums(num_train, seed)),
        eval_dataset=Dataset.from_list(sums(num_eval, seed + 1)) if num_eval else None,
        rubric=rubric,
    )

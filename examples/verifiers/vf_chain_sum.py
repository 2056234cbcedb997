"""reasoning-gym's chain_sum through verifiers' own reasoning-gym wrapper, scored the way
examples/smollm2_chain_sum.yaml scores it.

    load_environment(**kwargs) = verifiers' ReasoningGymEnv(gym=[{name: chain_sum, config}], ...)
      rows   : reasoning-gym entries 0..num_train-1 train, the next num_eval are the eval dataset
      prompt : the question alone; no system message (the chat template's default), not the wrapper's
               default "<answer> tags" prompt, which a 135M model does not follow in 32 tokens
      reward : the row's dataset scores the reply's last number (`score_answer`, in [0, 1])

The wrapper is used as shipped; only its parser is ours, the last number of the reply instead of
the text between <answer> tags. Everything is made locally (reasoning-gym is procedural): it works
offline. distflow finds this module because `distflow train` puts the working directory on sys.path.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str:
    """The reply's last number ("" when it has none).

    >>> last_number("4 + 61 = 65, so the answer is 65.")
    '65'
    >>> last_number("no number")
    ''
    """
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else ""


def load_environment(
    num_train: int = 10000,
    num_eval: int = 50,
    min_digits: int = 1,
    max_digits: int = 2,
    seed: int = 0,
):
    import verifiers as vf
    from verifiers.envs.integrations.reasoninggym_env import ReasoningGymEnv

    chain_sum = {"min_terms": 2, "max_terms": 2, "min_digits": min_digits, "max_digits": max_digits}
    return ReasoningGymEnv(
        gym=[{"name": "chain_sum", "weight": 1.0, "config": chain_sum}],
        num_train_examples=num_train,
        num_eval_examples=num_eval,
        system_prompt=None,
        parser=vf.Parser(extract_fn=last_number),
        seed=seed,
    )

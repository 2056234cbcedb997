"""ReMax's greedy-baseline stage: one greedy completion per group, its reward on every sample."""

import torch

from distflow.comm import Comm
from distflow.config import load_config
from distflow.dag.context import Engines, StageContext
from distflow.dag.stages import greedy_baseline
from distflow.data.batch import Batch
from distflow.observability.metrics import StepMetrics
from distflow.rollout.generation import generate
from distflow.rollout.sampling import SamplingSpec
from distflow.scoring.reward import build_rewards
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.sequences import encode_prompts

SINGLE = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
CALLS = []


def length_reward(prompt, completion, sample):
    CALLS.append(prompt)
    return float(len(prompt) + len(completion))


def test_one_greedy_completion_per_group_scored_and_clipped():
    config = load_config(
        None,
        [
            "algorithm.name=remax",
            "algorithm.reward_clip=5.5",
            "rollout.max_new_tokens=4",
            f"task.reward={__name__}:length_reward",
            "task.reward_timeout_s=0",
        ],
    )
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    prompts = ["1+2=", "1+2=", "17+45=", "17+45=", "17+45="]  # two groups, expanded as `rollout` leaves them
    batch = Batch(
        {"group": torch.tensor([5, 5, 2, 2, 2])},
        {"prompt": prompts, "prompt_ids": encode_prompts(tokenizer, prompts), "sample": [{}] * 5},
    )
    engines = Engines(
        tokenizer=tokenizer,
        rewards=build_rewards(config.task),
        is_correct=None,
        sampling=SamplingSpec.of(config.rollout),
        rollout_model=model,
    )
    ctx = StageContext(config, engines, comm=SINGLE, world=SINGLE, metrics=StepMetrics())
    CALLS.clear()
    out = greedy_baseline(batch, ctx)
    assert CALLS == ["1+2=", "17+45="]  # once per group
    greedy = generate(
        model, tokenizer, CALLS, max_new_tokens=4, temperature=1.0, prompt_ids=encode_prompts(tokenizer, CALLS)
    )
    # 4 and 6 characters of prompt plus the completion's, the second clipped at 5.5 like the sampled rewards
    expected = [min(float(len(p) + len(c)), 5.5) for p, c in zip(CALLS, greedy.completions, strict=True)]
    assert expected[1] == 5.5
    assert out["baseline_reward"].tolist() == [expected[0]] * 2 + [expected[1]] * 3

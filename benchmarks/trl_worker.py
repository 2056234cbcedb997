"""TRL baseline for benchmarks/throughput.py, learning.py and gpu.py: GRPO with `trl.GRPOTrainer` on CPU
(CUDA with --device cuda; bf16 compute over float32 weights with --dtype bfloat16).

Runs inside the benchmark virtualenv (.venv-bench, which has TRL; the project venv
does not), started by those scripts with the settings they also give distflow:

    .venv-bench/bin/python benchmarks/trl_worker.py --model-dir DIR --data ROWS.jsonl \
        --prompts 16 --generations 8 --max-new-tokens 8 --steps 20 --lr 1e-5 --output-dir TMP

ROWS.jsonl holds {"prompt", "answer"} rows in the order distflow's loader visits them;
shuffling is off, so both systems train on the same prompts in the same steps. The last
stdout line is JSON: per optimizer step its wall seconds and generated completion tokens.

learning.py adds `--task gym` (rows of a reasoning-gym task, rewarded by distflow's
`score_reward`, the datasets' own scorer), `--budget-s` (stop once the steps' summed seconds
reach it) and `--heldout ROWS.jsonl --eval-every-s S` (greedy held-out accuracy, judged by
distflow's own evaluation code and the task's verifier, each time the steps' summed seconds
pass a multiple of S and at the end; the clock stops while it evaluates).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

# The reward is distflow's own code (torch and the standard library only), not a copy:
# `Rewards` also gives 0 to a completion whose reward function raises, as distflow does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from distflow.scoring.reward import Rewards, RewardTerm  # noqa: E402
from distflow.tasks.arithmetic import ArithmeticTask, correctness_reward  # noqa: E402


def task_functions(task: str):
    """(reward function, verifier) of a task, distflow's own."""
    if task == "gym":
        from distflow.tasks.reasoning_gym import GymTask, score_reward

        return score_reward, GymTask.is_correct
    return correctness_reward, ArithmeticTask.is_correct


class TokenCountingReward:
    """distflow's reward in TRL's batched signature; it sees every completion, so it also counts
    the generated tokens (EOS included, as distflow counts them). A row travels whole as JSON
    (`row`: reasoning-gym rows hold nested entries that a dataset column cannot type)."""

    __name__ = "correctness"  # TRL names reward columns after the function

    def __init__(self, reward_fn) -> None:
        self.tokens = 0
        self.rewards = Rewards([RewardTerm(self.__name__, reward_fn)])

    def __call__(self, prompts, completions, completion_ids, row, **kwargs) -> list[float]:
        self.tokens += sum(len(ids) for ids in completion_ids)
        scores = self.rewards.score(prompts, completions, [json.loads(r) for r in row])
        return scores.reward_B.tolist()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step: generation, reward, loss, backward and update all
    happen between on_step_begin and on_step_end (gradient_accumulation_steps=1). With a budget,
    stops training once the steps' summed seconds reach it; with held-out rows, evaluates each
    time that sum passes a multiple of `eval_every_s`, and at the end (outside the timed steps)."""

    def __init__(
        self, reward: TokenCountingReward, *, budget_s: float = 0, heldout=None, eval_every_s: float = 0, evaluate=None
    ) -> None:
        self.reward = reward
        self.step_s: list[float] = []
        self.tokens: list[int] = []
        self.budget_s, self.heldout, self.eval_every_s, self.evaluate = budget_s, heldout, eval_every_s, evaluate
        self.evals: list[tuple[float, float]] = []  # (training seconds so far, greedy held-out accuracy)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.heldout is not None:
            self.evals.append((0.0, self.evaluate(model)))

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._tokens = time.perf_counter(), self.reward.tokens

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """Out of rows (max_steps) before the budget: the last state is evaluated too."""
        if self.heldout is not None and self.evals[-1][0] != sum(self.step_s):
            self.evals.append((sum(self.step_s), self.evaluate(model)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.step_s.append(time.perf_counter() - self._start)
        self.tokens.append(self.reward.tokens - self._tokens)
        train_s = sum(self.step_s)
        done = bool(self.budget_s) and train_s >= self.budget_s
        if done:
            control.should_training_stop = True
        if self.heldout is not None and (
            done or int(train_s // self.eval_every_s) > int((train_s - self.step_s[-1]) // self.eval_every_s)
        ):
            self.evals.append((train_s, self.evaluate(model)))


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    return GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        # One optimizer step per batch of prompts x generations, no PPO re-use of a rollout.
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no KL, so no reference model (distflow: algorithm.kl.coef=0)
        # The optimizer distflow uses: AdamW(betas 0.9/0.99, no decay), clip 1.0, constant lr.
        learning_rate=args.lr,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "constant",
        warmup_steps=args.warmup_steps,
        shuffle_dataset=False,  # keep distflow's prompt order
        seed=args.seed,
        use_cpu=args.device == "cpu",
        # --dtype bfloat16: bf16 autocast over float32 master weights and optimizer state, as
        # distflow's parallel.param_dtype=bfloat16
        bf16=args.dtype == "bfloat16",
        gradient_checkpointing=False,  # TRL turns it on by default; distflow does not checkpoint
        use_vllm=False,
        report_to=[],
        logging_strategy="no",
        log_completions=False,
        save_strategy="no",
        disable_tqdm=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--generations", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up, then constant")
    parser.add_argument("--task", choices=["arith", "gym"], default="arith")
    parser.add_argument("--budget-s", type=float, default=0, help="stop once the steps took this long in all")
    parser.add_argument("--heldout", help="held-out rows (jsonl) to evaluate greedily")
    parser.add_argument("--eval-every-s", type=float, default=0)
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"  # as distflow generates: prompts end at the same column
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    reward_fn, is_correct = task_functions(args.task)
    reward = TokenCountingReward(reward_fn)
    heldout = (
        None if args.heldout is None else [json.loads(line) for line in Path(args.heldout).read_text().splitlines()]
    )
    timer = StepTimer(
        reward,
        budget_s=args.budget_s,
        heldout=heldout,
        eval_every_s=args.eval_every_s or float("inf"),
        evaluate=lambda m: greedy_accuracy(m, tokenizer, heldout, is_correct, args.max_new_tokens),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=grpo_config(args),
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "row": json.dumps(r)} for r in rows]),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    print(
        json.dumps(
            {
                "step_s": timer.step_s,
                "tokens": timer.tokens,
                "evals": timer.evals,
                "torch_threads": torch.get_num_threads(),
                "trl_version": trl.__version__,
            }
        ),
        flush=True,
    )


def greedy_accuracy(model, tokenizer, rows, is_correct, max_new_tokens: int) -> float:
    """Greedy held-out accuracy by distflow's own evaluation code (the same `judge` its runs use)."""
    from distflow.rollout.evaluation import judge
    from distflow.rollout.sampling import SamplingSpec

    sampling = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, engine="compact")
    judged = judge(model, tokenizer, rows, is_correct, sampling, sample_keys=None)
    return sum(judged) / len(judged)


if __name__ == "__main__":
    main()

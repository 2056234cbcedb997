"""TRL baseline for benchmarks/throughput.py: GRPO with `trl.GRPOTrainer` on CPU (CUDA with --gpu).

Runs inside the benchmark virtualenv (.venv-bench, which has TRL; the project venv
does not), started by throughput.py with the settings it also gives distflow:

    .venv-bench/bin/python benchmarks/trl_worker.py --model-dir DIR --data ROWS.jsonl \
        --prompts 16 --generations 8 --max-new-tokens 8 --steps 20 --lr 1e-5 --output-dir TMP

ROWS.jsonl holds {"prompt", "answer"} rows in the order distflow's loader visits them;
shuffling is off, so both systems train on the same prompts in the same steps. The last
stdout line is JSON: per optimizer step its wall seconds and generated completion tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
import trl
from trl import GRPOConfig, GRPOTrainer

# The reward is distflow's own code (torch and the standard library only), not a copy:
# `Rewards` also gives 0 to a completion whose reward function raises, as distflow does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from distflow.engines.reward import Rewards, RewardTerm  # noqa: E402
from distflow.tasks.arithmetic import correctness_reward  # noqa: E402


class TokenCountingReward:
    """distflow's correctness_reward in TRL's batched signature; it sees every completion,
    so it also counts the generated tokens (EOS included, as distflow counts them)."""

    __name__ = "correctness"  # TRL names reward columns after the function

    def __init__(self) -> None:
        self.tokens = 0
        self.rewards = Rewards([RewardTerm(self.__name__, correctness_reward)])

    def __call__(self, prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        self.tokens += sum(len(ids) for ids in completion_ids)
        scores = self.rewards.score(prompts, completions, [{"answer": a} for a in answer])
        return scores.reward_B.tolist()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step: generation, reward, loss, backward and update all
    happen between on_step_begin and on_step_end (gradient_accumulation_steps=1)."""

    def __init__(self, reward: TokenCountingReward) -> None:
        self.reward = reward
        self.step_s: list[float] = []
        self.tokens: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._tokens = time.perf_counter(), self.reward.tokens

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(time.perf_counter() - self._start)
        self.tokens.append(self.reward.tokens - self._tokens)


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
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no KL, so no reference model (distflow: algorithm.kl.coef=0)
        # The optimizer distflow uses: AdamW(betas 0.9/0.99, no decay), clip 1.0, constant lr.
        learning_rate=args.lr,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        shuffle_dataset=False,  # keep distflow's prompt order
        seed=args.seed,
        use_cpu=not args.gpu,
        bf16=args.gpu,  # --gpu: bf16 autocast over float32 master weights, as distflow's fsdp2 there
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
    parser.add_argument("--gpu", action="store_true", help="train and generate on CUDA in bf16")
    args = parser.parse_args()

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"  # as distflow generates: prompts end at the same column
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    reward = TokenCountingReward()
    timer = StepTimer(reward)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=grpo_config(args),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    print(json.dumps({"step_s": timer.step_s, "tokens": timer.tokens, "torch_threads": torch.get_num_threads(),
                      "trl_version": trl.__version__}),
          flush=True)


if __name__ == "__main__":
    main()

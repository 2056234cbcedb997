"""TRL's side of benchmarks/host_costs.py: the ops and syncs of one `trl.GRPOTrainer` step.

Runs in .venv-bench (it has TRL), with benchmarks/trl_worker.py's settings and arguments, plus
`--count-step K` (default 2, the first step after a warm-up one):

    .venv-bench/bin/python benchmarks/trl_count_worker.py --model-dir DIR --data ROWS.jsonl \
        --prompts 8 --generations 8 --max-new-tokens 32 --steps 2 --lr 1e-5 --output-dir TMP

The counter (benchmarks/dispatch_counter.py) is open for the whole training, so it knows the
tensors made on the host before the counted step (AdamW's step counters); step K is counted
between the callbacks on_step_begin and on_step_end, which enclose generation, reward,
advantages, loss, backward, clipping and the optimizer step (gradient_accumulation_steps=1).
Inside it, `_generate_single_turn` (the `model.generate` call and the EOS masking around it) is
the scope `rollout`, `_calculate_rewards` is `reward`, the rest of `_generate_and_score_completions`
is `score` (prompt tokenization, log-prob passes, advantages, metrics) and the remainder `update`
(loss, backward, clipping, optimizer). The last stdout
line is JSON: {scope: {"ops", "syncs", ..., "top_ops", "top_syncs"}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
from datasets import Dataset
from dispatch_counter import HostCostCounter
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOTrainer
from trl_worker import TokenCountingReward, grpo_config, task_functions

SCOPES = {
    "_generate_single_turn": "rollout",
    "_calculate_rewards": "reward",
    "_generate_and_score_completions": "score",
}


class CountStep(TrainerCallback):
    """Opens the counter's scope `update` around optimizer step `count_step` (1-based)."""

    def __init__(self, counter: HostCostCounter, count_step: int) -> None:
        self.counter, self.count_step, self.stack = counter, count_step, contextlib.ExitStack()
        self.counting = False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.count_step:
            self.counting = True
            self.stack.enter_context(self.counter.scope("update"))

    def on_step_end(self, args, state, control, **kwargs):
        if self.counting:
            self.stack.close()
            self.counting = False
            control.should_training_stop = True


def scoped(trainer: GRPOTrainer, method: str, scope: str, callback: CountStep) -> None:
    """trainer.<method> counted into `scope` while the counted step runs."""
    original = getattr(trainer, method)

    def wrapped(*args, **kwargs):
        if not callback.counting:
            return original(*args, **kwargs)
        with callback.counter.scope(scope):
            return original(*args, **kwargs)

    setattr(trainer, method, wrapped)


def report(counter: HostCostCounter) -> dict:
    out = {}
    for scope in ("rollout", "reward", "score", "update"):
        out[scope] = {
            **counter.totals(scope),
            "top_ops": counter.top_ops(scope),
            "top_syncs": counter.top_syncs(scope),
            "sync_sites": counter.top_sync_sites(scope),
        }
    return out


def main() -> None:
    args = _parse()
    count_step = args.count_step
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    reward_fn, _ = task_functions(args.task)
    counter = HostCostCounter()
    callback = CountStep(counter, count_step)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[TokenCountingReward(reward_fn)],
        args=grpo_config(args),
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "row": json.dumps(r)} for r in rows]),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    for method, scope in SCOPES.items():
        scoped(trainer, method, scope, callback)
    with counter:
        trainer.train()
    print(json.dumps({"count_step": count_step, "torch_threads": torch.get_num_threads(), **report(counter)}))


def _parse():
    """trl_worker.py's arguments (the same settings), and the step to count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--model-dir", "--data", "--output-dir"):
        parser.add_argument(name, required=True)
    for name in ("--prompts", "--generations", "--max-new-tokens", "--steps"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--task", choices=["arith", "gym"], default="arith")
    parser.add_argument("--count-step", type=int, default=2, help="the optimizer step counted (1-based)")
    return parser.parse_args()


if __name__ == "__main__":
    main()

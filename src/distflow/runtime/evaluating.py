"""The run's held-out evaluations (rollout/evaluation.py over this rank's worker), every rank together:

    before RL (step 0; a resumed run has it from its checkpoint)
    after step s when s % trainer.eval_every == 0, or the steps' summed time passed a multiple of
        trainer.eval_every_s, and after the last step
    none at all with trainer.evaluate=false (the summary's accuracies are then null)

What is measured is held-out accuracy judged by the task's verifier; an agent run's is its episodes'
mean reward, the reward they train on, with their `agent/*` numbers under `eval/` (the word the log
lines use says which).
"""

from __future__ import annotations

import dataclasses
import time

from distflow.rollout.evaluation import Evaluation, evaluate


def evaluate_worker(worker) -> Evaluation:
    cfg, engines, start = worker.config, worker.engines, time.time()
    result = evaluate(
        worker.eval_model,
        engines.tokenizer,
        worker.heldout if worker.heldout is not None else worker.task.heldout,
        worker.task.is_correct,
        engines.sampling,
        num_samples=cfg.trainer.eval_samples,
        comm=worker.world,
        seed=cfg.trainer.seed,
        env=cfg.env,
        group_of=getattr(worker.task, "group_of", None),
        evaluators=worker.plan.groups["rollout"].ranks
        if engines.sampling.engine.rollout_ranks_only or cfg.rollout.agent
        else None,
        agent=engines.agent,  # rollout.agent: the held-out rows are the agent's episodes, scored by their reward
        rewards=engines.rewards,
    )
    return dataclasses.replace(result, seconds=time.time() - start)


def eval_metrics(result: Evaluation | None) -> dict[str, float]:
    """The evaluation's metrics: overall, per group of held-out rows when the task has groups, and the
    evaluation's further numbers (an agent run's `agent/*`); none without an evaluation."""
    if result is None:
        return {}
    metrics = {"eval/accuracy": result.sampled, "eval/greedy_accuracy": result.greedy, "time/eval_s": result.seconds}
    for group, (sampled, greedy) in result.per_group.items():
        metrics |= {f"eval/{group}/accuracy": sampled, f"eval/{group}/greedy_accuracy": greedy}
    return metrics | {f"eval/{name}": value for name, value in result.metrics.items()}


def measured(config) -> str:
    """What the evaluation measures, in the words the log lines use."""
    return "held-out reward (the agent's episodes)" if config.rollout.agent else "held-out accuracy"


def due(trainer, step: int, before_s: float, train_s: float) -> bool:
    """Whether step `step` (not the last) ends with an evaluation; `before_s`, `train_s`: the steps' summed
    time before and after it."""
    if not trainer.evaluate:
        return False
    every_steps = bool(trainer.eval_every) and step % trainer.eval_every == 0
    every_s = bool(trainer.eval_every_s) and train_s // trainer.eval_every_s > before_s // trainer.eval_every_s
    return every_steps or every_s


def evaluation_before(worker, run_state: dict, status, writer, log) -> Evaluation | None:
    """The evaluation before RL (a resumed run has it from its checkpoint); None with `trainer.evaluate=false`."""
    if "eval_before" in run_state:
        before = run_state["eval_before"]
        return Evaluation(**before) if before is not None else None
    before = None
    if worker.config.trainer.evaluate:
        status.enter("evaluate", 0)
        before = evaluate_worker(worker)
        log(
            f"{measured(worker.config)} before RL: {before.sampled:.3f} (T={worker.engines.sampling.temperature}), "
            f"greedy {before.greedy:.3f}"
        )
    if writer:
        writer.log(0, eval_metrics(before) | {"data/skipped_rows": worker.num_skipped_rows})
    return before


def rounded_summary(before: Evaluation | None, after: Evaluation | None) -> dict:
    """The summary's accuracies (null without an evaluation)."""
    if before is None or after is None:
        keys = ("warmstart_accuracy", "final_accuracy", "warmstart_greedy_accuracy", "final_greedy_accuracy")
        return dict.fromkeys((*keys, "accuracy_gain"))
    return {
        "warmstart_accuracy": round(before.sampled, 4),
        "final_accuracy": round(after.sampled, 4),
        "warmstart_greedy_accuracy": round(before.greedy, 4),
        "final_greedy_accuracy": round(after.greedy, 4),
        "accuracy_gain": round(after.sampled - before.sampled, 4),
    }

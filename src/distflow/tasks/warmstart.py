"""Supervised warm-start: teach the policy the task's answer format and some skill.

RL needs a policy that is right some of the time (a group whose samples all score 0
carries no signal) and wrong often enough to have room to improve. Small models learn
addition abruptly (accuracy can jump from 0.1 to 0.8 within a few dozen steps, at a
step that differs from seed to seed), so a fixed step count lands anywhere on that
cliff. Instead training stops as soon as `should_stop` (a check of validation accuracy,
run every `check_every` steps) says the target competence is reached.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from distflow.seeding import derive_seed
from distflow.training.sequences import encode_prompts, left_pad, position_ids_from_mask


def supervised_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], answers: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, mask_BT, loss_mask_BT): loss on the answer tokens and EOS only."""
    prompt_rows = encode_prompts(tokenizer, list(prompts))
    answer_rows = tokenizer(list(answers), add_special_tokens=False)["input_ids"]
    rows = [p + list(a) + [tokenizer.eos_token_id] for p, a in zip(prompt_rows, answer_rows, strict=True)]
    ids_BT, mask_BT = left_pad(rows, tokenizer.pad_token_id)
    loss_mask_BT = torch.zeros_like(mask_BT)
    for i, a in enumerate(answer_rows):
        loss_mask_BT[i, ids_BT.shape[1] - len(a) - 1 :] = 1
    return ids_BT, mask_BT, loss_mask_BT


def supervised_warmstart(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    answers: Sequence[str],
    *,
    max_steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    should_stop: Callable[[int], bool] = lambda step: False,
    check_every: int = 10,
    batch_of: Callable[[list[int], int], tuple[torch.Tensor, ...]] | None = None,
    bar=None,
) -> list[float]:
    """Train in place (linear warm-up, then constant lr); returns the loss of every step.
    `batch_of(indices, step)` replaces `supervised_batch` (multi-turn transcripts); `bar` (a tqdm bar)
    advances by one each step."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    losses = []
    order: list[int] = []
    for step in range(1, max_steps + 1):
        if len(order) < batch_size:
            order += rng.sample(range(len(prompts)), len(prompts))
        idx, order = order[:batch_size], order[batch_size:]
        ids_BT, mask_BT, loss_mask_BT = (
            batch_of(idx, step)
            if batch_of is not None
            else supervised_batch(tokenizer, [prompts[i] for i in idx], [answers[i] for i in idx])
        )
        logits_BTV = model(
            input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_ids_from_mask(mask_BT)
        ).logits
        token_loss_BT = torch.nn.functional.cross_entropy(
            logits_BTV[:, :-1].flatten(0, 1).float(), ids_BT[:, 1:].flatten(), reduction="none"
        ).view(ids_BT.shape[0], -1)
        loss = (token_loss_BT * loss_mask_BT[:, 1:]).sum() / loss_mask_BT[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
        if step % check_every == 0:
            model.eval()
            stop = should_stop(step)
            model.train()
            if stop:
                break
    model.eval()
    return losses


def _bar(max_steps: int, *, enabled: bool):
    """The warm-start's progress bar on stderr, as the run's own (tqdm), over its most steps."""
    from tqdm import tqdm

    return tqdm(
        total=max_steps,
        desc="warm-start",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not enabled,
    )


def warm_start_to_target(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    train: Sequence[dict],
    validation: Sequence[dict],
    is_correct,
    sampling,
    settings,
    seed: int,
    log,
    env=None,
    batch_of=None,
    progress_bar: bool = False,
) -> dict:
    """Supervised training on `train` rows ({"prompt", "answer"}) until the sampled accuracy on
    `validation` (each row twice, keyed per (step, sample)) reaches `settings.target_accuracy`.

    `settings` is the run's `warmstart` section; a target not reached in `settings.max_steps` is a user
    error naming both; `batch_of` as in `supervised_warmstart`. `progress_bar`: a bar of the steps out of
    `settings.max_steps` (the most it can take) and the latest validation accuracy. Returns {steps,
    validation_accuracy, final_loss}."""
    from distflow.rollout.evaluation import count_correct

    accuracy = [0.0]

    def reached_target(step: int) -> bool:
        keys = [derive_seed(seed, "warmstart-validation", step, j) for j in range(2 * len(validation))]
        correct, total = count_correct(
            model, tokenizer, validation, is_correct, sampling, sample_keys=keys, samples_per_prompt=2, env=env
        )
        accuracy[0] = correct / total
        bar.set_postfix_str(f"validation accuracy {accuracy[0]:.3f} of {settings.target_accuracy}")
        return accuracy[0] >= settings.target_accuracy

    losses: list[float] = []
    if settings.target_accuracy > 0:
        log(
            f"warm-start: supervised training on {len(train)} problems until validation accuracy "
            f">= {settings.target_accuracy}, at most warmstart.max_steps={settings.max_steps} steps (the bar's "
            "estimate is of that many; cached afterwards)"
        )
        bar = _bar(settings.max_steps, enabled=progress_bar)  # after the line: tqdm draws when it is made
        with bar:
            losses = supervised_warmstart(
                model,
                tokenizer,
                [r["prompt"] for r in train],
                [r["answer"] for r in train],
                max_steps=settings.max_steps,
                batch_size=settings.batch_size,
                lr=settings.lr,
                seed=derive_seed(seed, "warmstart-order"),
                should_stop=reached_target,
                check_every=settings.check_every,
                batch_of=batch_of,
                bar=bar,
            )
        if accuracy[0] < settings.target_accuracy:
            raise _missed(accuracy[0], settings)
    return {"steps": len(losses), "validation_accuracy": accuracy[0], "final_loss": losses[-1] if losses else None}


def _missed(accuracy: float, settings):
    """The error of a warm-start that did not reach its target."""
    from distflow.config import ConfigError

    return ConfigError(
        f"the warm-start reached validation accuracy {accuracy:.3f} < warmstart.target_accuracy="
        f"{settings.target_accuracy} in warmstart.max_steps={settings.max_steps} steps; raise max_steps "
        "or lower the target"
    )

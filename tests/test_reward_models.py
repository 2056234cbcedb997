"""Reward models (task.reward_models): batched scores, the weighted sum, bad paths, a CLI run."""

import json

import pytest
import torch
from conftest import REPO, run_cli
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from distflow import preflight
from distflow.config import ConfigError
from distflow.config.loader import load_config
from distflow.scoring.reward import ModelTerm, Rewards, RewardTerm
from distflow.scoring.reward_models import RewardModel
from distflow.tasks.tokenizer import build_char_tokenizer


def _llama_config(tokenizer, **extra):
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny random one-label Llama reward model and its tokenizer, saved locally."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(_llama_config(tokenizer, num_labels=1))
    torch.nn.init.normal_(model.score.weight, std=1.0)
    directory = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_batched_scores_equal_one_at_a_time(reward_model_dir):
    prompts, completions = ["1+2=", "33+44=", "5+5=", "9+1="], ["3", "77", "1000", ""]
    batched = RewardModel(str(reward_model_dir), batch_size=3, device=torch.device("cpu")).score(prompts, completions)
    model = LlamaForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = build_char_tokenizer()
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids = torch.tensor([tokenizer(p + c)["input_ids"]])
        with torch.no_grad():
            alone = model(input_ids=ids).logits[0, 0].item()
        assert batched[i].item() == pytest.approx(alone, abs=1e-5)
    assert batched.dtype == torch.float32 and len(set(batched.tolist())) == 4


def test_reward_model_adds_its_weighted_score_to_the_rule_terms(reward_model_dir):
    model = RewardModel(str(reward_model_dir), batch_size=8, device=torch.device("cpu"))
    rewards = Rewards(
        [RewardTerm("rule", lambda p, c, s: float(c == s["answer"]))], models=[ModelTerm("rm", model, weight=0.5)]
    )
    prompts, completions, samples = ["1+2=", "2+2="], ["3", "5"], [{"answer": "3"}, {"answer": "4"}]
    rm = model.score(prompts, completions)
    scores = rewards.score(prompts, completions, samples)
    assert scores.reward_B.tolist() == pytest.approx([1.0 + 0.5 * rm[0].item(), 0.5 * rm[1].item()], abs=1e-6)
    assert scores.term_sums["rule"] == 1.0 and scores.term_sums["rm"] == pytest.approx(rm.sum().item(), abs=1e-5)


def test_a_reward_model_path_that_is_not_a_sequence_classifier_is_a_user_error(tmp_path, reward_model_dir):
    tokenizer = build_char_tokenizer()
    causal = tmp_path / "causal"
    LlamaForCausalLM(_llama_config(tokenizer)).save_pretrained(causal)
    two_labels = tmp_path / "two-labels"
    LlamaForSequenceClassification(_llama_config(tokenizer, num_labels=2)).save_pretrained(two_labels)
    for path, needle in (
        (tmp_path / "missing", "no config.json"),
        (causal, "not a sequence classifier"),
        (two_labels, "has 2 labels"),
    ):
        config = load_config(None, [f"task.reward_models=[{{path: {path}}}]"])
        with pytest.raises(ConfigError, match=needle):
            preflight.check_reward_models(config)
    preflight.check_reward_models(load_config(None, [f"task.reward_models=[{{path: {reward_model_dir}}}]"]))
    # Through the CLI: one line, exit 2, before any rank starts.
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        f"task.reward_models=[{{path: {causal}}}]",
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"distflow: error: task.reward_models[0].path: '{causal}' holds ['LlamaForCausalLM'], not a sequence "
        "classifier; save a reward model from AutoModelForSequenceClassification(..., num_labels=1)"
    ]


def test_a_run_with_a_rule_reward_and_a_reward_model_logs_both(tmp_path, cache_dir, reward_model_dir):
    result = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "rollout.num_samples=4",
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "task.num_heldout=20",
        "trainer.progress_bar=false",
        "warmstart.target_accuracy=0",
        f"warmstart.cache_dir={cache_dir}",
        "trainer.loggers=[jsonl]",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        "checkpoint.at_end=false",
        f"task.reward_models=[{{path: {reward_model_dir}, weight: 0.5, name: judge, batch_size: 5}}]",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    for record in steps:
        # reward/mean = mean(correctness) + 0.5 * mean(judge): both terms logged, the sum trained on.
        assert record["reward/judge"] != 0.0
        assert record["reward/mean"] == pytest.approx(
            record["reward/correctness_reward"] + 0.5 * record["reward/judge"], abs=1e-5
        )

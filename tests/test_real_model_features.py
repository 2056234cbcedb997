"""Every feature once at real size (slow: CI runs these after `make smollm2`): SmolLM2-135M-Instruct
on reasoning-gym's chain_sum through the real CLI with tiny budgets — fsdp2 on 2 ranks (and its
per-rank parameter + optimizer bytes about half of ddp's), LoRA, bounded staleness on a
disaggregated placement, a multi-turn tool episode whose turn boundaries are the chat template's,
and kill -9 then --resume reproducing the uninterrupted run."""

import json
import os
import sys

import pytest
from conftest import REPO, run_cli
from test_real_model import (  # noqa: F401 (PROMPT: the same fixed question)
    PROMPT,
    RECIPE,
    TINY,
    model_dir,  # noqa: F401 (the fixture)
)

pytestmark = pytest.mark.slow

USER_CODE = '''
import json, os, signal


def length_reward(prompt, completion, sample):
    """Differs within every group, so every step has a gradient (the 135M model rarely solves 2 prompts)."""
    return float(len(completion))


class ToolOnce:
    """Whatever the model says first is answered by a tool message; its second turn is the answer."""

    def reset(self, sample):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return [{"role": "tool", "content": "46"}], 0.0, False, {"tool_call": True}
        return None, 0.0, True, {}


def record(batch, ctx):
    os.makedirs("records", exist_ok=True)
    with open(f"records/step{ctx.step}-rank{ctx.world.rank}.json", "w") as f:
        json.dump({"uid": batch["uid"], "completion": batch["completion"], "ids": batch["input_ids"].tolist(),
                   "mask": batch["response_mask"].tolist()}, f)
    if ctx.step == int(os.environ.get("KILL_AT_STEP", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
    return batch
'''
RECORD = (
    "pipeline.custom_stages=[{name: record, fn: 'user_code:record', after: [reward], before: [advantage], "
    "reads: [uid, completion, input_ids, response_mask]}]"
)


def train(cwd, *extra, env=None):
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "user_code.py").write_text(USER_CODE)
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        done = run_cli(
            "train",
            RECIPE,
            *TINY,
            RECORD,
            "task.reward=user_code:length_reward",
            f"trainer.output_dir={cwd}",
            "trainer.run_name=run",
            *extra,
            cwd=cwd,
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    metrics = (
        [json.loads(line) for line in (cwd / "run/metrics.jsonl").read_text().splitlines()]
        if (cwd / "run/metrics.jsonl").exists()
        else []
    )
    return done, metrics


def records(cwd, step):
    return [json.loads(p.read_text()) for p in sorted((cwd / "records").glob(f"step{step}-rank*.json"))]


def trained(metrics, steps):
    assert [m["step"] for m in metrics] == list(range(steps + 1))
    for m in metrics[1:]:
        assert m["tokens/trained"] > 0 and m["train/grad_norm"] > 0 and abs(m["train/pg_loss"]) < 1e3


@pytest.mark.heavy  # `make test-heavy`: ~90 s (CI trains tiny models under fsdp2)
def test_fsdp2_on_two_ranks_trains_and_holds_half_the_state_of_ddp(tmp_path, model_dir):  # noqa: F811
    done, metrics = train(tmp_path, "--nproc", "2", "parallel.strategy=fsdp2")
    assert done.returncode == 0, done.stderr[-3000:]
    trained(metrics, 1)
    sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/memory.py's ranks (spawned) import it too
    try:
        import memory

        shape = (1, 16, 1)  # batch, tokens, steps: the state is what matters here
        ddp, fsdp2 = (memory.measure(strategy, 2, model_dir, shape) for strategy in ("ddp", "fsdp2"))
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert ddp["state"] > 4 * 134_515_008 * 4 * 0.95  # parameters + gradients + AdamW's two moments, float32
    assert 0.45 <= fsdp2["state"] / ddp["state"] <= 0.55, (fsdp2["state"], ddp["state"])


def test_lora_trains_only_adapters(tmp_path, model_dir):  # noqa: F811
    done, metrics = train(tmp_path, "model.lora.rank=8", "trainer.total_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    trained(metrics, 2)
    export = run_cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"), cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-2000:]
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["r"] == 8 and not (tmp_path / "adapter/model.safetensors").exists()


@pytest.mark.heavy  # `make test-heavy`: ~65 s (CI runs bounded staleness on tiny models)
def test_bounded_staleness_on_a_disaggregated_placement(tmp_path, model_dir):  # noqa: F811
    done, metrics = train(
        tmp_path,
        "--nproc",
        "2",
        "placement.rollout.ranks=0",
        "placement.train.ranks=1",
        "asynchronous.max_staleness=1",
        "trainer.total_steps=3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trained(metrics, 3)


def test_a_tool_turn_follows_the_chat_template(tmp_path, model_dir):  # noqa: F811
    """The model's first turn ends with its own <|im_end|> (mask 1); the tool's message follows as the
    template writes it after that token, up to the next assistant header (mask 0); then the model again."""
    done, metrics = train(tmp_path, "env.cls=user_code:ToolOnce", "env.max_turns=2", "env.max_tokens=96")
    assert done.returncode == 0, done.stderr[-3000:]
    trained(metrics, 1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen = 0
    for record in records(tmp_path, 1):
        for ids, mask in zip(record["ids"], record["mask"], strict=True):
            response = ids[len(ids) - len(mask) :]
            first_gap = mask.index(0) if 0 in mask else None
            if first_gap is None or response[first_gap - 1] != im_end:
                continue  # the first turn ran to rollout.max_new_tokens, or the episode ended
            end = mask.index(1, first_gap) if 1 in mask[first_gap:] else len(mask)
            observation = tokenizer.decode(response[first_gap:end])
            assert observation == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n", observation
            seen += 1
    assert seen >= 1


@pytest.mark.heavy  # `make test-heavy`: ~130 s (CI resumes tiny-model runs after kill -9)
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(tmp_path, model_dir):  # noqa: F811
    args = ["trainer.total_steps=2", "checkpoint.every=1"]
    done, reference = train(tmp_path / "uninterrupted", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    killed, _ = train(tmp_path / "killed", *args, env={"KILL_AT_STEP": "2"})
    assert killed.returncode == -9  # one process: the run itself was killed
    resumed, metrics = train(tmp_path / "killed", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert records(tmp_path / "killed", 2) == records(tmp_path / "uninterrupted", 2)  # the same samples
    for key in ("reward/mean", "tokens/trained", "train/pg_loss", "train/grad_norm", "eval/greedy_accuracy"):
        assert metrics[2][key] == pytest.approx(reference[2][key], rel=1e-3, abs=1e-6), key

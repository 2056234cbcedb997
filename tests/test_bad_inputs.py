"""The bad-input corpus: configs, reward functions, checkpoints and data that users get wrong.

Each case runs the real `distflow` command and checks its exit code and its message: a
user error is exit 2 and one line `distflow: error: ...` with no traceback, and most fail
before any rank starts (well under a second). A few cases need a rank to find the problem
(a checkpoint of another model, invalid rows, NaN losses). Data files checked through the
row sources the loader reads them with are in tests/test_bad_data.py; user code that misbehaves,
inputs checked before any rank starts and signals to the launcher in tests/test_bad_user_code.py.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_cli
from test_bad_data import jsonl
from test_e2e import TINY, read_metrics

from distflow.checkpoint import save_checkpoint
from distflow.comm import Comm
from distflow.config.schema import OptimConfig
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.policy import PolicyEngine

CONFIG = str(REPO / "examples/arith_grpo.yaml")
USER_FILES = {
    "rewards_ok.py": "def one_arg(completion):\n    return 1.0\n\nNOT_A_FUNCTION = 3\n\n"
    "def always_raises(prompt, completion, sample):\n    return 1 / 0\n",
    "rewards_syntax.py": "def reward(prompt, completion, sample)\n    return 1.0\n",
    "rewards_crash.py": "raise RuntimeError('module crashed at import')\n",
    "bad.yaml": "trainer: [1\n",
    "list.yaml": "- a\n- b\n",
    "nan_stage.py": "def poison(batch, ctx):\n    return batch.updated(advantage=batch['advantage'] * float('nan'))\n",
}

# (id, arguments after `distflow`, needle in the one error line). "{tmp}" is the test's directory.
FAST = [
    ("unknown key", ["checkpoint.evry=5"], "unknown config key 'checkpoint.evry'; did you mean 'checkpoint.every'?"),
    ("unknown section", ["trainr.total_steps=5"], "did you mean 'trainer'?"),
    ("wrong type", ["trainer.total_steps=five"], "trainer.total_steps must be an integer (got 'five')"),
    ("bool type", ["checkpoint.at_end=maybe"], "checkpoint.at_end must be true or false"),
    ("range top_p", ["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
    ("keep_last 0", ["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
    ("every < 0", ["checkpoint.every=-1"], "checkpoint.every must be >= 0"),
    ("stage timeout", ["watchdog.stage_timeout_s=0.5"], "watchdog.stage_timeout_s must be 0 (off) or >= 1"),
    ("collective timeout", ["parallel.collective_timeout_s=5"], "parallel.collective_timeout_s must be >= 10"),
    # Seconds past what a timer or a timestamp holds (issue 64: 1e30 crashed the run in an OverflowError).
    (
        "agent timeout 1e30",
        ["rollout.agent_timeout_s=1e30"],
        "rollout.agent_timeout_s must be at most 604800 seconds (7 days; got 1e+30)",
    ),
    ("reward timeout 1e30", ["task.reward_timeout_s=1e30"], "task.reward_timeout_s must be at most 604800 seconds"),
    ("stage timeout 1e30", ["watchdog.stage_timeout_s=1e30"], "watchdog.stage_timeout_s must be at most 604800"),
    ("collective 1e30", ["parallel.collective_timeout_s=10000000"], "parallel.collective_timeout_s must be at most"),
    ("env deadline 1e30", ["env.deadline_s=1e30"], "env.deadline_s must be at most 604800 seconds"),
    ("time budget 1e30", ["trainer.time_budget_s=1e30"], "trainer.time_budget_s must be at most 31536000 seconds"),
    ("nonfinite limit", ["watchdog.max_nonfinite_steps=-1"], "watchdog.max_nonfinite_steps must be >= 0"),
    ("row policy", ["data.on_invalid_row=ignore"], "data.on_invalid_row must be error or skip (got 'ignore')"),
    ("max prompt tokens", ["data.max_prompt_tokens=-3"], "data.max_prompt_tokens must be >= 0"),
    ("required fields type", ["data.required_fields=answer"], "data.required_fields must be a list"),
    ("batch vs world size", ["trainer.prompts_per_step=3", "--nproc", "2"], "does not divide its 3 prompts per step"),
    (
        "mini-batches",
        ["algorithm.num_mini_batches=1000", "trainer.prompts_per_step=4", "rollout.num_samples=4"],
        "algorithm.num_mini_batches=1000 exceeds the 16 samples",
    ),
    ("group size", ["rollout.num_samples=1"], "rollout.num_samples must be >= 2"),
    (
        "env class",
        ["env.cls=distflow.envs.tools:NoSuchEnv"],
        "env.cls: module 'distflow.envs.tools' has no function 'NoSuchEnv'",
    ),
    ("env not an environment", ["env.cls=distflow.envs.calculator:calculate"], "has no reset and no step method"),
    ("env turns", ["env.cls=distflow.envs.tools:CalculatorEnv", "env.max_turns=0"], "env.max_turns must be >= 1"),
    ("env kwargs", ["env.kwargs=3"], "env.kwargs must be a mapping (got 3)"),
    (
        "env with remax",
        ["env.cls=distflow.envs.tools:CalculatorEnv", "algorithm.name=remax"],
        "algorithm.name=remax needs a greedy single-turn baseline",
    ),
    (
        "algorithm name",
        ["algorithm.name=grpo2"],
        "algorithm.name must be one of: grpo, dr_grpo, dapo, rloo, "
        "reinforce_pp, reinforce_pp_baseline, remax, gspo, ppo (got 'grpo2')",
    ),
    (
        "algorithm loss_agg",
        ["algorithm.loss_agg=mean"],
        "algorithm.loss_agg must be one of: token-mean, token-sum, "
        "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (got 'mean')",
    ),
    (
        "algorithm kl estimator",
        ["algorithm.kl.estimator=low_var_kl"],
        "algorithm.kl.estimator must be one of: k1, k2, k3, abs, k1+, k3+ (got 'low_var_kl')",
    ),
    ("algorithm policy loss", ["algorithm.policy_loss=vanilla"], "algorithm.policy_loss must be one of: ppo, gspo"),
    (
        "algorithm old and new key",
        ["algorithm.kl_coef=0.1", "algorithm.kl.coef=0.2"],
        "algorithm.kl_coef and algorithm.kl.coef are both set",
    ),
    ("placement overlap", ["--nproc", "2", "placement.rollout.ranks=0-1", "placement.train.ranks=1"], "overlap partly"),
    (
        "idle rank",
        ["--nproc", "3", "trainer.prompts_per_step=3", "placement.rollout.ranks=0", "placement.train.ranks=1"],
        "rank 2 is in no worker group",
    ),
    ("model path", ["model.path=/nonexistent/model"], "model.path='/nonexistent/model' is not a Hugging Face model"),
    (
        "tokenizer path",
        ["model.tokenizer_path=/nonexistent/tok"],
        "model.tokenizer_path='/nonexistent/tok' is not a dir",
    ),
    ("digits", ["task.num_digits=4"], "task.num_digits must be in 1..3"),
    ("no training rows", ["task.num_digits=1"], "leaves none of the 100 problems"),
    (
        "stage cycle",
        [
            "pipeline.custom_stages=[{name: loop, fn: 'distflow.dag.stages:weight_sync', "
            "after: [policy_update], before: [rollout]}]"
        ],
        "cycle",
    ),
    (
        "stage dependency",
        ["pipeline.custom_stages=[{name: x, fn: 'distflow.dag.stages:weight_sync', after: [rewrd]}]"],
        "stage 'x' depends on unknown stage 'rewrd'",
    ),
    ("nproc 0", ["--nproc", "0"], "--nproc must be >= 1"),
    (
        "fsdp2 shard size",
        ["--nproc", "3", "trainer.prompts_per_step=3", "parallel.strategy=fsdp2", "parallel.fsdp.shard_size=2"],
        "parallel.fsdp.shard_size=2 does not divide the 3 train ranks",
    ),
    (
        "hsdp disaggregated",
        [
            "--nproc",
            "3",
            "trainer.prompts_per_step=2",
            "placement.rollout.ranks=0",
            "placement.train.ranks=1-2",
            "parallel.strategy=fsdp2",
            "parallel.fsdp.shard_size=1",
        ],
        "(HSDP) needs every rank in the train group",
    ),
    (
        "fsdp2 float16 on cpu",
        ["parallel.strategy=fsdp2", "parallel.param_dtype=float16", "parallel.device=cpu"],
        "parallel.param_dtype=float16 is not supported on the CPU",
    ),
    (
        "ddp mixed precision",
        ["parallel.reduce_dtype=bfloat16"],
        "parallel.reduce_dtype=bfloat16 needs parallel.strategy=fsdp2",
    ),
    ("strategy", ["parallel.strategy=fsdp"], "parallel.strategy must be ddp or fsdp2 (got 'fsdp')"),
    ("reward module", ["task.reward=no_such_module:fn"], "task.reward: cannot import module 'no_such_module'"),
    ("reward function", ["task.reward=rewards_ok:nope"], "task.reward: module 'rewards_ok' has no function 'nope'"),
    ("reward not callable", ["task.reward=rewards_ok:NOT_A_FUNCTION"], "has no function 'NOT_A_FUNCTION'"),
    ("reward syntax", ["task.reward=rewards_syntax:reward"], "cannot import module 'rewards_syntax'"),
    ("reward import crash", ["task.reward=rewards_crash:reward"], "RuntimeError: module crashed at import"),
    (
        "reward signature",
        ["task.reward=rewards_ok:one_arg"],
        "task.reward: 'rewards_ok:one_arg' must accept (prompt, completion, sample)",
    ),
    # An agent is called as fn(client, sample): one that is not is refused at load (issue 64), not run on
    # default rewards with every episode failing.
    (
        "agent signature",
        ["rollout.agent=rewards_ok:one_arg"],
        "rollout.agent: 'rewards_ok:one_arg' must accept (client, sample)",
    ),
    ("agent module", ["rollout.agent=no_such_module:solve"], "rollout.agent: cannot import module 'no_such_module'"),
    ("resume without run", ["--resume"], "--resume without a checkpoint continues trainer.run_name's run"),
    ("resume missing", ["--resume", "/nonexistent/ckpt"], "checkpoint /nonexistent/ckpt does not exist"),
    ("resume incomplete", ["--resume", "{tmp}/ckpt/step-000007"], "is incomplete (no COMPLETE marker)"),
    (
        "resume empty run",
        ["--resume", "trainer.run_name=empty", "trainer.output_dir={tmp}"],
        "no complete checkpoint in {tmp}/empty/checkpoints to resume from; start the run without --resume",
    ),
    (
        "resume without meta.json",
        ["--resume", "{tmp}/ckpt-nometa/step-000003"],
        "checkpoint {tmp}/ckpt-nometa/step-000003 has no meta.json: it was damaged after it was saved",
    ),
    (
        "resume truncated shard",
        ["--resume", "{tmp}/ckpt-truncated/step-000003"],
        "checkpoint {tmp}/ckpt-truncated/step-000003: shard __0_0.distcp holds 1000 of its",
    ),
    (
        "resume empty shard",
        ["--resume", "{tmp}/ckpt-emptied/step-000003"],
        "checkpoint {tmp}/ckpt-emptied/step-000003: shard __0_0.distcp holds 0 of its",
    ),
    (
        "resume finished",
        ["--resume", "{tmp}/done", "trainer.total_steps=3"],
        "is at step 3 >= trainer.total_steps=3: nothing left to do",
    ),
    (
        "run dir taken",
        ["trainer.run_name=taken", "trainer.output_dir={tmp}"],
        "already holds a run; choose another trainer.run_name, or continue it with --resume",
    ),
]
if not torch.cuda.is_available():
    FAST.append(("no cuda", ["parallel.device=cuda"], "parallel.device=cuda but no CUDA device is visible"))
FILES = [  # (id, the whole command line, needle)
    ("invalid yaml", ["train", "{tmp}/bad.yaml"], "is not valid YAML"),
    ("yaml not a mapping", ["train", "{tmp}/list.yaml"], "must hold a mapping at the top level"),
    ("missing config", ["train", "{tmp}/nope.yaml"], "does not exist"),
    ("export missing", ["export", "{tmp}/nothing", "--out", "{tmp}/hf"], "checkpoint {tmp}/nothing does not exist"),
    ("export over files", ["export", "{tmp}/done", "--out", "{tmp}/ckpt"], "exists and is not an empty directory"),
]


def tiny_checkpoint(root, step, *, hidden_size=32):
    comm = Comm(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    engine = PolicyEngine(
        build_tiny_model(build_char_tokenizer(), seed=0, hidden_size=hidden_size, num_layers=1),
        comm,
        OptimConfig(),
        temperature=1.0,
    )
    extra = {"config": {}, "loader": {"epoch": 0, "cursor": 0, "num_rows": 9960}}
    return save_checkpoint(
        root,
        step,
        model=engine.model,
        optimizer=engine.optimizer,
        scheduler=engine.scheduler,
        extra=extra,
        comm=comm,
        keep_last=1,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-inputs")
    for name, text in USER_FILES.items():
        (tmp / name).write_text(text)
    (tmp / "ckpt/step-000007").mkdir(parents=True)  # a save that never finished
    (tmp / "empty").mkdir()
    (tmp / "taken").mkdir()
    (tmp / "taken/metrics.jsonl").write_text('{"step": 1}\n')
    done = tiny_checkpoint(tmp / "done/checkpoints", 3)
    for damaged, damage in (
        ("ckpt-nometa", lambda c: (c / "meta.json").unlink()),
        ("ckpt-truncated", lambda c: os.truncate(c / "__0_0.distcp", 1000)),
        ("ckpt-emptied", lambda c: os.truncate(c / "__0_0.distcp", 0)),
    ):
        shutil.copytree(done, tmp / damaged / done.name)
        damage(tmp / damaged / done.name)
    return tmp


def check_one_line_error(result, needle, *, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("distflow: error: ") and needle in lines[-1], result.stderr[-3000:]
    return lines


@pytest.mark.parametrize("args, needle", [c[1:] for c in FAST], ids=[c[0] for c in FAST])
def test_config_errors_stop_before_any_rank(workdir, args, needle):
    args = [a.replace("{tmp}", str(workdir)) for a in args]
    result = run_cli("train", CONFIG, *args, cwd=workdir, timeout=1800)
    lines = check_one_line_error(result, needle.replace("{tmp}", str(workdir)))
    assert len(lines) == 1  # nothing else printed: no rank started, no warm-start was built


@pytest.mark.parametrize("args, needle", [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_file_errors(workdir, args, needle):
    result = run_cli(*[a.replace("{tmp}", str(workdir)) for a in args], cwd=workdir, timeout=1800)
    assert len(check_one_line_error(result, needle.replace("{tmp}", str(workdir)))) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["train", CONFIG, "--resume", "{tmp}/nothing"],
        ["train", CONFIG, "--resume", "{tmp}/empty"],
        ["export", "{tmp}/nothing", "--out", "{tmp}/hf"],
    ],
    ids=["resume missing", "resume empty run", "export missing"],
)
def test_a_path_with_no_checkpoint_is_named_before_torch_loads(workdir, args):
    """What names no checkpoint at all is found from the directories alone (checkpoint/locate.py), in a
    fraction of a second: torch, and transformers, load only once a checkpoint is found."""
    args = [a.replace("{tmp}", str(workdir)) for a in args]
    code = (
        "import sys; from distflow.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=workdir, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("distflow: error: ") and "checkpoint" in result.stderr


# ---- errors that a rank finds (each a short real run) ------------------------------------------


def train(workdir, cache_dir, name, *extra):
    return run_cli(
        "train",
        CONFIG,
        *TINY,
        "warmstart.target_accuracy=0",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={workdir}",
        f"trainer.run_name={name}",
        *extra,
        cwd=workdir,
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["data.max_prompt_tokens=3"], "the task's training rows: row 1 of 9960: prompt has"),
        (["data.required_fields=[solution]"], "the task's training rows: row 1 of 9960: missing field 'solution'"),
    ],
    ids=["overlong prompts", "missing field"],
)
def test_invalid_rows_are_rejected_with_their_number(workdir, cache_dir, extra, needle, request):
    check_one_line_error(train(workdir, cache_dir, request.node.callspec.id.replace(" ", "-"), *extra), needle)


def test_a_response_limit_beyond_the_models_positions_is_refused(workdir, cache_dir):
    """The embedded model attends to 64 positions; a 7-token prompt leaves 57 (this used to hang
    in the first evaluation)."""
    check_one_line_error(
        train(workdir, cache_dir, "too-long", "rollout.max_new_tokens=100000"),
        "rollout.max_new_tokens=100000 + the longest held-out prompt (7 tokens) exceeds the model's "
        "max_position_embeddings=64: set rollout.max_new_tokens to at most 57",
    )


def test_invalid_rows_can_be_skipped_and_counted(workdir, cache_dir):
    # Prompts "a+b=" with two 2-digit operands are the longest (7 tokens with BOS): skip those.
    result = train(workdir, cache_dir, "skip", "data.max_prompt_tokens=6", "data.on_invalid_row=skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: skipped 8064 of 9960 rows of the task's training rows (8064 overlong prompt)" in result.stderr
    assert read_metrics(workdir / "skip")[0]["data/skipped_rows"] == 8064


def save_text_model(directory):
    """A local model directory, as `task.train_file` needs one."""
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def text_model(workdir):
    return save_text_model(workdir / "model")


CHAT_ROW = {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}


@pytest.mark.parametrize(
    "bad_line, needle",
    [
        (
            json.dumps({"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {}}),
            "row 2 of 3: missing field 'reward_model.ground_truth'",
        ),
        ('{"prompt": [{"role": "user", "content": "2+', "row 2 of 3: {path}:2 is not valid JSON"),
        (
            json.dumps({"prompt": [{"role": "user", "content": " "}], "reward_model": {"ground_truth": "4"}}),
            "row 2 of 3: empty prompt",
        ),
    ],
    ids=["missing ground truth", "invalid json line", "empty chat prompt"],
)
def test_invalid_rows_of_a_dataset_file_stop_the_run(workdir, cache_dir, text_model, bad_line, needle, request):
    name = request.node.callspec.id.replace(" ", "-")
    path = jsonl(workdir, json.dumps(CHAT_ROW), bad_line, json.dumps(CHAT_ROW), name=f"{name}.jsonl")
    result = train(
        workdir,
        cache_dir,
        name,
        f"model.path={text_model}",
        "task.source=files",
        f"task.train_file={path}",
        f"task.heldout_file={path}",
        "data.required_fields=[reward_model.ground_truth]",
        "trainer.prompts_per_step=2",
        "task.num_heldout=2",
    )
    check_one_line_error(result, f"{path}: " + needle.replace("{path}", str(path)))


def test_checkpoint_of_another_model_is_rejected(workdir, cache_dir):
    checkpoint = tiny_checkpoint(workdir / "other-model", 1, hidden_size=48)
    result = train(workdir, cache_dir, "incompatible", "--resume", str(checkpoint))
    check_one_line_error(result, "'model.embed_tokens.weight' has shape (21, 48) in the checkpoint but (21, 128)")


def test_reward_that_always_raises_is_contained_and_counted(workdir, cache_dir):
    result = train(workdir, cache_dir, "raising-reward", "task.reward=rewards_ok:always_raises")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["reward/errors"] for r in read_metrics(workdir / "raising-reward")[1:]] == [16.0, 16.0, 16.0]


def test_nan_losses_are_skipped_then_abort(workdir, cache_dir):
    stage = (
        "pipeline.custom_stages=[{name: poison, fn: 'nan_stage:poison', after: [advantage], "
        "before: [policy_update], reads: [advantage], writes: [advantage]}]"
    )
    result = train(
        workdir, cache_dir, "nan", stage, "watchdog.max_nonfinite_steps=2", "algorithm.skip_zero_variance_groups=false"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "distflow: aborted at step 2: 2 optimizer steps in a row had a non-finite loss "
        "or gradient and were skipped (watchdog.max_nonfinite_steps=2); lower optim.lr, check the reward and custom "
        "stages, or resume from an earlier checkpoint"
    )
    records = read_metrics(workdir / "nan")
    assert [r["train/nonfinite_grad_steps"] for r in records[1:]] == [1.0, 1.0]

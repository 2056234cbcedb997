"""`distflow.train`, the Python API: in one interpreter twice (as in a notebook), under torchrun as
the CLI's `--nproc 2` does, and its errors as the CLI's messages raised as `DistflowError`s."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

import distflow
from distflow.config import Config, TrainerConfig
from distflow.inputs import Inputs

TINY = [
    "trainer.total_steps=3",
    "trainer.prompts_per_step=4",
    "rollout.num_samples=4",
    "trainer.eval_every=2",
    "trainer.eval_samples=2",
    "task.num_heldout=40",
    "trainer.progress_bar=false",
    "warmstart.target_accuracy=0",
]
COMPARED = (
    "reward/mean",
    "reward/reward",
    "response/length",
    "tokens/trained",
    "train/pg_loss",
    "train/grad_norm",
    "train/entropy",
    "eval/accuracy",
    "eval/greedy_accuracy",
)

# What a notebook does: functions defined in __main__ (no file), two runs in one interpreter.
NOTEBOOK = """
import json, os, signal, sys, threading
import torch.distributed as dist
import distflow

def reward(prompt, completion, sample):
    return 1.0 if completion.strip() == sample["answer"] else -0.25

overrides = json.loads(sys.argv[1])
before = {k: v for k, v in os.environ.items() if k.startswith("DISTFLOW_")}, signal.getsignal(signal.SIGTERM)
first = distflow.train(overrides=overrides + ["trainer.run_name=first"], rewards=reward)
second = distflow.train(overrides=overrides + ["trainer.run_name=second"], rewards=reward)
try:
    distflow.train(overrides=overrides + ["trainer.run_name=third"], rewards=reward, nproc=2)
except distflow.ConfigError as err:
    refused = str(err)
after = {k: v for k, v in os.environ.items() if k.startswith("DISTFLOW_")}, signal.getsignal(signal.SIGTERM)
print(json.dumps({"runs": [first.metrics(), second.metrics()], "final_eval": first.final_eval,
                  "summary": first.summary, "run_dirs": [str(first.run_dir), str(second.run_dir)],
                  "same_state": before == after, "process_group": dist.is_initialized(), "refused": refused,
                  "threads": [(t.name, t.daemon) for t in threading.enumerate() if t is not threading.main_thread()]}))
"""


def assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in COMPARED:
            if b.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (b["step"], key)


def test_a_notebook_trains_twice_in_one_interpreter_and_cannot_launch_its_own_functions(tmp_path, cache_dir):
    overrides = TINY + [f"warmstart.cache_dir={cache_dir}", f"trainer.output_dir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, json.dumps(overrides)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = out["runs"]
    assert [r["step"] for r in first] == [0, 1, 2, 3] and out["summary"]["steps"] == 3
    assert out["run_dirs"] == [str(tmp_path / "first"), str(tmp_path / "second")]
    # The notebook's reward scored the steps: -0.25 for a wrong answer, which the built-in reward never gives.
    assert all(-0.25 <= r["reward/mean"] <= 1.0 for r in first[1:]) and any(r["reward/mean"] < 0 for r in first[1:])
    assert out["final_eval"]["eval/accuracy"] == pytest.approx(out["summary"]["final_accuracy"], abs=1e-4)
    assert_same_metrics(second, first)  # nothing the first run left behind changed the second
    assert out["same_state"] and not out["process_group"]
    # No thread of distflow's, and none that would keep the interpreter alive (tqdm's daemon monitor may stay).
    assert [(name, daemon) for name, daemon in out["threads"] if name.startswith("distflow") or not daemon] == []
    assert out["refused"].startswith(
        "rewards ('reward') is defined in __main__ of an interactive session (a "
        "notebook), which the 2 ranks that nproc=2 starts cannot import"
    )


@pytest.mark.slow  # ~37 s: CI runs it (the default suite starts a script on two ranks below)
def test_the_script_under_torchrun_matches_the_cli_with_two_processes(tmp_path, cache_dir):
    common = TINY + [f"warmstart.cache_dir={cache_dir}", f"trainer.output_dir={tmp_path}"]
    script = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "examples/python_api.py"),
            *common,
            "trainer.run_name=script",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert script.returncode == 0, script.stderr[-3000:]
    (tmp_path / "default.yaml").write_text("# the embedded default\n")
    cli = run_cli(
        "train",
        str(tmp_path / "default.yaml"),
        *common,
        "trainer.run_name=cli",
        "task.reward=python_api:reward",
        "--nproc",
        "2",
        cwd=REPO / "examples",
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    read = [
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("script", "cli")
    ]
    assert json.loads((tmp_path / "script/summary.json").read_text())["world_size"] == 2
    assert any(r["reward/mean"] < 0 for r in read[1][1:])  # the script's reward, imported by the CLI's ranks
    assert_same_metrics(read[0], read[1])


SCRIPT = """
import gc
import sys

import torch.distributed
from torch.nn.parallel import DistributedDataParallel

import distflow

destroy = torch.distributed.destroy_process_group


def destroy_after_the_models(*args, **kwargs):  # a reducer freed after its group: gloo's threads can deadlock
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if alive:
        raise RuntimeError(f"{alive} DDP model(s) alive when the process groups are destroyed")
    destroy(*args, **kwargs)


torch.distributed.destroy_process_group = destroy_after_the_models

def reward(prompt, completion, sample):
    return 1.0 if completion.strip() == sample["answer"] else -0.5

if __name__ == "__main__":
    result = distflow.train(overrides=sys.argv[1:], rewards=reward, nproc=2)
    print(result.summary["world_size"], result.metrics()[1]["reward/mean"] < 0, sorted(result.final_eval))
"""


def test_a_script_starts_two_ranks_that_import_its_own_reward(tmp_path, cache_dir):
    """The ranks import the script by its file name (from its folder, not the working directory)."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code/my_script.py").write_text(SCRIPT)
    done = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "code/my_script.py"),
            *TINY,
            "trainer.total_steps=2",
            f"warmstart.cache_dir={cache_dir}",
            f"trainer.output_dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "2 True ['eval/accuracy', 'eval/greedy_accuracy']"
    config = (next(tmp_path.glob("2*/config.yaml"))).read_text()
    assert "reward: my_script:reward" in config


def test_errors_are_the_cli_messages_raised(tmp_path):
    environ = dict(os.environ)
    cli = run_cli("train", str(REPO / "examples/arith_grpo.yaml"), "trainer.total_stepz=3", cwd=tmp_path)
    assert cli.returncode == 2
    with pytest.raises(distflow.ConfigError) as raised:
        distflow.train(REPO / "examples/arith_grpo.yaml", ["trainer.total_stepz=3"])
    assert cli.stderr.strip().splitlines()[-1] == f"distflow: error: {raised.value}"
    assert isinstance(raised.value, distflow.DistflowError)

    def two_arguments(prompt, completion):
        return 0.0

    with pytest.raises(
        distflow.ConfigError,
        match=r"task.reward: .*two_arguments' must accept \(prompt, completion, "
        r"sample\)",
    ):
        distflow.train(overrides={"trainer.output_dir": str(tmp_path)}, rewards=two_arguments)
    with pytest.raises(distflow.ConfigError, match="rewards .'<lambda>'. is not a top-level function"):
        distflow.train(rewards=lambda p, c, s: 0.0, nproc=2)
    assert dict(os.environ) == environ


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"nproc": "2"}, "nproc must be a whole number >= 1 (got '2' of type str)"),
        ({"nproc": 2.5}, "nproc must be a whole number >= 1 (got 2.5 of type float)"),
        ({"nproc": True}, "nproc must be a whole number >= 1 (got True of type bool)"),  # it had run, as nproc=1
        ({"nproc": 0}, "nproc must be >= 1 (got 0)"),
        ({"max_restarts": "1"}, "max_restarts must be a whole number >= 0 (got '1' of type str)"),
        ({"overrides": 5}, "overrides must be a list of 'section.key=value' strings or a mapping"),
        ({"overrides": None}, "leave it out for none (got None of type NoneType)"),
        ({"overrides": [1, 2]}, "strings or a mapping {'section.key': value}: overrides[0] is 1 of type int"),
        ({"overrides": {"trainer.total_steps=3"}}, "(a set has no order, and a later override wins)"),
        ({"overrides": "trainer.total_steps=3"}, "(got 'trainer.total_steps=3' of type str)"),
    ],
    ids=["nproc str", "nproc float", "nproc bool", "nproc 0", "restarts str", "int", "None", "ints", "set", "str"],
)
def test_arguments_of_the_wrong_kind_are_one_line_naming_them(arguments, message):
    """Each as the CLI's errors are: a `ConfigError` of one line, raised before anything starts."""
    environ = dict(os.environ)
    with pytest.raises(distflow.ConfigError) as raised:
        distflow.train(**arguments)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert dict(os.environ) == environ
    assert distflow.api._running.acquire(blocking=False)  # and the next call may run
    distflow.api._running.release()


def test_config_objects_mappings_and_files_give_the_same_config(tmp_path):
    from distflow.api import _config
    from distflow.config.loader import config_of

    path = tmp_path / "c.yaml"
    path.write_text("trainer: {total_steps: 7}\n")
    made = [
        config_of(_config(config, {"rollout.num_samples": 8}, Inputs(launched=False, nproc=1)))
        for config in (path, {"trainer": {"total_steps": 7}}, Config(trainer=TrainerConfig(total_steps=7)))
    ]
    assert made[0] == made[1] == made[2]
    assert made[0].trainer.total_steps == 7 and made[0].rollout.num_samples == 8


def test_rows_become_the_files_the_file_task_reads():
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(30)]
    inputs = Inputs(launched=False, nproc=1)
    try:
        data = {"task": {}, "env": {}}
        inputs.apply(data, num_heldout=1000, dataset=rows)
        read = [[json.loads(line) for line in open(data["task"][key])] for key in ("train_file", "heldout_file")]
        assert read == [rows[:27], rows[27:]]  # a tenth held out
        inputs.apply(data, num_heldout=1000, dataset={"train": rows[:5], "test": rows[5:7]})
        assert [json.loads(line) for line in open(data["task"]["heldout_file"])] == rows[5:7]
        with pytest.raises(distflow.ConfigError, match=r"dataset\[1\] is not a dict"):
            inputs.apply(data, num_heldout=10, dataset=[rows[0], "text"])
    finally:
        inputs.close()


ROWS_SCRIPT = """
import json, string, sys
import datasets
import distflow
from distflow.tasks.math_answers import SIMPLE_CHAT_TEMPLATE
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

out = sys.argv[1]
tokenizer = build_char_tokenizer("".join(c for c in string.printable if c not in "\\n\\r\\t\\x0b\\x0c"))
tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
build_tiny_model(tokenizer, seed=0, max_positions=128).save_pretrained(out + "/model")
tokenizer.save_pretrained(out + "/model")
rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b), "level": a}
        for a in range(1, 9) for b in range(1, 5)]
splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(rows[:8])})
result = distflow.train(overrides={"model.path": out + "/model", "trainer.total_steps": 2,
                                   "trainer.prompts_per_step": 4,
                                   "rollout.num_samples": 4, "rollout.max_new_tokens": 8, "trainer.eval_every": 0,
                                   "trainer.eval_samples": 1, "trainer.progress_bar": False, "checkpoint.at_end": False,
                                   "trainer.output_dir": out, "trainer.run_name": "run"},
                        dataset=splits, rewards=[lambda prompt, completion, sample: sample["level"] / 10,
                                                 lambda prompt, completion, sample: 1.0])
print(json.dumps(result.metrics()))
"""


def test_a_hugging_face_dataset_and_lambdas_as_rewards(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", ROWS_SCRIPT, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:  # each row's own column reached the first reward; the second is named apart
        assert 0.1 <= r["reward/<lambda>"] <= 0.8 and r["reward/<lambda>_2"] == 1.0
        assert r["reward/mean"] == pytest.approx(r["reward/<lambda>"] + 1.0, rel=1e-5)

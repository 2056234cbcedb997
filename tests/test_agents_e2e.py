"""Agent code as the rollout, through the real CLI (`rollout.agent`): the agent drives the model with the
official `openai` client through the rank's endpoint, and the episode trains as a multi-turn sample.

The embedded model reads messages as their contents one after another, so an agent that sends the
addition prompt as its one user message rolls out what the plain rollout would (its keys differ)."""

import json

import pytest
from conftest import REPO, run_cli
from test_faults import ARGS as TINY_ARGS

pytest.importorskip("openai", reason="the agents extra: pip install 'distflow[agents]'")
pytest.importorskip("aiohttp", reason="the agents extra: pip install 'distflow[agents]'")

AGENT = '''
import openai


def solve(client: openai.OpenAI, sample: dict):
    """One chat call with the sum; the task's reward function grades the reply (None: no reward of its own)."""
    client.chat.completions.create(
        model="distflow-policy", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=6
    )
    if int(sample["answer"]) % 5 == 0:
        raise RuntimeError("a tool this agent needed was down")
    return None
'''

ARGS = [
    *TINY_ARGS,  # 2 steps of 4 prompts x 4 samples, no warm-start
    "rollout.agent=adder:solve",
    "trainer.loggers=[jsonl]",
    "env.default_reward=-1",
    "task.rewards=[{fn: 'shaping:length'}]",  # rewards that differ within a group: the update runs
]


def _train(tmp_path, cache_dir, name, *extra, config="examples/arith_grpo.yaml"):
    (tmp_path / "adder.py").write_text(AGENT)
    (tmp_path / "shaping.py").write_text("def length(prompt, completion, sample):\n    return float(len(completion))\n")
    result = run_cli(
        "train",
        str(REPO / config),
        *ARGS,
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        f"trainer.run_name={name}",
        *extra,
        cwd=tmp_path,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r], result.stderr


def test_an_agent_trains_through_the_endpoint_the_same_on_1_and_2_ranks(tmp_path, cache_dir):
    one, stderr = _train(tmp_path, cache_dir, "one")
    two, _ = _train(tmp_path, cache_dir, "two", "--nproc", "2")
    assert [r["step"] for r in one] == [1, 2]
    first = one[0]
    assert first["agent/model_calls"] == 1.0 and first["response/length"] > 0
    # The sampled tokens and their log-probs are what the trainer recomputes (float32, the same model).
    assert first["mismatch/logp_abs_diff_max"] <= 1e-5
    # A raising agent scores env.default_reward, is counted, and is named once per step; nothing hangs.
    assert first["agent/agent_errors"] > 0 and "agent episode(s) failed; first: uid" in stderr
    assert "a tool this agent needed was down" in stderr
    same = ("reward/mean", "response/length", "agent/agent_errors", "tokens/generated", "agent/score")
    assert {k: two[0][k] for k in same} == {k: first[k] for k in same}  # the same samples at 2 ranks


HOSTILE = '''
import threading
import time

import openai


def hostile(client: openai.OpenAI, sample: dict):
    """What the sample's answer picks: never calls the model; calls it 1,000 times; sends a malformed
    request; calls once, then keeps calling after it returned."""
    kind = int(sample["answer"]) % 4
    ask = dict(model="distflow-policy", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=4)
    if kind == 0:
        return 1.0
    if kind == 1:
        for _ in range(1000):
            client.chat.completions.create(**ask)
    if kind == 2:
        client.chat.completions.create(model="distflow-policy", messages=[], max_tokens=4)
    client.chat.completions.create(**ask)

    def later():
        time.sleep(0.2)
        try:
            client.chat.completions.create(**ask)
        except Exception as err:  # refused (410, 404) or the episode's client already closed
            print(f"late request refused: {type(err).__name__}", flush=True)

    threading.Thread(target=later, daemon=True).start()
    return None
'''


@pytest.mark.slow  # about 50-100 s on 2 cores: CI runs it, the default suite keeps to its budget
def test_hostile_agents_are_counted_and_nothing_hangs(tmp_path, cache_dir):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    records, stderr = _train(
        tmp_path, cache_dir, "hostile", "rollout.agent=hostile:hostile", "trainer.prompts_per_step=8"
    )
    counts = {key: sum(r[f"agent/{key}"] for r in records) for key in ("no_model_calls", "over_cap_requests")}
    counts["malformed_requests"] = sum(r["agent/malformed_requests"] for r in records)
    counts["agent_errors"] = sum(r["agent/agent_errors"] for r in records)
    assert counts["no_model_calls"] > 0  # scores env.default_reward, not the 1.0 it returned
    assert counts["over_cap_requests"] > 0 and counts["malformed_requests"] > 0
    assert counts["agent_errors"] > 0 and "agent episode(s) failed; first: uid" in stderr


HUGE = '''
def huge(client, sample):
    """Returns 10**400 (no float holds it) as its score, or beside a score, or a number that fits."""
    ask = [{"role": "user", "content": sample["prompt"]}]
    client.chat.completions.create(model="distflow-policy", messages=ask, max_tokens=4)
    kind = int(sample["answer"]) % 3
    return 10**400 if kind == 0 else {"score": 1.0, "digits": 10**400 if kind == 1 else 3}
'''


@pytest.mark.slow  # ~30 s: CI runs it (the default suite trains an agent above)
def test_numbers_no_float_holds_score_the_default_and_are_counted(tmp_path, cache_dir):
    """10**400 as the score or as another number of the agent's dict: `env.default_reward`, counted in
    `agent/bad_rewards`, at the evaluations and in training; the run does not end in an OverflowError."""
    (tmp_path / "huge.py").write_text(HUGE)
    records, stderr = _train(tmp_path, cache_dir, "huge", "rollout.agent=huge:huge", "trainer.prompts_per_step=8")
    assert "OverflowError" not in stderr
    assert sum(r["agent/bad_rewards"] for r in records) > 0
    evaluated = [json.loads(line) for line in (tmp_path / "huge/metrics.jsonl").read_text().splitlines()]
    assert [r["eval/agent/bad_rewards"] > 0 for r in evaluated if "eval/accuracy" in r] == [True, True]
    assert all(r["agent/digits"] == 3.0 for r in records)  # the numbers that fit are logged


OWN_SCORE = '''
def solve(client, sample):
    """Calls the model, and says it solved a quarter of the row, whatever the reply (the verifier
    would judge the reply on its own)."""
    ask = [{"role": "user", "content": sample["prompt"]}]
    client.chat.completions.create(model="distflow-policy", messages=ask, max_tokens=4)
    return {"score": 0.25, "looked_up": 2}


def nothing(prompt, completion, sample):
    return 0.0
'''


@pytest.mark.heavy  # ~40 s on 2 cores: `make test-heavy` (held-out evaluation: tests/test_evaluation_groups.py)
def test_held_out_episodes_are_scored_by_the_agent_and_evaluation_turns_off(tmp_path, cache_dir):
    """An agent run's evaluation is its episodes' reward (the agent's score plus the task's rewards, here
    0), its agent/* numbers under eval/; `trainer.evaluate=false` evaluates at no step."""
    (tmp_path / "own.py").write_text(OWN_SCORE)
    own = ["rollout.agent=own:solve", "task.rewards=[{fn: 'own:nothing'}]"]
    _train(tmp_path, cache_dir, "scored", *own)
    records = [json.loads(line) for line in (tmp_path / "scored/metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [0, 2]
    for record in evaluated:
        assert record["eval/accuracy"] == record["eval/greedy_accuracy"] == 0.25
        assert record["eval/agent/looked_up"] == 2.0 and record["eval/agent/model_calls"] == 1.0
        assert record["eval/agent/agent_errors"] == 0.0
    result_off = run_cli(
        "train",
        str(REPO / "examples/arith_grpo.yaml"),
        *ARGS,
        *own,
        "trainer.evaluate=false",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=no-eval",
        cwd=tmp_path,
    )
    assert result_off.returncode == 0, result_off.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "no-eval/metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("eval/") for r in records for key in r)
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    summary = json.loads(result_off.stdout.strip().splitlines()[-1])
    assert summary["final_accuracy"] is None and summary["steps"] == 2


@pytest.mark.slow  # two example runs, ~100 s on 2 cores: CI runs it, the default suite keeps to its budget
def test_the_calculator_agent_examples_train_and_make_the_same_episodes(tmp_path, cache_dir):
    """examples/agents: the plain `openai` client and the Agents SDK offer the `calculator` tool; the
    model's calls of it (the embedded model's "=" convention) are run, and the tool-call turns train with
    the log-probs they were sampled with. Both agents make the same requests, so the same samples."""
    import shutil

    pytest.importorskip("agents", reason="the Agents SDK: pip install openai-agents")
    for code in (REPO / "examples/agents").glob("*.py"):
        shutil.copy(code, tmp_path)
    steps = {}
    for agent in ("calculator_agent", "calculator_agents_sdk"):
        _train(  # the untrained model: it ends a reply with "=" (a tool call) now and then
            tmp_path,
            cache_dir,
            agent,
            "trainer.prompts_per_step=8",
            f"rollout.agent={agent}:solve",
            config="examples/agents/calculator.yaml",
        )
        records = [json.loads(line) for line in (tmp_path / agent / "metrics.jsonl").read_text().splitlines()]
        steps[agent] = [
            {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in records if "step" in r
        ]
    trained = [r for r in steps["calculator_agent"] if "reward/mean" in r]
    assert len(trained) == 2 and sum(r["agent/tool_calls"] for r in trained) > 0
    assert all(r["agent/agent_errors"] == 0 and r["mismatch/logp_abs_diff_max"] <= 1e-5 for r in trained)
    # The same samples: what describes them is equal; the losses agree to float rounding, since the
    # sampling-time log-probs round as the endpoint happened to batch the concurrent requests.
    exact = ("agent/", "reward/", "response/", "tokens/", "accuracy", "eval/", "step")
    for one, sdk in zip(steps["calculator_agent"], steps["calculator_agents_sdk"], strict=True):
        assert one.keys() == sdk.keys()
        assert {k: v for k, v in one.items() if k.startswith(exact)} == {k: sdk[k] for k in one if k.startswith(exact)}
        for key in one.keys() - {k for k in one if k.startswith((*exact, "mismatch/"))}:
            assert one[key] == pytest.approx(sdk[key], rel=1e-4, abs=1e-6), key


@pytest.mark.heavy  # three launches, ~90 s: `make test-heavy` (CI resumes async runs after kill -9: test_async.py)
def test_kill_9_then_resume_reproduces_an_agent_run(tmp_path, cache_dir):
    """An agent run killed at step 3 on one of 2 ranks and resumed on 1 rank samples what the
    uninterrupted run sampled, step for step (the episodes' keys derive from the samples' uids)."""
    from resume_common import assert_same_run, samples, train
    from test_e2e import read_metrics

    agent = ["rollout.agent=adder:solve", "trainer.run_name=run"]
    runs = {}
    for name, extra, env in [
        ("whole", [], None),
        ("first", ["--nproc", "2"], {"KILL_AT_STEP": "3", "KILL_RANK": "1"}),
        ("second", ["--resume"], None),
    ]:
        cwd = tmp_path / name
        cwd.mkdir()
        (cwd / "adder.py").write_text(AGENT.replace("raise RuntimeError", "return 0.0  #"))
        out = tmp_path / ("whole-out" if name == "whole" else "out")
        runs[name] = train(cwd, out, cache_dir, *agent, *extra, env=env)
    assert runs["whole"].returncode == 0, runs["whole"].stderr[-3000:]
    assert runs["first"].returncode != 0 and "killed by SIGKILL" in runs["first"].stderr
    assert runs["second"].returncode == 0, runs["second"].stderr[-3000:]
    assert json.loads(runs["second"].stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    whole = {"metrics": read_metrics(tmp_path / "whole-out/run"), "samples": samples(tmp_path / "whole")}
    got = {**samples(tmp_path / "first"), **samples(tmp_path / "second")}
    assert_same_run(got, read_metrics(tmp_path / "out/run"), whole, steps=(1, 2, 3, 4))


@pytest.mark.slow  # ~40 s: CI runs it (the default suite trains an agent above)
def test_the_tool_warm_start_shows_a_bar_and_the_held_out_count_does_not_key_it(tmp_path):
    """The calculator agent's warm-start (tool transcripts) shows a bar with its steps and an estimate; held-out
    counts up to 500 share one warm-start, none of whose training problems is held out."""
    import re

    from distflow.config.loader import load_config
    from distflow.tasks.arithmetic import ArithmeticTask
    from distflow.tasks.embedded import cache_key, warmstart_task
    from distflow.tasks.tokenizer import build_char_tokenizer

    shots = {}
    for heldout in (40, 500, 1000):
        config = load_config(REPO / "examples/agents/calculator.yaml", [f"task.num_heldout={heldout}"])
        task, run_task = warmstart_task(config, build_char_tokenizer()), config.task
        shots[heldout] = cache_key(config), task.train.ids
        split = ArithmeticTask.build(
            num_digits=run_task.num_digits, num_heldout=heldout, seed=0, num_operands=run_task.num_operands
        )
        held_out = set(split.heldout.ids)
        assert held_out.isdisjoint(task.train.ids)
    assert shots[40] == shots[500] and shots[500][0] != shots[1000][0]
    (tmp_path / "calculator_agent.py").write_text((REPO / "examples/agents/calculator_agent.py").read_text())
    result = run_cli(
        "train",
        str(REPO / "examples/agents/calculator.yaml"),
        "trainer.progress_bar=true",
        "warmstart.max_steps=20",
        "warmstart.check_every=10",
        "warmstart.num_validation=20",
        "warmstart.target_accuracy=0.99",  # not reached in 20 steps: the run ends after the bar, exit 2
        f"warmstart.cache_dir={tmp_path / 'cache'}",
        f"trainer.output_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "at most warmstart.max_steps=20 steps" in result.stderr
    assert "warm-start: 100%" in result.stderr and "20/20 [" in result.stderr  # steps, elapsed<estimate
    assert re.search(r"validation accuracy \d\.\d{3} of 0\.99", result.stderr)

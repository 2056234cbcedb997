"""Multi-turn rollouts: the token layout of a trajectory, containment of failing
environments, the calculator and the sandboxed Python tool (no model: a scripted policy)."""

import os
import sys
import time

import pytest

from distflow.envs.calculator import CalculatorError, calculate
from distflow.envs.python_tool import run_python
from distflow.envs.tools import CalculatorEnv
from distflow.rollout.multiturn import Trajectory, TurnLimits, reset_all, roll_out
from distflow.tasks.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def scripted(turns: dict[int, list[str]]):
    """A policy that says turns[uid][turn] (then EOS), each token with log-prob -(position+1)/10."""
    calls = []

    def generate_turn(running, turn, width):
        calls.append((turn, width, [t.uid for t in running]))
        out = [ids(turns[t.uid][turn]) + [EOS] for t in running]
        return out, [[-(k + 1) / 10 for k in range(len(o))] for o in out]

    return generate_turn, calls


def run(envs, turns, *, max_turns=3, max_tokens=32, deadline_s=60.0, default_reward=-1.0):
    trajs = [Trajectory(sample={}, env=env, env_seconds=deadline_s, uid=u) for u, env in enumerate(envs)]
    limits = TurnLimits(max_turns, max_tokens, default_reward, num_workers=4)
    reset_all(trajs, TOK, [ids("1+2+3=")] * len(trajs), limits)
    generate_turn, calls = scripted(turns)
    roll_out(trajs, tokenizer=TOK, limits=limits, generate_turn=generate_turn, agree=lambda *v: v)
    return trajs, calls


def test_tool_trajectory_layout():
    """Model tokens kept as sampled (mask 1, their log-probs), observation tokens between
    them (mask 0, log-prob 0), the answer last."""
    (traj,), calls = run([CalculatorEnv()], {0: ["1+2=", "3+3=", "6"]})
    assert traj.ids == ids("1+2=") + [EOS] + ids("3") + ids("3+3=") + [EOS] + ids("6") + ids("6") + [EOS]
    assert traj.mask == [1] * 5 + [0] + [1] * 5 + [0] + [1] * 2
    assert traj.logp == [-0.1, -0.2, -0.3, -0.4, -0.5, 0.0, -0.1, -0.2, -0.3, -0.4, -0.5, 0.0, -0.1, -0.2]
    assert traj.actions == ["1+2=", "3+3=", "6"]
    assert (traj.tool_calls, traj.errors, traj.timeouts, traj.done) == (2, 0, 0, True)
    # every turn pads to the widest running sequence: the prompt (6 ids), then +6, then +6
    assert [c[1] for c in calls] == [6, 12, 18]


class Scored:
    """Reward 0.5 for every call, 2.0 for the answer."""

    def reset(self, sample):
        return None

    def step(self, action):
        done = not action.endswith("=")
        return (None if done else "0"), (2.0 if done else 0.5), done, {}


def test_turn_rewards_on_last_token_of_their_turn():
    (traj,), _ = run([Scored()], {0: ["1=", "2"]})
    # "1=" EOS | "0" | "2" EOS
    assert traj.reward == [0.0, 0.0, 0.5, 0.0, 0.0, 2.0]


def test_budget_truncates_and_turn_limit_ends():
    (cut,), _ = run([CalculatorEnv()], {0: ["1+2=", "3+3="]}, max_tokens=7)
    assert len(cut.ids) == 7 and cut.truncated and cut.done  # 5 model, 1 observation, 1 model: then no room
    assert cut.mask == [1, 1, 1, 1, 1, 0, 1]
    (capped,), calls = run([CalculatorEnv()], {0: ["1=", "1=", "1=", "1="]}, max_turns=2)
    assert len(capped.actions) == 2 and len(calls) == 2 and capped.done and not capped.truncated


class Failing:
    def __init__(self, how):
        self.how = how

    def reset(self, sample):
        return None

    def step(self, action):
        if self.how == "raise":
            raise RuntimeError("tool crashed")
        if self.how == "exit":
            sys.exit(3)
        if self.how == "hang":
            while True:
                time.sleep(1)
        if self.how == "garbage":
            return "not a tuple"
        return "9" * 50_000_000, 0.0, False, {"tool_call": True}  # flood


def test_failing_environments_are_contained_counted_and_scored():
    """A raising, exiting, hanging, malformed or flooding environment ends its own
    trajectory (scored the default reward where it failed); the others carry on."""
    envs = [Failing("raise"), Failing("exit"), Failing("hang"), Failing("garbage"), Failing("flood"), CalculatorEnv()]
    turns = {u: ["1=", "2"] for u in range(6)}
    trajs, _ = run(envs, turns, max_tokens=16, deadline_s=3.0)
    raised, exited, hung, garbage, flood, fine = trajs
    for traj in (raised, exited, garbage):
        assert (traj.errors, traj.timeouts, traj.done) == (1, 0, True)
        assert traj.reward == [0.0, 0.0, -1.0]  # the default reward on the failed turn's last token
    assert (hung.errors, hung.timeouts, hung.reward) == (0, 1, [0.0, 0.0, -1.0])
    # the flood is an observation like any other: cut at the token budget
    assert len(flood.ids) == 16 and flood.truncated and flood.mask == [1, 1, 1] + [0] * 13
    assert fine.actions == ["1=", "2"] and fine.errors == fine.timeouts == 0


def test_calculator():
    assert calculate("12+34+56") == 102
    assert calculate("(2+3)*4-6//4") == 19
    for bad in ("__import__('os').system('true')", "2**100", "1/0", "x+1", "9" * 20):
        with pytest.raises(CalculatorError):
            calculate(bad)
    env = CalculatorEnv()
    assert env.step("12+34=") == ("46", 0.0, False, {"tool_call": True})
    assert env.step("1+a=") == ("()", 0.0, False, {"tool_call": True, "tool_error": True})
    assert env.step(" 46 ") == (None, 0.0, True, {})


def test_python_sandbox(tmp_path):
    assert run_python("print(6*7)").output == "42\n"
    outside = tmp_path / "escaped.txt"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')")
    assert result.returncode != 0 and "sandbox" in result.output and not outside.exists()
    assert run_python("open('inside.txt', 'w').write('x'); print(open('inside.txt').read())").output == "x\n"
    net = run_python("import socket; socket.create_connection(('127.0.0.1', 9))")
    assert net.returncode != 0 and "no network" in net.output
    assert run_python("import time; time.sleep(60)", wall_s=1).timed_out
    assert run_python("while True: pass", cpu_s=1, wall_s=30).returncode == -9  # SIGKILL at the CPU limit
    flood = run_python("print('x' * 50_000_000)", max_output=100)
    assert flood.truncated and len(flood.output) == 100
    assert run_python("import os; os._exit(7)").returncode == 7
    assert run_python("import subprocess; subprocess.run(['true'])").returncode != 0
    assert os.getcwd() != "/"


def test_python_env_runs_code_blocks_and_reports_failures():
    from distflow.envs.tools import PythonEnv

    env = PythonEnv(wall_s=5)
    observation, reward, done, info = env.step("Let me compute.\n```python\nprint(sum(range(10)))\n```")
    assert observation == "\n```output\n45\n\n```\n" and (reward, done, info) == (
        0.0,
        False,
        {"tool_call": True, "tool_error": False},
    )
    observation, _, _, info = env.step("```python\nraise ValueError('no')\n```")
    assert "ValueError: no" in observation and info["tool_error"]
    assert PythonEnv(chat=True).step("```python\nprint(1)\n```")[0] == [{"role": "tool", "content": "1\n"}]
    assert env.step("The answer is 45.") == (None, 0.0, True, {})


def test_model_tokens_are_kept_as_sampled_not_re_encoded():
    """A turn whose ids do not survive decode → encode (a special token mid-action) is
    trained on as sampled; only the environment sees the decoded text."""
    sampled = [TOK.unk_token_id, *ids("4"), TOK.bos_token_id, *ids("="), EOS]
    traj = Trajectory(sample={}, env=CalculatorEnv(), env_seconds=60.0, uid=0)
    limits = TurnLimits(2, 32, 0.0, num_workers=1)
    reset_all([traj], TOK, [ids("1+3=")], limits)
    turns = iter([sampled, ids("4") + [EOS]])
    roll_out(
        [traj],
        tokenizer=TOK,
        limits=limits,
        agree=lambda *v: v,
        generate_turn=lambda running, turn, width: ([new := next(turns)], [[0.0] * len(new)]),
    )
    assert traj.actions[0] == "4=" and TOK(traj.actions[0], add_special_tokens=False)["input_ids"] != sampled[:-1]
    assert traj.ids[:5] == sampled and traj.ids[5:6] == ids("4")  # the calculator's "4", then the answer


def test_calls_keep_their_order_and_bound_threads():
    """Outcomes come back in the calls' order; a hung call times out alone; at most
    num_workers threads run them."""
    import threading

    from distflow.envs.calls import run_calls

    seen = set()

    def call(k):
        seen.add(threading.current_thread().name)
        if k == 1:
            threading.Event().wait()  # hangs forever
        if k == 2:
            raise KeyError(k)
        return k * 10

    outcomes = run_calls([(lambda k=k: call(k), 2.0) for k in range(6)], num_workers=2)
    assert [o.value for o in outcomes] == [0, None, None, 30, 40, 50]
    assert outcomes[1].timed_out and isinstance(outcomes[2].error, KeyError)
    assert len(seen) <= 2


def test_chat_observations_render_as_the_templates_continuation():
    """A template that opens every rendering with a default system prompt: the first
    observation gets it, later ones only what the template adds for the new message."""
    from transformers import PreTrainedTokenizerFast

    from distflow.rollout.multiturn import encode_observation

    tok = PreTrainedTokenizerFast(tokenizer_object=TOK.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}0={% endif %}"
        "{% for m in messages %}({{ m['content'] }}){% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    message = [{"role": "tool", "content": "42"}]
    assert tok.decode(encode_observation(tok, message, first=True), skip_special_tokens=True) == "0=(42)="
    assert tok.decode(encode_observation(tok, message, first=False)) == "(42)="


def test_tool_example_builds_a_multiturn_pipeline():
    from conftest import REPO

    from distflow.config import load_config
    from distflow.dag.multiturn_stage import env_rollout
    from distflow.dag.pipelines import build_graph

    config = load_config(REPO / "examples/arith_tool_grpo.yaml")
    rollout = build_graph(config).stages["rollout"]
    assert rollout.fn is env_rollout and {"rollout_logp", "turn_reward"} <= set(rollout.writes)
    assert (config.task.num_operands, config.env.cls) == (3, "distflow.envs.tools:CalculatorEnv")

"""tests/forked_cli.py, which runs conftest.run_cli's commands forked from a process that has imported
torch and distflow: what a run sees and gives back is what a new `python -m distflow` sees and gives."""

import json
import os
import subprocess
import sys
from pathlib import Path

import forked_cli
import pytest
from conftest import REPO

PROBE = """
import json, os, sys
from pathlib import Path

Path(os.environ["PROBE_OUT"]).write_text(json.dumps({
    "cwd": os.getcwd(), "argv": sys.argv[1:], "path0": sys.path[0], "probe_var": os.environ.get("PROBE_VAR"),
    "unbuffered": os.environ.get("PYTHONUNBUFFERED"), "file": __file__,
}))
raise RuntimeError("the probe has written what it saw")  # the run ends in its checks: one line, exit 2
"""


def fresh(args, *, cwd, env, timeout):
    """The command run by a new interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "distflow", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def both(args, *, cwd, env):
    """The command run by a new interpreter, then by the fork server: (fresh, forked) CompletedProcess."""
    return fresh(args, cwd=cwd, env=env, timeout=1800), forked_cli.run(args, cwd=cwd, env=env, timeout=1800)


def train_with(module: str, out) -> list[str]:
    """A run whose custom stage is in `module`: its checks import it before anything else is done."""
    stage = f"{{name: probe, fn: '{module}:record', after: [reward], before: [advantage], reads: [uid]}}"
    config = str(REPO / "examples/arith_grpo.yaml")
    return ["train", config, f"trainer.output_dir={out}", f"pipeline.custom_stages=[{stage}]"]


@pytest.mark.parametrize("where", ["working directory", "PYTHONPATH"])
def test_a_forked_run_imports_the_users_module_with_the_cwd_argv_and_environment_a_new_one_has(tmp_path, where):
    home = tmp_path / ("cwd" if where == "working directory" else "lib")
    home.mkdir()
    (home / "probe_user_mod.py").write_text(PROBE)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    env = dict(os.environ, PROBE_VAR="set by the test", PYTHONUNBUFFERED="1", PROBE_OUT=str(tmp_path / "probe.json"))
    if where == "PYTHONPATH":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(home), os.environ.get("PYTHONPATH")]))
    seen = []
    for run in (fresh, forked_cli.run):
        result = run(train_with("probe_user_mod", tmp_path / "runs"), cwd=cwd, env=env, timeout=1800)
        assert result.returncode == 2 and "the probe has written what it saw" in result.stderr, result.stderr
        seen.append(((tmp_path / "probe.json").read_text(), result.stdout, result.stderr))
        (tmp_path / "probe.json").unlink()
    assert seen[0] == seen[1]  # the module saw the same; the command printed the same
    probe = json.loads(seen[0][0])
    assert probe["cwd"] == str(cwd) and probe["path0"] == str(cwd) and probe["probe_var"] == "set by the test"
    assert probe["file"] == str(home / "probe_user_mod.py") and probe["argv"][0] == "train"
    assert probe["unbuffered"] == "1"


def test_a_forked_run_fails_on_bad_input_with_the_same_line_and_exit_code(tmp_path):
    fresh, forked = both(["train", "nope.yaml"], cwd=tmp_path, env=dict(os.environ))
    assert fresh.returncode == forked.returncode == 2
    assert fresh.stderr == forked.stderr and "config file 'nope.yaml' does not exist" in forked.stderr
    fresh, forked = both(["train", "--help"], cwd=tmp_path, env=dict(os.environ))
    assert fresh.returncode == forked.returncode == 0 and fresh.stdout == forked.stdout != ""


KILL_AFTER_S = 10
"""The timeout under test (not a guard against a hang): the run sleeps far longer."""

SLOW = """
import os, time
open(os.environ["PID_OUT"] + ".tmp", "w").write(str(os.getpid()))
os.replace(os.environ["PID_OUT"] + ".tmp", os.environ["PID_OUT"])
time.sleep(3600)
"""


def test_a_forked_run_past_its_timeout_is_killed(tmp_path):
    (tmp_path / "slow_user_mod.py").write_text(SLOW)
    env = dict(os.environ, PID_OUT=str(tmp_path / "pid"))
    with pytest.raises(subprocess.TimeoutExpired):
        forked_cli.run(train_with("slow_user_mod", tmp_path / "runs"), cwd=tmp_path, env=env, timeout=KILL_AFTER_S)
    if not (tmp_path / "pid").exists():  # a loaded machine: killed before its checks imported the module
        return
    pid = int((tmp_path / "pid").read_text())
    # run() raises once the runner's monitor has reaped it: its pid is gone, or taken by a process that is
    # not a fork of this server (whose command line names the server's socket)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return
    assert forked_cli.server().address not in cmdline, f"the runner {pid} outlived its timeout"

"""Third-party import noise stays out of the log: reasoning-gym's `cellpylib` dependency
compiles with `SyntaxWarning: "is" with a literal` lines, which every rank and evaluation
worker would print once; distflow imports reasoning-gym with those warnings filtered."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")


def test_importing_reasoning_gym_through_distflow_prints_no_syntax_warnings(tmp_path):
    # No cached bytecode (none written, none read from an empty prefix): cellpylib is compiled
    # afresh, which is when its SyntaxWarnings are emitted.
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path))
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(
        [sys.executable, "-c", "from distflow.tasks.reasoning_gym import import_gym; import_gym()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SyntaxWarning" not in done.stderr, done.stderr[-3000:]


def test_the_filter_is_narrow_other_code_still_warns(tmp_path):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path))
    env.pop("PYTHONWARNINGS", None)
    code = "from distflow.tasks.reasoning_gym import import_gym; import_gym(); compile('x is 1', 'mine.py', 'exec')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("SyntaxWarning") == 1 and "mine.py" in done.stderr, done.stderr[-3000:]

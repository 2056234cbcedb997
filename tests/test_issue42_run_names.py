"""A run name that matplotlib's default font cannot draw (Chinese, an emoji, Devanagari) still
gives curves.png and `distflow report` without missing-glyph warnings in the log."""

import gc
import json
import logging
import warnings

import pytest
from conftest import run_cli

from distflow.observability.curves import draw, read_run

NAMES = ["训练-🚀", "प्रशिक्षण-run"]


def _run(root, name):
    run = root / name
    run.mkdir()
    records = [{"step": 0, "eval/accuracy": 0.1}] + [
        {"step": s, "reward/mean": 0.1 * s, "time/step_s": 1.0, "time/rollout_s": 0.5} for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return run


@pytest.mark.parametrize("names", [NAMES[:1], NAMES])  # one run: curves.png; two: overlaid, with a legend
def test_curves_of_a_run_whose_name_the_font_lacks_warn_nothing(tmp_path, caplog, names):
    runs = {name: read_run(_run(tmp_path, name)) for name in names}
    gc.collect()  # an earlier test's garbage warns when collected; only this call's warnings count
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="matplotlib"):
        warnings.simplefilter("always")
        out = draw(runs, tmp_path / "curves.png")
    assert out.is_file()
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_report_of_such_runs_prints_no_glyph_warning(tmp_path):
    runs = [str(_run(tmp_path, name)) for name in NAMES]
    done = run_cli("report", *runs, "--out", str(tmp_path / "r.png"), cwd=tmp_path, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Glyph" not in done.stderr and "warn" not in done.stderr.lower(), done.stderr[-3000:]
    assert NAMES[0] in done.stdout  # the table keeps the name as it is

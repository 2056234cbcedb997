"""A torn last line of metrics.jsonl whose step the checkpoint covers: `--resume` does not redo
that step, so its metrics are lost. The run says so in one line naming the step, and the record
keeps a {"step": N, "metrics_lost": true} line in its place, which curves and reports read.
"""

import json

from conftest import run_cli
from resume_common import train
from test_e2e import read_metrics

from distflow.observability.writer import drop_records_after

LOST = "warning: step 2's metrics were lost: "


def test_a_torn_line_of_a_checkpointed_step_is_named_and_marked_on_resume(tmp_path, cache_dir):
    # Killed during step 3, before logging it: metrics.jsonl holds steps 0-2, the checkpoint is step 2.
    killed = train(tmp_path / "first", tmp_path, cache_dir, "trainer.run_name=run", env={"KILL_AT_STEP": "3"})
    assert killed.returncode != 0
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2
    path.write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1][: len(lines[-1]) // 2])

    resumed = train(tmp_path / "second", tmp_path, cache_dir, "trainer.run_name=run", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    said = [line for line in resumed.stderr.splitlines() if "metrics were lost" in line]
    assert len(said) == 1 and said[0].startswith(LOST), resumed.stderr[-3000:]
    assert str(path) in said[0]
    metrics = read_metrics(tmp_path / "run")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert metrics[2] == {"step": 2, "metrics_lost": True}
    assert "reward/mean" in metrics[3]
    assert (tmp_path / "run" / "curves.png").is_file() and "curves.png was not drawn" not in resumed.stderr
    report = run_cli("report", str(tmp_path / "run"), "--out", str(tmp_path / "report.png"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]


def _write(path, records, torn):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_a_torn_line_without_a_step_is_the_step_after_the_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0}, {"step": 1}], '{"st')
    assert drop_records_after(path, 2) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 0},
        {"step": 1},
        {"step": 2, "metrics_lost": True},
    ]


def test_a_torn_line_of_a_step_that_is_redone_is_dropped_quietly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0}, {"step": 1}, {"step": 2}], '{"step": 3, "reward/mean": 0.1')
    assert drop_records_after(path, 2) is None
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    # A cut step number ("1" of "12") is not read as a step: the one after the last record is.
    _write(path, [{"step": 10}, {"step": 11}], '{"step": 1')
    assert drop_records_after(path, 11) is None

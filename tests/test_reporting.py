"""curves.png, `distflow report` and the Weights & Biases logger (offline), through the real CLI."""

import glob
import json
import struct

import pytest
from conftest import REPO, run_cli

from distflow.cli import main
from distflow.observability.curves import stage_times, summary_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


def _fake_run(root, name, rewards, accuracies):
    run = root / name
    run.mkdir()
    records = [{"step": 0, "eval/accuracy": accuracies[0]}]
    for step, reward in enumerate(rewards, 1):
        records.append(
            {
                "step": step,
                "reward/mean": reward,
                "response/length": 3.0 + step,
                "train/kl": 0.01 * step,
                "train/entropy": 1.0,
                "train/grad_norm": 0.5,
                "time/step_s": 1.0 + step,
                "time/rollout_s": 0.25 * step,
                "time/policy_update_s": 0.5,
                "time/loader_wait_s": 0.0,
            }
        )
    records[-1]["eval/accuracy"] = accuracies[1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_report_overlays_runs_and_prints_their_summary(tmp_path, capsys):
    a = _fake_run(tmp_path, "a", [0.0] * 5 + [1.0] * 5, (0.2, 0.6))
    b = _fake_run(tmp_path, "b", [0.5] * 10, (0.3, 0.4))
    out = tmp_path / "both.png"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert _png_size(out) == (1440, 960)  # 18 x 12 inches at 80 dpi
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "run",
        "steps",
        "accuracy_first",
        "accuracy_last",
        "reward_first",
        "reward_last",
        "step_s_median",
    ]
    # Run a: steps 1-10, reward mean of the first tenth 0, of the last tenth 1; median step time over
    # steps 2-10 (the first left out) = 7 s.
    assert table[1].split() == ["a", "10", "0.2", "0.6", "0", "1", "7"]
    assert table[2].split() == ["b", "10", "0.3", "0.4", "0.5", "0.5", "7"]


def test_stage_split_is_the_median_per_stage_without_the_first_step(tmp_path):
    from distflow.observability.curves import read_run

    records = read_run(_fake_run(tmp_path, "a", [0.0] * 5, (0.1, 0.2)))
    assert stage_times(records) == {"rollout": 0.25 * 3.5, "policy_update": 0.5}  # steps 2-5: 0.5 .. 1.25
    assert summary_rows({"a": records})[0]["steps"] == 5


def test_report_of_a_directory_without_metrics_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def _history_steps(run_dir) -> list[tuple[str, int, dict]]:
    """(run id, step, metrics) of every history record in the W&B offline files of `run_dir`."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        run_id = path.rsplit("run-", 1)[1].removesuffix(".wandb")
        data, pos, pending = open(path, "rb").read(), 7, b""  # header ":W&B" + magic + version
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):  # LevelDB log format: 32 KiB blocks of (crc, length, type) records
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pending += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                    found.append((run_id, record.history.step.num, items))
    return found


def test_wandb_offline_run_has_every_step_once_across_a_resume(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = [
        "trainer.prompts_per_step=4",
        "rollout.num_samples=4",
        "trainer.eval_every=0",
        "trainer.eval_samples=1",
        "task.num_heldout=20",
        "trainer.progress_bar=false",
        "warmstart.target_accuracy=0",
        f"warmstart.cache_dir={cache_dir}",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run",
        "trainer.loggers=[jsonl,wandb]",
        "checkpoint.every=2",
    ]
    config = str(REPO / "examples/arith_grpo.yaml")
    first = run_cli("train", config, *common, "trainer.total_steps=3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert _png_size(run_dir / "curves.png") == (1440, 960)
    # Resume from step 2: step 3 is redone (W&B already has it: not sent again), step 4 is new.
    second = run_cli(
        "train",
        config,
        *common,
        "trainer.total_steps=4",
        "--resume",
        str(run_dir / "checkpoints" / "step-000002"),
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    history = _history_steps(run_dir)
    run_ids = {run_id for run_id, _, _ in history}
    assert len(run_ids) == 1 and run_ids == {json.loads((run_dir / "wandb.json").read_text())["id"]}
    steps = [step for _, step, _ in history]
    assert sorted(steps) == [0, 1, 2, 3, 4]  # every step once: 0 (evaluation before training) .. 4
    logged = {
        json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    }
    # W&B holds step 3 from the first run, metrics.jsonl from the resumed one: a resumed run reproduces
    # the step, so the values agree (timings aside).
    compared = set()
    for _, step, items in history:
        for key in ("reward/mean", "train/grad_norm", "eval/accuracy"):
            if logged[step].get(key) is not None:
                assert items[key] == pytest.approx(logged[step][key], rel=1e-5), (step, key)
                compared.add((step, key))
    assert {(step, "reward/mean") for step in (1, 2, 3, 4)} <= compared and (0, "eval/accuracy") in compared


def test_wandb_logger_without_the_package_is_a_user_error_before_launch(monkeypatch):
    import importlib.util

    from distflow import preflight
    from distflow.config import ConfigError
    from distflow.config.loader import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'distflow\[wandb\]'"):
        preflight.check_loggers(load_config(None, ["trainer.loggers=[jsonl,wandb]"]))
    preflight.check_loggers(load_config(None, []))  # the default loggers need nothing extra


@pytest.mark.parametrize(
    "out, needle",
    [
        (
            "{tmp}/missing/report.png",
            "--out '{tmp}/missing/report.png': the directory '{tmp}/missing' does not exist; "
            "create it, or choose a path in an existing directory",
        ),
        (
            "{tmp}/report.txt",
            "--out '{tmp}/report.txt': '.txt' is not a picture format; end the name with .png (or one "
            "of .avif, .eps, .gif, .jpeg, .jpg, .pdf, .pgf, .ps, .raw, .rgba, .svg, .svgz, .tif, .tiff, "
            ".webp)",
        ),
    ],
    ids=["missing directory", "not a picture format"],
)
def test_report_out_that_cannot_be_written_is_one_line(tmp_path, out, needle):
    run = _fake_run(tmp_path, "a", [0.5] * 3, (0.1, 0.2))
    result = run_cli("report", str(run), "--out", out.replace("{tmp}", str(tmp_path)), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"distflow: error: {needle.replace('{tmp}', str(tmp_path))}"]
    assert result.stdout == ""  # refused before the runs are read: no table either


@pytest.mark.parametrize(
    "out, written",
    [
        ("{tmp}/pictures", "{tmp}/pictures/report.png"),  # an existing directory: a picture inside it
        ("{tmp}/curves", "{tmp}/curves.png"),  # no extension: the .png that matplotlib adds, named
        ("{tmp}/curves.svg", "{tmp}/curves.svg"),
    ],
    ids=["directory", "no extension", "svg"],
)
def test_report_prints_the_path_it_writes(tmp_path, capsys, out, written):
    run = _fake_run(tmp_path, "a", [0.5] * 3, (0.1, 0.2))
    (tmp_path / "pictures").mkdir()
    out, written = out.replace("{tmp}", str(tmp_path)), written.replace("{tmp}", str(tmp_path))
    assert main(["report", str(run), "--out", out]) == 0
    assert capsys.readouterr().err.strip() == f"curves of 1 run(s) -> {written}"
    assert sorted(str(p) for p in tmp_path.rglob("*") if p.suffix in (".png", ".svg")) == [written]


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"step": 0}\n{"step": 1, "reward/mean": 0.\n{"step": 2}\n', "metrics.jsonl: line 2 is not a metrics record"),
        (b'{"step": 0}\n\xff\xfe\x00\n', "metrics.jsonl is not UTF-8 text (invalid start byte at byte 12)"),
        (b'[1, 2]\n{"step": 1}\n', "metrics.jsonl: line 1 is not a metrics record (a JSON object with a step)"),
    ],
    ids=["damaged line", "not text", "not records"],
)
def test_report_of_an_unreadable_metrics_file_is_one_line(tmp_path, content, needle):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_bytes(content)
    result = run_cli("report", str(tmp_path / "run"), "--out", str(tmp_path / "r.png"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distflow: error: ") and needle in lines[0], result.stderr


def test_report_leaves_out_a_torn_last_record(tmp_path, capsys):
    """A run killed (or still running) mid-write: its last line is cut short; the rest is reported."""
    run = _fake_run(tmp_path, "a", [0.0, 1.0], (0.1, 0.2))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["a", "2"]


def test_report_shows_the_mismatch_ledger_as_means_that_still_add_up(tmp_path, capsys):
    run = _fake_run(tmp_path, "ledger", [0.5] * 3, (0.2, 0.3))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record, staleness in zip(records[1:], (0.0, 0.25, 0.5), strict=True):
        terms = {"engine": 1e-7, "sampler": 0.0, "precision": 0.0, "routing": 0.0, "staleness": staleness}
        record.update({f"mismatch/ledger_{name}": value for name, value in terms.items()})
        record["mismatch/ledger_total"] = sum(terms.values())
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("mismatch ledger (trainer minus rollout log-prob per token), mean over the steps:")
    assert lines[at + 1].split() == ["run", "engine", "sampler", "precision", "routing", "staleness", "total"]
    assert lines[at + 2].split() == ["ledger", "1e-07", "0", "0", "0", "0.25", "0.25"]  # means: 0.25 + 1e-7


def test_report_of_a_run_without_the_ledger_prints_no_ledger(tmp_path, capsys):
    assert main(["report", str(_fake_run(tmp_path, "plain", [0.5] * 3, (0.2, 0.3))), "--out", str(tmp_path / "r")]) == 0
    assert "mismatch ledger" not in capsys.readouterr().out

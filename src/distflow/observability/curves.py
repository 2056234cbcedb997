"""Pictures and a table from runs' metrics.jsonl: RUN_DIR/curves.png and `distflow report`.

One panel per curve a user looks at first (reward, held-out accuracy, response length, KL,
entropy, gradient norm), then the rollout's tail (the length quantiles, occupancy, the tail's
seconds, speculation's acceptance and tokens per forward) and the step's time split; several runs
are overlaid, one colour each, labelled by run directory name (a curve a run does not log is left
out of its panel; a panel of several curves tells them apart by line style).
Drawn with matplotlib's Agg backend (no display needed). A name's characters that the font
lacks (a Chinese or Devanagari run name, an emoji) are drawn as "?": matplotlib would draw an
empty box and print a missing-glyph warning for each of them.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from distflow.config.errors import ConfigError

PANELS = (
    (("reward/mean",), "reward (mean)"),
    (("eval/accuracy",), "held-out accuracy (sampled)"),
    (("response/length",), "response length (tokens)"),
    (("train/kl",), "KL to the reference"),
    (("train/entropy",), "entropy"),
    (("train/grad_norm",), "gradient norm"),
    (("response/length_p50", "response/length_p90", "response/length_max"), "response length p50, p90, max"),
    (("rollout/occupancy",), "rollout occupancy (decoded / slot-steps)"),
    (("time/rollout_tail_s",), "rollout tail (s after 90% ended)"),
    (("rollout/spec_acceptance",), "speculation: draft tokens accepted"),
    (("rollout/tokens_per_forward",), "speculation: tokens per forward"),
)
"""Each panel's metrics (drawn -, --, : in this order) and its title."""
STYLES = ("-", "--", ":")
ROLLOUT_COLUMNS = (
    ("length_p50", "response/length_p50"),
    ("length_p90", "response/length_p90"),
    ("length_max", "response/length_max"),
    ("occupancy", "rollout/occupancy"),
    ("tail_s", "time/rollout_tail_s"),
    ("spec_accept", "rollout/spec_acceptance"),
    ("tokens_per_fwd", "rollout/tokens_per_forward"),
)
"""`distflow report`'s rollout table: its columns and the metric each is the median of, over the steps."""
LEDGER_COLUMNS = tuple(
    (name, f"mismatch/ledger_{name}") for name in ("engine", "sampler", "precision", "routing", "staleness", "total")
)
"""`distflow report`'s mismatch ledger (`rollout.mismatch_ledger`): each term's mean over the steps (a mean, so
that the five still add up to the total)."""
# Wall-clock totals, not stages of a step's split (every wall-clock metric is under time/).
TOTAL_TIMES = ("time/step_s", "time/loader_wait_s", "time/train_total_s", "time/eval_s")


def read_run(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl. A torn last line (a run killed, or still running,
    mid-write) is left out; any other damage is a ConfigError naming the file and the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl; give a run directory (trainer.output_dir/<run name>)")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}; check its permissions") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): it is not a metrics file, or it is damaged"
        ) from None
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and isinstance(record.get("step"), int)
        except ValueError:
            ok = False
        if not ok:
            if number == len(lines):
                break  # torn by a crash mid-write, or being written right now
            raise ConfigError(
                f"{path}: line {number} is not a metrics record (a JSON object with a step); repair or remove that line"
            )
        records.append(record)
    return records


def picture_path(out: Path) -> Path:
    """Where `distflow report --out OUT` writes: OUT itself (a picture format matplotlib writes, by its
    extension; none: .png is added), or OUT/report.png for an existing directory. A ConfigError
    for a format matplotlib cannot write or a directory that does not exist."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if out.is_dir():
        out = out / "report.png"
    elif not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise ConfigError(
            f"--out {str(out)!r}: {out.suffix!r} is not a picture format; end the name with .png "
            f"(or one of {', '.join('.' + f for f in sorted(formats) if f != 'png')})"
        )
    parent = out.parent
    if not parent.is_dir():
        raise ConfigError(
            f"--out {str(out)!r}: the directory {str(parent)!r} does not exist; create it, "
            "or choose a path in an existing directory"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--out {str(out)!r}: cannot write into {str(parent)!r} (permission denied); choose a writable place"
        )
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def stage_times(records: list[dict]) -> dict[str, float]:
    """Median seconds per stage over the training steps (the first, with one-time costs, left out
    when there are others)."""
    steps = [r for r in records if r.get("step", 0) >= 1 and r.get("time/step_s") is not None]
    steps = steps[1:] if len(steps) > 1 else steps
    keys = sorted({k for r in steps for k in r if k.startswith("time/") and k not in TOTAL_TIMES})
    return {k[len("time/") : -len("_s")]: statistics.median(r[k] for r in steps if r.get(k) is not None) for k in keys}


def draw(runs: dict[str, list[dict]], out: Path) -> Path:
    """The panels for every run in `runs` (label → records), saved to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = _drawable_labels(list(runs))
    fig, axes = plt.subplots(3, 4, figsize=(18, 12))
    # Fixed margins, room for the titles, the x labels and the time split's slanted run names: a layout
    # engine (constrained or tight) measures every text first, doubling the drawing time of a run's end.
    fig.subplots_adjust(left=0.04, right=0.99, top=0.965, bottom=0.07, wspace=0.25, hspace=0.4)
    for ax, (keys, title) in zip(axes.flat, PANELS, strict=False):
        _draw_panel(ax, runs, shown, keys)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    _draw_time_split(axes.flat[len(PANELS)], runs, [shown[label] for label in runs])
    if len(runs) > 1:
        axes.flat[0].legend(fontsize="small")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _draw_panel(ax, runs: dict[str, list[dict]], shown: dict[str, str], keys: tuple[str, ...]) -> None:
    """Each run's curve of each of `keys`, a run's curves in its colour, told apart by line style (and named
    in the panel's legend where there are several)."""
    drawn = False
    for number, (label, records) in enumerate(runs.items()):
        for key, style in zip(keys, STYLES, strict=False):
            steps, values = _series(records, key)
            if steps:
                name = shown[label] if len(keys) == 1 else f"{shown[label]} {key.rsplit('_', 1)[-1]}"
                marker = "o" if len(steps) < 20 else None
                ax.plot(steps, values, style, color=f"C{number}", marker=marker, markersize=3, label=name)
                drawn = True
    if not drawn:  # e.g. no KL term, no update ran (every group without signal), an engine that counts nothing
        ax.text(0.5, 0.5, f"no {keys[0]} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes)
    elif len(keys) > 1:
        ax.legend(fontsize="x-small")


def _drawable_labels(labels: list[str]) -> dict[str, str]:
    """Each label as the default font draws it: a character the font has no glyph for becomes "?"."""
    from matplotlib.font_manager import FontProperties, findfont
    from matplotlib.ft2font import FT2Font

    font = FT2Font(findfont(FontProperties()))
    return {label: "".join(c if font.get_char_index(ord(c)) else "?" for c in label) for label in labels}


def _draw_time_split(ax, runs: dict[str, list[dict]], labels: list[str]) -> None:
    """Stacked bars: median seconds per stage, one bar per run (labelled `labels`)."""
    bottoms = [0.0] * len(runs)
    stages = sorted({stage for records in runs.values() for stage in stage_times(records)})
    times = [stage_times(records) for records in runs.values()]
    for stage in stages:
        heights = [t.get(stage, 0.0) for t in times]
        ax.bar(range(len(runs)), heights, bottom=bottoms, label=stage)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(runs)), labels, rotation=15, ha="right", rotation_mode="anchor", fontsize="small")
    ax.set_title("step time split (median s per stage)")
    if stages:
        ax.legend(fontsize="x-small")


def summary_rows(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for label, records in runs.items():
        steps = [r for r in records if r.get("step", 0) >= 1]
        evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
        rewards = [r["reward/mean"] for r in steps if r.get("reward/mean") is not None]
        tenth = max(1, len(rewards) // 10)
        step_s = [r["time/step_s"] for r in steps[1:] or steps if r.get("time/step_s") is not None]
        rows.append(
            {
                "run": label,
                "steps": steps[-1]["step"] if steps else 0,
                "accuracy_first": evals[0] if evals else None,
                "accuracy_last": evals[-1] if evals else None,
                "reward_first": statistics.fmean(rewards[:tenth]) if rewards else None,
                "reward_last": statistics.fmean(rewards[-tenth:]) if rewards else None,
                "step_s_median": statistics.median(step_s) if step_s else None,
            }
        )
    return rows


def rollout_rows(runs: dict[str, list[dict]], columns=ROLLOUT_COLUMNS, over=statistics.median) -> list[dict]:
    """Per run, `over` (the median) its steps of each of `columns`' metrics (None: not logged); no rows where
    no run logged any (a run before these metrics existed, or without the ledger)."""
    rows = []
    for label, records in runs.items():
        row = {"run": label}
        for column, key in columns:
            values = [r[key] for r in records if r.get("step", 0) >= 1 and r.get(key) is not None]
            row[column] = over(values) if values else None
        rows.append(row)
    return rows if any(v is not None for row in rows for k, v in row.items() if k != "run") else []


def format_table(rows: list[dict], names: list[str] | None = None) -> str:
    """`rows` as a table of the columns `names` (default: `summary_rows`')."""

    def cell(value) -> str:
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    names = names or ["run", "steps", "accuracy_first", "accuracy_last", "reward_first", "reward_last", "step_s_median"]
    table = [names] + [[cell(row[n]) for n in names] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(names))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in table
    )

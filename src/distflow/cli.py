"""The `distflow` command: train, plan.

    distflow train CONFIG [key=value ...] [--nproc N]
    torchrun --nproc_per_node N -m distflow train CONFIG [key=value ...]
    distflow plan CONFIG [key=value ...] --world-size N

The configuration (and the stage graph) is validated before any rank starts; a user
error prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from distflow.config import Config, ConfigError, load_config

USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distflow", description="Fully distributed RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy (one process, --nproc N, or under torchrun)")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50")
    train.add_argument("--nproc", type=int, default=1, help="number of ranks to start on this machine")
    plan = sub.add_parser("plan", help="print the execution plan without launching anything")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--world-size", type=int, required=True)
    return parser


def _validate(config: Config, world_size: int, *, check_run_dir: bool) -> None:
    """Everything that can be checked before a rank starts: layout arithmetic, graph, paths, imports."""
    import torch

    from distflow.config.callables import import_callable
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    make_plan(build_graph(config), config, world_size, LOADER_FIELDS)
    import_callable(config.task.reward, key="task.reward")
    if config.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    if config.model.path is not None and not (Path(config.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(f"model.path={config.model.path!r} is not a Hugging Face model directory (no config.json)")
    tokenizer_path = config.model.tokenizer_path
    if tokenizer_path is not None and not Path(tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer_path={tokenizer_path!r} is not a directory")
    if check_run_dir and (_run_dir(config) / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {str(_run_dir(config))!r} already holds a run; "
                          "choose another trainer.run_name")


def _run_dir(config: Config) -> Path:
    name = config.trainer.run_name or os.environ.get("DISTFLOW_RUN_NAME") or time.strftime("%Y%m%d-%H%M%S")
    return Path(config.trainer.output_dir) / name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    # Overrides may come before or after options: `train C --nproc 2 a.b=1` works too.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = args.overrides + extra
    # User rewards and stages (`my_module:fn`) are importable from the working directory,
    # as under `python -m` / torchrun, also when started through the `distflow` script.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        config = load_config(args.config, args.overrides)
        if args.command == "plan":
            return _plan(config, args.world_size)
        under_launcher = "RANK" in os.environ
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if under_launcher else args.nproc
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1 (got {args.nproc})")
        os.environ.setdefault("DISTFLOW_STARTED", str(time.time()))
        # One run directory for all ranks, chosen before they start.
        os.environ.setdefault("DISTFLOW_RUN_NAME", _run_dir(config).name)
        # Under a launcher only rank 0 checks the run directory (rank 0 is about to write into it).
        _validate(config, world_size, check_run_dir=os.environ.get("RANK", "0") == "0")
        if config.model.path is None and not under_launcher:
            # Prepare the embedded model here, once, before any rank waits on it.
            from distflow.tasks.embedded import ensure_embedded_model

            ensure_embedded_model(config, builder=True, log=lambda text: print(text, file=sys.stderr, flush=True))
        if args.nproc > 1 and not under_launcher:
            from distflow.runtime.launcher import launch

            return launch(args.nproc, _strip_nproc(argv))
        from distflow.runtime.executor import run

        run(config, _run_dir(config))
        return 0
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _plan(config: Config, world_size: int) -> int:
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world_size})")
    print(make_plan(build_graph(config), config, world_size, LOADER_FIELDS).describe())
    return 0

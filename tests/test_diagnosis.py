"""The launcher's one line about a failed job (runtime/diagnosis.py), from hand-written status files."""

import json

from distflow.runtime.diagnosis import diagnose


def test_diagnose_prefers_the_root_cause(tmp_path):
    def status(rank, state, **extra):
        (tmp_path / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "pid": 1,
                    "stage": "rollout",
                    "step": 4,
                    "since": 0.0,
                    "state": state,
                    "time": 5.0,
                    **extra,
                }
            )
        )

    status(0, "failed", error="distflow: rank 0 lost its peers", exit_code=1, comm_error=True)
    status(1, "running")
    report = diagnose(tmp_path, {0: (1, 10.0), 1: (-9, 11.0)})
    assert (
        report.line
        == "distflow: rank 1 was killed by SIGKILL in stage 'rollout' at step 4; the other ranks were stopped"
    )
    status(1, "failed", error="distflow: error: bad row", exit_code=2, comm_error=False)
    assert diagnose(tmp_path, {0: (1, 10.0), 1: (2, 11.0)}).exit_code == 2
    assert diagnose(tmp_path, {3: (-15, 1.0)}).line.endswith(
        "was killed by SIGTERM before it started; the other ranks were stopped"
    )
    # Both ranks report a stall: the one behind in the step is the stuck one, though the other
    # (waiting in the next stage's collective) entered its stage earlier.
    status(0, "stalled", stage="policy_update", position=5, since=1.0, error="rank 0 stalled", exit_code=3)
    status(1, "stalled", stage="chaos", position=4, since=2.0, error="rank 1 stalled", exit_code=3)
    assert diagnose(tmp_path, {}).line == "rank 1 stalled"
    status(1, "stalled", stage="chaos", step=3, position=6, since=0.5, error="rank 1 stalled", exit_code=3)
    assert diagnose(tmp_path, {}).line == "rank 1 stalled"  # an earlier step is behind, whatever the stage

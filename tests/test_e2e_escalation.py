"""End to end: a fault that keeps coming back at the same step escalates and ends the job (issue 20)."""
import pytest

from tests.harness import by_event, launch

pytestmark = pytest.mark.e2e


def test_a_fault_repeating_at_one_step_escalates_and_stops_with_the_reason(tmp_path):
    # rank 0 kills itself whenever it reaches step 6, so no recovery can get past it: a local reset (one:
    # --max-local-resets 1, each costs a fresh worker process), then a node replace (the spare's rank 0 does
    # the same), then the fallback - none is configured - and a stop
    job = launch(tmp_path, "repeat", nnodes=2, nproc=1, spares=1, steps=20, script_args=["--crash-at", "6"],
                 extra_flags=["--max-local-resets", "1"])
    rc = job.finish(timeout=300)
    assert rc != 0, job.log()[-3000:]
    ev = job.events()
    actions = [e["action"] for e in by_event(ev, "fault_detected") if not e.get("during_recovery")]
    assert actions == ["local_reset", "node_replace", "external_fallback"], actions
    finished = by_event(ev, "job_finished")[-1]
    assert finished["exit_code"] == rc
    assert "made no progress" in finished["reason"] and "SIGKILL" in finished["reason"], finished["reason"]
    # every recovery restored a snapshot just before the crash: S_6 (taken as step 5 ends) when its commit, which
    # overlaps step 6, beat the kill (a suite run on 2026-12-07 saw it), else S_5 or S_4 (the race
    # faults/escalate.py SLACK allows for)
    steps = {e["restored_step"] for e in by_event(ev, "recovery_done")}
    assert steps and steps <= {4, 5, 6}, f"every recovery restored a step just before the crash: {steps}"

"""Two runs started in one directory (issue 29 item 1), with real processes: the second, which names no run, does
not see the first's events or checkpoints; resuming is deliberate (--resume), and a checkpoint of another model is
then refused in one line, exit 2, without a retry loop."""
import json
import subprocess

import pytest

from tests.harness import BIN, EXAMPLE, SMALL, WAIT_S, env

pytestmark = pytest.mark.e2e


def _run(cwd, *flags, d_model):
    small = list(SMALL)
    small[small.index("--d-model") + 1] = str(d_model)
    e = {k: v for k, v in env().items() if k != "SLURM_JOB_ID"}   # a run under Slurm is named by its job
    return subprocess.run([str(BIN / "phoenixrun"), "--nnodes", "1", "--nproc-per-node", "1", "--persist-every", "2",
                           "--heartbeat-interval", "0.1", *flags, str(EXAMPLE), "--steps", "4", "--out", "out", *small],
                          cwd=cwd, env=e, capture_output=True, text=True, timeout=2 * WAIT_S)


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def test_two_runs_in_one_directory_then_a_deliberate_resume_of_another_model(tmp_path):
    first = _run(tmp_path, d_model=64)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run(tmp_path, d_model=32)         # another model, nothing named: a new run
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted((tmp_path / ".phoenixrun").iterdir(), key=lambda d: (d / "events.jsonl").stat().st_mtime)
    assert len(runs) == 2, runs
    ev = _events(runs[1])
    assert [e["event"] for e in ev].count("master_started") == 1          # its own events only
    assert not [e for e in ev if e["event"] == "fallback_restart"], ev     # started fresh, not from run 1's step 4
    assert sorted(p.name for p in (runs[1] / "checkpoints").iterdir())[-1] == "step_00000004"

    # deliberately resuming the newest run (the 32-wide model) with the 64-wide one: refused, once, naming it
    third = _run(tmp_path, "--resume", d_model=64)
    assert third.returncode == 2, third.stderr[-3000:]
    failed = [ln for ln in third.stderr.splitlines() if "job failed" in ln]
    assert len(failed) == 1 and "does not match the script" in failed[0], third.stderr[-3000:]
    assert "shape [128, 32] in the checkpoint, [128, 64] in the script's model" in failed[0], failed
    assert f"continues in .phoenixrun/{runs[1].name}" in third.stderr
    ev = _events(runs[1])
    assert len([e for e in ev if e["event"] == "fallback_restart"]) == 1, ev     # no retry loop
    assert ev[-1]["event"] == "job_finished" and ev[-1]["exit_code"] == 2

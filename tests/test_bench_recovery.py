"""benchmarks/recovery.py at its smallest, so the figures docs/benchmarks.md quotes cannot stop being produced
unnoticed: a node's hot swap beside torchrun's checkpoint-restart of the same job, and a worker death with and
without the node's standby worker - one trial each. The figures themselves are measurements, not asserted here;
what is asserted is what each arm must show (survivors kept, at most one step replayed, the standby took the rank)."""
import json
import subprocess
import sys

import pytest

from tests.harness import ROOT, env

pytestmark = pytest.mark.e2e
BENCH = str(ROOT / "benchmarks" / "recovery.py")


def _run(tmp_path, *flags: str) -> dict:
    out = tmp_path / "recovery.json"
    r = subprocess.run([sys.executable, BENCH, "--trials", "1", "--json", str(out), *flags],
                       capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def test_hot_swap_beside_torchrun_restart(tmp_path):
    s = _run(tmp_path, "--nodes", "2", "--nproc", "1", "--steps", "60", "--kill", "25", "--ckpt-every", "10")
    assert not s["failed_trials"], s["failed_trials"]
    ph, tr = s["phoenixrun"][0], s["torchrun"][0]
    assert ph["survivors_kept"] is True and ph["replayed_steps"] <= 1, ph
    assert tr["exit_code"] == 0 and tr["replayed_steps"] >= 1, tr
    assert s["lost_time_ratio"] > 0 and s["phoenix_recovery_s"] > 0


def test_worker_death_with_and_without_the_standby(tmp_path):
    # steps of >= 50 ms: the job outlasts the standby's start-up (torch's import) and its idle measurement
    s = _run(tmp_path, "--worker-death", "--nodes", "2", "--nproc", "2", "--steps", "600", "--kill", "20",
             "--model", "--d-model 64 --layers 1 --heads 2 --vocab 128 --seq 16 --batch 2 --step-seconds 0.05")
    assert not s["failed_trials"], s["failed_trials"]
    fresh, standby = s["fresh"][0], s["standby"][0]
    assert fresh["exit_code"] == standby["exit_code"] == 0
    assert standby["standby_took_rank"] is True and standby["others_kept"] is True, standby
    assert fresh["standby_took_rank"] is False and fresh["others_kept"] is True, fresh


def test_fault_class_trials_one_after_another_in_one_job(tmp_path):
    # benchmarks/detection.py's per-class arm at its smallest: two node losses in one job (a warm spare each), the
    # second once the job is back in its steady state; no torchrun arm (test_hot_swap_beside_torchrun_restart runs it)
    out = tmp_path / "detection.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "detection.py"), "--faults", "node-loss",
                        "--trials", "2", "--no-baseline", "--json", str(out)],
                       capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert not s["failed_trials"], s["failed_trials"]
    rows = s["classes"]["node-loss"]["rows"]
    assert len(rows) == 2 and rows[1]["step_reached"] > rows[0]["step_reached"], rows
    for row in rows:
        assert row["class"] == "node_lost" and row["replayed_steps"] <= 1, row
        assert 0 < row["detect_s"] < row["back_s"] and row["lost_s"] > 0, row   # fault -> detected -> resumed
        assert row["load_avg"] >= 0 and "rebuild_s" in row["phases"], row

"""An unmodified torchrun script (tests/scripts/plain_ddp.py: DDP over gloo, no phoenixrun API) gets
torchrun's semantics: restarts on any failure, a lost node replaced by a spare, each attempt on its
own rendezvous store, node ranks as given. Real processes throughout."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import BIN, Job, by_event, env

pytestmark = pytest.mark.e2e
PLAIN = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"


def plain(tmp: Path, name: str, nnodes: int = 2, nproc: int = 1, flags: list[str] | None = None,
          script_args: list[str] | None = None) -> Job:
    run_dir, out = tmp / f"{name}-run", tmp / f"{name}-out"
    log = open(tmp / f"{name}-run.log", "w")
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--run-dir", str(run_dir), "--heartbeat-interval", "0.1", *(flags or []), str(PLAIN),
           "--out", str(out), *(script_args or [])]
    return Job(run_dir, out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp))


def ranks(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def wait_progress(job: Job, step: int, world: int, timeout: float = 180.0) -> None:
    """Until every rank of the first attempt has finished `step` (the script's own progress files)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited ({job.proc.returncode}) before step {step}:\n{job.log()[-3000:]}")
        done = [job.out / f"progress-{r}" for r in range(world)]
        if all(p.exists() and int((p.read_text() or "0 -1").split()[1]) >= step for p in done):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached:\n{job.log()[-3000:]}")


def assert_finished_after_one_restart(job: Job, world: int, steps: int) -> list[dict]:
    rc = job.finish()
    assert rc == 0, job.log()[-4000:]
    ev = job.events()
    assert len(by_event(ev, "restart")) == 1, [e["event"] for e in ev]
    res = ranks(job.out)
    assert sorted(res) == list(range(world))
    for r in res.values():      # every rank of the second attempt trained to the end
        assert r["attempt"] == 1 and len(r["losses"]) == steps and r["world"] == world
    # DDP keeps the replicas equal: a restart that mixed attempts or ranks would not
    assert len({r["param_sha256"] for r in res.values()}) == 1
    assert "connectFullMesh" not in job.log()
    return ev


def test_raise_once_restarts_and_finishes(tmp_path):
    job = plain(tmp_path, "raise", flags=["--max-restarts", "1"], script_args=["--steps", "6", "--fail-once", "1"])
    ev = assert_finished_after_one_restart(job, 2, 6)
    fault = by_event(ev, "fault_detected")[0]
    assert fault["rank"] == 1 and fault["returncode"] == 1


def test_raise_without_restarts_fails_with_the_reason(tmp_path):
    job = plain(tmp_path, "noretry", flags=["--max-restarts", "0"], script_args=["--steps", "6", "--fail-once", "1"])
    rc = job.finish()
    assert rc == 1
    fin = by_event(job.events(), "job_finished")[-1]
    assert "rank 1" in fin["reason"] and "no restarts left" in fin["reason"], fin


def test_worker_killed_mid_training_restarts_on_a_fresh_store(tmp_path):
    job = plain(tmp_path, "wkill", flags=["--max-restarts", "1"], script_args=["--steps", "12", "--step-sleep", "0.1"])
    wait_progress(job, 3, 2)
    state = job.state()
    victim = next(n for n in state["nodes"] if n["slot"] == 1)["worker_pids"][0]
    os.kill(victim, signal.SIGKILL)
    ev = assert_finished_after_one_restart(job, 2, 12)
    started = by_event(ev, "master_started")[0]
    restart = by_event(ev, "restart")[0]
    assert restart["store_port"] not in (None, started.get("store_port"))


def test_node_killed_mid_training_restarts_with_the_spare(tmp_path):
    job = plain(tmp_path, "nkill", flags=["--max-restarts", "1", "--spares", "1"],
                script_args=["--steps", "12", "--step-sleep", "0.1"])
    wait_progress(job, 3, 2)
    state = job.state()
    node = next(n for n in state["nodes"] if n["slot"] == 1 and n["role"] == "active")
    spare = next(n for n in state["nodes"] if n["role"] == "spare")
    for pid in [node["agent_pid"], *node["worker_pids"]]:
        os.kill(pid, signal.SIGKILL)
    ev = assert_finished_after_one_restart(job, 2, 12)
    promoted = by_event(ev, "spare_promoted")
    assert [(p["slot"], p["node"]) for p in promoted] == [(1, spare["node_id"])]
    assert by_event(ev, "job_finished")[-1]["restarts"] == 1


def test_restart_that_cannot_come_up_fails_within_bounded_time(tmp_path):
    """Rank 1 of the second attempt never reaches init_process_group: rank 0 would wait for it for the
    store timeout (30 min); the master stops the job naming rank 1 after 2 x --recovery-timeout."""
    job = plain(tmp_path, "stall", flags=["--max-restarts", "1", "--recovery-timeout", "4"],
                script_args=["--steps", "6", "--fail-once", "0", "--stall-init", "1"])
    rc = job.finish(timeout=120)
    assert rc == 1, job.log()[-3000:]
    ev = job.events()
    restart, fin = by_event(ev, "restart")[0], by_event(ev, "job_finished")[-1]
    assert "rank(s) [1] never reached init_process_group" in fin["reason"], fin
    assert fin["t"] - restart["t"] < 30, fin["t"] - restart["t"]

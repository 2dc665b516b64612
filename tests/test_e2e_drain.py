"""Planned drains end to end with real processes: `phoenixrun drain` and SIGTERM to an agent move a healthy node's
ranks to a spare at a step boundary - nothing replayed, the survivors' processes kept, the drained agent exits
cleanly - and the job ends bit-identical to a fault-free torchrun run."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.harness import BIN, assert_identical, by_event, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


def _node(state: dict, slot: int) -> dict:
    return next(n for n in state["nodes"] if n["slot"] == slot and n["role"] == "active")


def _gone(pid: int, timeout: float = 30.0) -> bool:
    """The process exited (and was reaped by its parent, the launcher); there is no event for an agent's exit."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                time.sleep(0.05)
                continue
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _warm_spare(state: dict) -> bool:
    return any(n["role"] == "spare" and n.get("warm_ready") for n in state.get("nodes", []))


@pytest.mark.smoke
@pytest.mark.timeout(900)   # 4-5 minutes at a load average of 25 on 2 cores (the brief's 40 s: an idle machine)
def test_drain_by_command_then_by_sigterm(tmp_path):
    """Two drains in one job (2 nodes x 2 ranks + 2 spares): node 1 by `phoenixrun drain`, then node 0 by SIGTERM to
    its agent. Each time the job is held at a step (one rank's snapshot copy held at a pause point, steps 5 and 20)
    until the drain's quiesce is ordered: on a loaded machine the CLI alone took longer than the whole job."""
    ref = torchrun(tmp_path, "ref", nproc=2, steps=STEPS)
    job = launch(tmp_path, "drain", nnodes=2, nproc=1, spares=2, steps=STEPS, extra_flags=["--hang-timeout", "120", "--collective-timeout", "150"],
                 PHOENIXRUN_TEST_PAUSE="d2h:5+,d2h#2:20+")
    job.wait_file(tmp_path / "paused-d2h", timeout=300)
    before = job.wait_for(_warm_spare, what="a warm spare (a drain waits for one)")
    first, kept = _node(before, 1), _node(before, 0)
    r = subprocess.run([str(BIN / "phoenixrun"), "drain", "--run-dir", str(job.run_dir), "--node", "1",
                        "--reason", "maintenance"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"node {first['node_id']}" in r.stdout
    job.wait_for(lambda s: s["phase"] == "quiesce", what="the first drain's quiesce")
    (tmp_path / "release-d2h").touch()
    after = job.wait_for(lambda s: s["recoveries"] >= 1 and s["phase"] == "running", timeout=300, what="the first drain")
    drained = next(n for n in after["nodes"] if n["node_id"] == first["node_id"])
    assert drained["role"] == "drained" and drained["slot"] is None and drained["draining"] == "maintenance"
    assert _node(after, 0)["worker_pids"] == kept["worker_pids"]       # the survivor kept its processes
    assert _gone(first["agent_pid"]), "the drained node's agent did not exit"
    # SIGTERM to the other node's agent (preemption): drained the same way, by the agent's own request
    job.wait_file(tmp_path / "paused-d2h#2", timeout=300)
    job.wait_for(_warm_spare, what="the second spare warm")
    second, kept = _node(after, 0), _node(after, 1)
    os.kill(second["agent_pid"], signal.SIGTERM)
    job.wait_for(lambda s: s["phase"] == "quiesce", what="the SIGTERM drain's quiesce")
    (tmp_path / "release-d2h#2").touch()
    after = job.wait_for(lambda s: s["recoveries"] >= 2 and s["phase"] == "running", timeout=300, what="the SIGTERM drain")
    assert _node(after, 1)["worker_pids"] == kept["worker_pids"]
    assert _gone(second["agent_pid"]), "the SIGTERM'd agent did not exit"
    # both spares are used up: a third drain is refused, naming the problem, without a traceback
    r = subprocess.run([str(BIN / "phoenixrun"), "drain", "--run-dir", str(job.run_dir), "--node", "0"],
                       capture_output=True, text=True, timeout=30)
    if job.proc.poll() is None:      # (the job may have finished meanwhile: then the master is gone)
        assert r.returncode == 1 and "no spare node" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    req = by_event(ev, "drain_requested")
    assert [(e["node"], e["by"], e["accepted"]) for e in req] == \
        [(first["node_id"], "operator", True), (second["node_id"], "agent", True)]
    done = by_event(ev, "recovery_done")
    assert [d["cause"] for d in done] == ["drain", "drain"]
    assert [d["replayed_steps"] for d in done] == [0, 0], done
    assert [d["drained_node"] for d in done] == [first["node_id"], second["node_id"]]
    assert [e["cause"] for e in by_event(ev, "recovery_started")] == ["drain", "drain"]
    assert not by_event(ev, "fault_detected")
    log = job.log()
    assert "drained: maintenance" in log and "drained: agent got SIGTERM" in log and "Traceback" not in log
    assert_identical(job.out, ref)

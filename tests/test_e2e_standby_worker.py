"""End to end with real processes: a worker SIGKILLed on a node whose standby worker waits in phoenixrun.init() -> the
local reset hands the dead rank to the standby (no new interpreter), every other worker on both nodes keeps its
process, and the result is bit-identical to a fault-free torchrun of the same job (agents/standby.py)."""
import os
import signal
import time

import psutil
import pytest

from tests.harness import WAIT_S, assert_identical, by_event, launch, torchrun

STEPS = 60
# Test pacing only (changes no number): the kill must land before the last step, after the standby (a whole worker
# start-up: ~8 CPU s here) is up beside a training job on a loaded 2-core machine.
PACE = ["--step-seconds", "0.5"]
pytestmark = pytest.mark.e2e


def _standby_of(agent_pid: int) -> int | None:
    """The agent's standby worker process (its environment says so), if it has one."""
    for c in psutil.Process(agent_pid).children():
        try:
            if c.environ().get("PHOENIXRUN_STANDBY") == "1":
                return c.pid
        except psutil.Error:
            continue
    return None


def _until(job, cond, what: str):
    deadline = time.time() + WAIT_S
    while time.time() < deadline:
        assert job.proc.poll() is None, f"job exited before {what}:\n{job.log()[-3000:]}"
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{job.log()[-3000:]}")


def test_a_killed_worker_is_replaced_by_the_standby(tmp_path):
    ref = torchrun(tmp_path, "ref4", nproc=4, steps=STEPS)
    job = launch(tmp_path, "standby", nnodes=2, steps=STEPS, script_args=PACE, PHOENIXRUN_LOG_LEVEL="INFO")
    state = job.wait_step(1)
    node = next(n for n in state["nodes"] if n["slot"] == 1)
    standby = _until(job, lambda: _standby_of(node["agent_pid"]), "slot 1's standby worker")
    _until(job, lambda: f"standby worker (pid {standby}) is ready" in job.log(), "the standby waiting in init()")
    state = job.state()
    before = {n["slot"]: n["worker_pids"] for n in state["nodes"]}
    assert standby not in before[1] and len(before[1]) == 2
    assert (state["step"] or 0) < STEPS - 10, "the job is nearly done before the standby is up: slow it (PACE)"
    victim, kept = before[1]
    os.kill(victim, signal.SIGKILL)
    after = job.wait_for(lambda s: s["recoveries"] >= 1 and victim not in
                         next(n for n in s["nodes"] if n["slot"] == 1)["worker_pids"], what="the local reset")
    now = {n["slot"]: n["worker_pids"] for n in after["nodes"]}
    assert now[0] == before[0], "slot 0's workers were restarted"
    assert sorted(now[1]) == sorted([standby, kept]), (before, now)      # the standby holds the dead rank
    assert job.finish() == 0, job.log()[-3000:]
    fault = [f for f in by_event(job.events(), "fault_detected") if not f.get("during_recovery")][0]
    assert fault["action"] == "local_reset" and fault["slot"] == 1
    assert len(by_event(job.events(), "recovery_done")) == 1
    assert f"handed to the standby worker (pid {standby})" in job.log()
    assert_identical(job.out, ref)

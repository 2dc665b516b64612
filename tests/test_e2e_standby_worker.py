"""End to end with real processes: a worker SIGKILLed (or SIGSTOPped: hung) on a node whose standby worker waits in
phoenixrun.init() -> the local reset hands the dead rank to the standby (no new interpreter), every other worker on
both nodes keeps its process, and the result is bit-identical to a fault-free torchrun of the same job
(agents/standby.py; a hang is found by the watchdog, agents/watchdog.py)."""
import os
import re
import signal
import time

import psutil
import pytest

from tests.harness import WAIT_S, assert_identical, by_event, launch, torchrun

STEPS = 60
# The fault must land before the last step, after the standby (a whole worker start-up: ~8 CPU s here) is up beside
# the training job: the job is held at step 6 (one rank's snapshot copy paused) until the standby waits in init().
# A fixed pace (0.5 s a step) was not enough at load average 27 on 2 cores: the job finished first. While held, the
# workers' steps grow far past --hang-timeout: the hung case also shows that live workers are never called hung.
HOLD = {"PHOENIXRUN_TEST_PAUSE": "d2h:6+"}
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


HANG_TIMEOUT = 3.0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_killed_or_hung_worker_is_replaced_by_the_standby(tmp_path, sig):
    ref = torchrun(tmp_path, "ref4", nproc=4, steps=STEPS)
    job = launch(tmp_path, "standby", nnodes=2, steps=STEPS, PHOENIXRUN_LOG_LEVEL="INFO",
                 extra_flags=["--hang-timeout", str(HANG_TIMEOUT)], **HOLD)
    job.wait_file(tmp_path / "paused-d2h")
    state = job.wait_for(lambda s: len(s.get("nodes") or []) == 2, what="the master's state")
    node = next(n for n in state["nodes"] if n["slot"] == 1)
    standby = _until(job, lambda: _standby_of(node["agent_pid"]), "slot 1's standby worker")
    _until(job, lambda: f"standby worker (pid {standby}) is ready" in job.log(), "the standby waiting in init()")
    state = job.current()
    (tmp_path / "release-d2h").touch()
    before = {n["slot"]: n["worker_pids"] for n in state["nodes"]}
    assert standby not in before[1] and len(before[1]) == 2
    victim, kept = before[1]
    os.kill(victim, sig)
    # (the dead worker's exit is reported at once: a heartbeat may list slot 1 with its one survivor, before the
    # standby took the rank)
    after = job.wait_for(lambda s: s["recoveries"] >= 1 and (lambda pids: victim not in pids and len(pids) == 2)(
                         next(n for n in s["nodes"] if n["slot"] == 1)["worker_pids"]), what="the local reset")
    now = {n["slot"]: n["worker_pids"] for n in after["nodes"]}
    assert now[0] == before[0], "slot 0's workers were restarted"
    assert sorted(now[1]) == sorted([standby, kept]), (before, now)      # the standby holds the dead rank
    assert job.finish() == 0, job.log()[-3000:]
    fault = [f for f in by_event(job.events(), "fault_detected") if not f.get("during_recovery")][0]
    assert fault["action"] == "local_reset" and fault["slot"] == 1
    # (the agent's line and the master's record of the fault carry the same text)
    hung = set(re.findall(r"rank (\d+) made no progress for ([\d.]+)s and does not answer", job.log()))
    if sig == signal.SIGSTOP:
        # the stopped worker alone is called hung - not the ranks blocked on it, which answer the watchdog - and
        # never before its step exceeded the timeout
        assert fault["signal"] == "worker_hang", fault
        assert len(hung) == 1 and float(next(iter(hung))[1]) >= HANG_TIMEOUT, hung
    else:
        assert not hung, hung
    assert len(by_event(job.events(), "recovery_done")) == 1
    assert f"handed to the standby worker (pid {standby})" in job.log()
    assert_identical(job.out, ref)

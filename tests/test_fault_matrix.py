"""The fault matrix with real processes: each fault at an arbitrary step, through `phoenixrun inject`
(or the script itself), checked against the class and action recorded and the final state."""
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import BIN, assert_identical, by_event, env, kill_node, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    # one rank per node: a job costs its processes (a worker: ~8 CPU s before its first step here, mostly imports),
    # not its steps
    return torchrun(tmp_path_factory.mktemp("ref2"), "ref", nproc=2, steps=STEPS)


def inject(job, slot: int, fault: str) -> None:
    r = subprocess.run([str(BIN / "phoenixrun"), "inject", "--run-dir", str(job.run_dir), "--node", str(slot),
                        "--fault", fault], capture_output=True, text=True, env=env(), timeout=30)
    assert r.returncode == 0, r.stderr


# With one rank per node 40 steps take a few seconds, and the way from `phoenixrun inject` to the worker (CLI start,
# master, the agent's next directive) took 25 s at a load average of 10: a fault injected into a worker is given while
# the job is held at step 6 (one rank's snapshot copy paused), and the job goes on once the agent has acted on it.
HOLD = {"PHOENIXRUN_TEST_PAUSE": "d2h:6+"}


def inject_held(job, tmp_path, slot: int, fault: str, point: str = "d2h") -> None:
    job.wait_file(tmp_path / f"paused-{point}")
    inject(job, slot, fault)
    job.wait_for(lambda _: f"injecting fault {fault!r}" in job.log(), what=f"the agent injecting {fault}")
    (tmp_path / f"release-{point}").touch()


# Two faults per job, one on each node, the second once the first is repaired and the job has moved on: the
# four fault classes in two jobs instead of four (a job start costs more than a fault on this machine). Each job
# has one node replace and one local reset, so one spare serves it, as a job per fault had.
@pytest.mark.parametrize("first,second", [
    pytest.param(("xid:79", "host_pcie", "node_replace"),        # GPU fell off the bus: the node must go
                 ("xid:13", "gpu_memory", "local_reset"),        # contained fault: restart the node's workers
                 id="replace_then_reset", marks=pytest.mark.smoke),
    pytest.param(("hang", "transient_comm", "local_reset"),      # SIGSTOP of one worker: found by the hang watchdog
                 ("xid:48", "gpu_memory", "node_replace"),       # double-bit ECC
                 id="reset_then_replace"),
])
def test_fault_is_classified_acted_on_and_survived(tmp_path, ref2, first, second):
    """Each fault is given while the job is held (one rank's snapshot copy paused at step 6, then at step 20, after
    the first repair): unheld, a hang injected at "step 6" once landed after the last step, in a worker that had
    left the protected loop and was exiting - outside what the hang watchdog watches (as under torchrun)."""
    job = launch(tmp_path, first[0].replace(":", ""), nnodes=2, nproc=1, spares=1, steps=STEPS,
                 extra_flags=["--hang-timeout", "3"], PHOENIXRUN_TEST_PAUSE="d2h:6+,d2h#2:20+")
    targets = []
    for (slot, (fault, _, _)), point in zip([(1, first), (0, second)], ["d2h", "d2h#2"]):
        job.wait_file(tmp_path / f"paused-{point}")
        state = job.wait_for(lambda s: bool(s.get("nodes")), what="the master's state")
        targets.append(next(nd for nd in state["nodes"] if nd["slot"] == slot)["node_id"])
        inject_held(job, tmp_path, slot, fault, point)
    assert job.finish() == 0, job.log()[-3000:]
    faults = [e for e in by_event(job.events(), "fault_detected") if not e.get("during_recovery")]
    assert [(f["class"], f["action"]) for f in faults] == [first[1:], second[1:]], job.log()[-3000:]
    assert [f["node"] for f in faults] == targets          # the survivors are never blamed
    done = by_event(job.events(), "recovery_done")
    assert len(done) == 2 and all(d["replayed_steps"] <= 1 for d in done)
    assert [bool(d["replaced_slots"]) for d in done] == [f[2] == "node_replace" for f in (first, second)]
    assert_identical(job.out, ref2)


def test_user_exception_stops_cleanly(tmp_path):
    job = launch(tmp_path, "user", nnodes=2, nproc=1, steps=STEPS, script_args=["--raise-at", "9"])
    rc = job.finish()
    assert rc == 1, job.log()[-3000:]
    f = by_event(job.events(), "fault_detected")[0]
    assert (f["class"], f["action"]) == ("software_unknown", "external_fallback") and f["rank"] == 0
    fin = by_event(job.events(), "job_finished")[-1]
    assert fin["exit_code"] == 1 and "rank 0" in fin["reason"]
    assert not by_event(job.events(), "recovery_started")   # never hot-swapped around a bug


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_partition_is_replaced_and_fenced_when_it_heals(tmp_path, ref2):
    """The node's traffic is dropped: lost -> node_replace with the spare; when its traffic comes back it is
    told to stop (fencing on rejoin) instead of rejoining, and the job still ends bit-identical."""
    job = launch(tmp_path, "partition", nnodes=2, nproc=1, spares=1, steps=STEPS, extra_flags=["--node-timeout", "2"])
    state = job.wait_step(6)
    target = next(n for n in state["nodes"] if n["slot"] == 1)
    inject(job, 1, "partition")                           # lasts until the agent gets SIGUSR1
    job.wait_for(lambda s: by_event(job.events(), "spare_promoted"), what="a spare to take the partitioned slot")
    os.kill(target["agent_pid"], signal.SIGUSR1)          # its traffic comes back: it must not rejoin
    job.wait_for(lambda s: by_event(job.events(), "node_fenced"), timeout=60, what="the healed node to be fenced")
    ev = job.events()
    f = [e for e in by_event(ev, "fault_detected") if not e.get("during_recovery")][0]
    assert (f["class"], f["action"], f["signal"]) == ("node_lost", "node_replace", "node_lost")
    assert f["node"] == target["node_id"]                 # the survivors are never blamed
    assert by_event(ev, "spare_promoted")[0]["replaces"] == target["node_id"]
    assert [e["node"] for e in by_event(ev, "node_fenced")] == [target["node_id"]]
    deadline = time.time() + 30                           # fenced: its agent kills its workers and exits
    while time.time() < deadline and any(_alive(p) for p in [target["agent_pid"], *target["worker_pids"]]):
        time.sleep(0.1)
    assert not any(_alive(p) for p in [target["agent_pid"], *target["worker_pids"]])
    assert job.finish() == 0, job.log()[-3000:]
    assert_identical(job.out, ref2)


def test_comm_timeout_is_transient_and_reset_locally(tmp_path, ref2):
    """One worker's collectives fail on a healthy node: only collective errors, no root cause within the
    correlation window -> transient -> local reset (no spare needed), bit-identical end."""
    job = launch(tmp_path, "commtimeout", nnodes=2, nproc=1, steps=STEPS, **HOLD)
    inject_held(job, tmp_path, 1, "comm-timeout")
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    f = [e for e in by_event(ev, "fault_detected") if not e.get("during_recovery")][0]
    assert (f["class"], f["action"], f["verdict"]) == ("transient_comm", "local_reset", "transient")
    assert f["signal"] == "comm_error" and not f["symptoms"]
    done = by_event(ev, "recovery_done")
    assert done and done[0]["replaced_slots"] == {} and done[0]["replayed_steps"] <= 1
    assert_identical(job.out, ref2)


@pytest.mark.parametrize("how", ["script", "inject"])
def test_nan_loss_stops_cleanly_and_never_commits_the_bad_step(tmp_path, how):
    """A non-finite loss is never hot-swapped around: the job stops with a non-zero exit and the reason, and
    no snapshot of the step that produced it is committed anywhere (the last good one is what remains)."""
    job = launch(tmp_path, f"nan-{how}", nnodes=2, nproc=1, steps=STEPS,
                 script_args=["--nan-at", "9"] if how == "script" else [], **(HOLD if how == "inject" else {}))
    if how == "inject":
        inject_held(job, tmp_path, 1, "nan")
    rc = job.finish()
    assert rc == 1, job.log()[-3000:]
    ev = job.events()
    f = by_event(ev, "fault_detected")[0]
    assert (f["signal"], f["class"], f["action"]) == ("nan_loss", "software_unknown", "external_fallback")
    assert f["rank"] == (0 if how == "script" else 1)      # slot 1's worker got the poisoned loss
    bad = f["step"]
    assert bad == 9 if how == "script" else bad >= 6
    fin = by_event(ev, "job_finished")[-1]
    assert fin["exit_code"] == 1 and "non-finite loss" in fin["reason"] and f"at step {bad}" in fin["reason"]
    assert fin["committed_step"] is not None and fin["newest_snapshot"] <= bad
    assert not by_event(ev, "recovery_started")


PLAIN = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"


def test_node_lost_without_a_spare_while_the_survivors_fail_stops_with_75(tmp_path):
    """Issue 31: a torchrun-style job (no API), no spare, --max-restarts 2, one node SIGKILLed. The loss is found
    by its heartbeats while the survivor sleeps between steps; the survivor's worker then dies of the dead peer
    while the master waits --spare-wait for a spare. That report raised Cascade out of the restart's wait and
    crashed the controller (exit 70, "master error"); the documented outcome is exit code 75 after --spare-wait.
    The same class of paths (a fault report while a procedure other than the hot swap's cycle waits: the
    restart's and the fallback's spare wait, a drain, a grow) is unit-tested in test_master_coordinator.py and
    test_master_drain.py."""
    job = launch(tmp_path, "nospare", nnodes=2, nproc=1, spares=0, steps=200, script=PLAIN, model_args=[],
                 extra_flags=["--max-restarts", "2", "--spare-wait", "6", "--node-timeout", "1"],
                 script_args=["--step-sleep", "4"])
    progress = job.out / "progress-1"
    first = job.wait_file(progress)
    job.wait_for(lambda _: progress.read_text() not in ("", first), what="a step after the first")  # both asleep now
    kill_node(job.wait_for(lambda s: bool(s.get("nodes")), what="the master's state"), 1)
    rc = job.finish(timeout=300)
    log = job.log()
    assert "master controller crashed" not in log, log[-3000:]
    assert rc == 75, log[-3000:]
    ev = job.events()
    fin = by_event(ev, "job_finished")[-1]
    assert fin["exit_code"] == 75 and "no spare registered within --spare-wait 6s" in fin["reason"], fin
    loss = [e for e in by_event(ev, "fault_detected") if e["signal"] == "node_lost"][0]
    assert loss["slot"] == 1
    assert 6 <= fin["t"] - loss["t"] < 60, fin["t"] - loss["t"]     # waited --spare-wait, then stopped
    assert not by_event(ev, "restart")

"""The fault matrix with real processes: each fault at an arbitrary step, through `phoenixrun inject`
(or the script itself), checked against the class and action recorded and the final state."""
import subprocess

import pytest

from tests.harness import BIN, assert_identical, by_event, env, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref4(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref4"), "ref", nproc=4, steps=STEPS)


def inject(job, slot: int, fault: str) -> None:
    r = subprocess.run([str(BIN / "phoenixrun"), "inject", "--run-dir", str(job.run_dir), "--node", str(slot),
                        "--fault", fault], capture_output=True, text=True, env=env(), timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("fault,fault_class,action", [
    ("xid:79", "host_pcie", "node_replace"),        # GPU fell off the bus: the node must go
    ("xid:48", "gpu_memory", "node_replace"),       # double-bit ECC
    ("hang", "transient_comm", "local_reset"),      # SIGSTOP of one worker: found by the hang watchdog
    ("xid:13", "gpu_memory", "local_reset"),        # contained fault: restart the node's workers
])
def test_fault_is_classified_acted_on_and_survived(tmp_path, ref4, fault, fault_class, action):
    job = launch(tmp_path, fault.replace(":", ""), nnodes=2, spares=1, steps=STEPS,
                 extra_flags=["--hang-timeout", "3"])
    state = job.wait_step(6)
    target = next(n for n in state["nodes"] if n["slot"] == 1)
    inject(job, 1, fault)
    assert job.finish() == 0, job.log()[-3000:]
    faults = [e for e in by_event(job.events(), "fault_detected") if not e.get("during_recovery")]
    assert faults, job.log()[-3000:]
    f = faults[0]
    assert (f["class"], f["action"]) == (fault_class, action)
    assert f["node"] == target["node_id"]                 # the survivors are never blamed
    done = by_event(job.events(), "recovery_done")
    assert done and done[0]["replayed_steps"] <= 1
    assert bool(done[0]["replaced_slots"]) == (action == "node_replace")
    assert_identical(job.out, ref4)


def test_user_exception_stops_cleanly(tmp_path):
    job = launch(tmp_path, "user", nnodes=2, steps=STEPS, script_args=["--raise-at", "9"])
    rc = job.finish()
    assert rc == 1, job.log()[-3000:]
    f = by_event(job.events(), "fault_detected")[0]
    assert (f["class"], f["action"]) == ("software_unknown", "external_fallback") and f["rank"] == 0
    fin = by_event(job.events(), "job_finished")[-1]
    assert fin["exit_code"] == 1 and "rank 0" in fin["reason"]
    assert not by_event(job.events(), "recovery_started")   # never hot-swapped around a bug

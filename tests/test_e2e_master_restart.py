"""The control plane survives itself: SIGKILL the master mid-run, training goes on without it, the
launcher brings it back on the same endpoint, the agents rebuild its state, and a node failure after
that is hot-swapped as usual."""
import os
import signal
import subprocess

import pytest

from tests.harness import assert_identical, by_event, kill_node, launch, torchrun

pytestmark = pytest.mark.e2e
STEPS = 400      # the job must outlast a master restart, which takes seconds on a loaded 2-core machine


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref2"), "ref", nproc=2, steps=STEPS)


def finished_steps(progress_dir) -> list[tuple[int, float]]:
    """(step, unix time) of every step rank 0 finished (written by the example per step)."""
    lines = (progress_dir / "rank0.log").read_text().split("\n")
    return [(int(a), float(b)) for a, b in (ln.split() for ln in lines if ln.strip())]


@pytest.mark.smoke
def test_master_killed_mid_run_training_continues_and_recovery_still_works(tmp_path, ref2):
    progress = tmp_path / "progress"
    progress.mkdir()
    job = launch(tmp_path, "mk", nnodes=2, nproc=1, spares=1, steps=STEPS, script_args=["--progress-dir", str(progress)])
    before = job.wait_step(5)
    old_pid = before["master_pid"]
    os.kill(old_pid, signal.SIGKILL)
    after = job.wait_for(lambda s: s["master_pid"] != old_pid and s["phase"] == "running"
                         and len(s["nodes"]) == len(before["nodes"]), what="a new master with every node back")
    assert after["generation"] == before["generation"]          # state rebuilt from the agents, not reset
    assert {n["node_id"] for n in after["nodes"]} == {n["node_id"] for n in before["nodes"]}
    assert [n["role"] for n in after["nodes"]] == [n["role"] for n in before["nodes"]]

    ev = job.events()
    starts = by_event(ev, "master_started")
    assert len(starts) == 2 and starts[1]["pid"] == after["master_pid"]
    # nothing on the fault-free path needs the master: steps finished while there was none
    during = [s for s, t in finished_steps(progress) if t < starts[1]["t"] and s > before["step"]]
    assert during, "no step finished while the master was down"
    assert len(by_event(ev, "node_rejoined")) == 3 and by_event(ev, "master_recovered")

    state = job.wait_step(after["step"] + 3)
    kill_node(state, 1)
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert done and done[0]["replayed_steps"] <= 1 and done[0]["t"] > starts[1]["t"]
    assert ev[0]["event"] == "master_started" and ev[-1]["event"] == "job_finished"   # one log, both masters
    assert_identical(job.out, ref2)


def test_node_lost_while_the_master_is_down_is_recovered_once_it_is_back(tmp_path, ref2):
    job = launch(tmp_path, "both", nnodes=2, nproc=1, spares=1, steps=STEPS)
    before = job.wait_step(5)
    os.kill(before["master_pid"], signal.SIGKILL)
    lost = kill_node(before, 1)                  # dies while nobody is watching
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    recovered = by_event(ev, "master_recovered")
    assert recovered and recovered[0]["missing_slots"] == [1]   # it never rejoined
    assert {e["node"] for e in by_event(ev, "node_rejoined")} == {n["node_id"] for n in before["nodes"]} - {lost["node_id"]}
    f = [e for e in by_event(ev, "fault_detected") if e["t"] > recovered[0]["t"]][0]
    assert f["slot"] == 1 and f["action"] == "node_replace"
    done = by_event(ev, "recovery_done")
    assert done and done[0]["replaced_slots"] == {"1": next(n["node_id"] for n in before["nodes"] if n["role"] == "spare")}
    assert_identical(job.out, ref2)


def test_a_new_node_joins_a_running_job_as_spare_and_replaces_a_failed_one(tmp_path, ref2):
    """Spare replenishment: `phoenixrun agent` started by hand against a running job."""
    from tests.harness import BIN, EXAMPLE, SMALL, env
    job = launch(tmp_path, "late", nnodes=2, nproc=1, spares=0, steps=STEPS)
    state = job.wait_step(3)
    late = subprocess.Popen(
        [str(BIN / "phoenixrun"), "agent", "--rdzv-endpoint", state["endpoint"], "--nproc-per-node", "1",
         "--heartbeat-interval", "0.1", "--secret-file", str(job.run_dir / "secret"), "--",
         str(EXAMPLE), "--steps", str(STEPS), "--out", str(job.out), *SMALL],   # the same script and args
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        job.wait_for(lambda s: any(n["role"] == "spare" for n in s["nodes"]), what="the new node in the spare pool")
        shown = subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(job.run_dir)],
                               capture_output=True, text=True, env=env(), timeout=30)
        assert shown.returncode == 0 and "spare" in shown.stdout, shown.stdout + shown.stderr
        kill_node(job.wait_step(state["step"] + 3), 1)
        assert job.finish() == 0, job.log()[-3000:]
        promoted = by_event(job.events(), "spare_promoted")
        assert promoted and promoted[0]["node"] not in {n["node_id"] for n in state["nodes"]}
        assert late.wait(timeout=30) == 0
    finally:
        if late.poll() is None:
            late.kill()
    assert_identical(job.out, ref2)

"""Stragglers end to end with real processes: `phoenixrun inject --fault slow:5` makes one node's workers compute
five times slower; the master reports it (`straggler` event) and, with --replace-stragglers, drains it to the
spare - nothing replayed - and the job ends bit-identical to a fault-free torchrun run."""
import pytest

from phoenixrun.status import client_for
from tests.harness import assert_identical, by_event, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


@pytest.mark.timeout(900)   # minutes at a load average of 25 on 2 cores
def test_a_slow_node_is_reported_and_drained(tmp_path):
    ref = torchrun(tmp_path, "ref", nproc=2, steps=STEPS)
    job = launch(tmp_path, "slow", nnodes=2, nproc=1, spares=1, steps=STEPS,
                 extra_flags=["--replace-stragglers", "--straggler-window", "4", "--straggler-ratio", "2"],
                 PHOENIXRUN_TEST_PAUSE="d2h:2+")
    # held at step 2 until the spare is warm: a straggler is drained only onto a warm spare (a cold one paused the
    # job while its workers started), and on a loaded machine 40 steps ended before the spare's workers were up
    job.wait_file(tmp_path / "paused-d2h", timeout=300)
    state = job.wait_for(lambda s: any(n["role"] == "spare" and n.get("warm_ready") for n in s.get("nodes", [])),
                         timeout=300, what="a warm spare")
    slow = next(n for n in state["nodes"] if n["slot"] == 1)
    # through the authenticated API in-process: on a loaded machine the CLI's start-up alone outlasted the job
    # (the command itself is tested in test_fault_matrix.py)
    reply = client_for(job.run_dir, None, None).post("/v1/inject", {"slot": 1, "fault": "slow:8"})
    assert reply["node"] == slow["node_id"]
    (tmp_path / "release-d2h").touch()
    assert job.finish(timeout=600) == 0, job.log()[-3000:]
    ev = job.events()
    found = by_event(ev, "straggler")
    assert [(e["node"], e["slot"], e["replace"]) for e in found][:1] == [(slow["node_id"], 1, True)], found
    assert found[0]["ratio"] >= 2
    req = by_event(ev, "drain_requested")
    assert [(e["node"], e["by"], e["accepted"]) for e in req] == [(slow["node_id"], "straggler", True)]
    done = by_event(ev, "recovery_done")
    assert [(d["cause"], d["drained_node"]) for d in done] == [("drain", slow["node_id"])]
    assert done[0]["replayed_steps"] <= 1, done     # no pause point holds this job: at most one, as for a fault
    assert not by_event(ev, "fault_detected")
    assert_identical(job.out, ref)

"""FSDP2 and HSDP protected by construction, end to end: kill a node, check the final state bit for bit.

examples/train_fsdp2.py runs unmodified under torchrun (the fault-free reference) and under phoenixrun (2 nodes x 2
ranks + 1 spare). Every DTensor's local shard is rank-private: the replaced ranks restore theirs from their own
replicas, never from a "data-parallel peer" that holds another shard (runtime/snapshot.py StateBinding).
"""
import pytest

from tests.harness import ROOT, assert_identical, by_event, kill_node, launch, torchrun

SCRIPT = ROOT / "examples" / "train_fsdp2.py"
STEPS = 12
HSDP = ["--hsdp", "--shard", "2"]     # mesh (replicate=2, shard=2): shards within a node, replicas across nodes
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref_fsdp(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref_fsdp"), "ref", nproc=4, steps=STEPS, script=SCRIPT)


def _hot_swapped(job, slot: int) -> dict:
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert len(done) == 1, job.log()[-3000:]
    assert done[0]["replayed_steps"] <= 1
    promoted = by_event(ev, "spare_promoted")[0]["node"]
    assert done[0]["replaced_slots"] == {str(slot): promoted}
    return done[0]


def test_fsdp2_node_kill(tmp_path, ref_fsdp):
    job = launch(tmp_path, "fsdp2", nnodes=2, spares=1, steps=STEPS, script=SCRIPT)
    kill_node(job.wait_step(4), slot=1)
    _hot_swapped(job, 1)
    assert_identical(job.out, ref_fsdp)


def test_fsdp2_rank0_node_kill(tmp_path, ref_fsdp):
    job = launch(tmp_path, "fsdp2r0", nnodes=2, spares=1, steps=STEPS, script=SCRIPT)
    kill_node(job.wait_step(4), slot=0)
    _hot_swapped(job, 0)
    assert_identical(job.out, ref_fsdp)


def test_hsdp_node_kill(tmp_path):
    ref = torchrun(tmp_path, "ref_hsdp", nproc=4, steps=STEPS, script=SCRIPT, script_args=HSDP)
    job = launch(tmp_path, "hsdp", nnodes=2, spares=1, steps=STEPS, script=SCRIPT, script_args=HSDP)
    kill_node(job.wait_step(4), slot=1)
    _hot_swapped(job, 1)
    assert_identical(job.out, ref)

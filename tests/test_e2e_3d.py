"""3D parallelism (pipeline x data x tensor, FSDP2 over dp) protected end to end: kill a node, compare bit for bit.

examples/train_3d.py runs unmodified under torchrun (the fault-free reference, 8 ranks) and under phoenixrun
(4 nodes x 2 ranks + 1 spare; each node one TP pair of one stage). Every parameter and optimizer tensor is a
DTensor (TP-sharded over tp, FSDP-sharded over dp), so all of it is rank-private: the replaced ranks restore
their own shards from their replicas. The pipeline schedule is rebuilt on every rank after the recovery
(`job.on_restore`), or the stages' first P2P messages would not match.
"""
import pytest

from tests.harness import ROOT, assert_identical, by_event, kill_node, launch, torchrun

SCRIPT = ROOT / "examples" / "train_3d.py"
STEPS = 8
MODEL = ["--layers", "2", "--d-model", "32", "--vocab", "64", "--seq", "8", "--batch", "4"]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref_3d(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref_3d"), "ref", nproc=8, steps=STEPS, script=SCRIPT, model_args=MODEL)


@pytest.mark.parametrize("slot, at_step", [(3, 4), (0, 1)], ids=["last-stage-node", "rank0-node-at-step-1"])
def test_3d_node_kill_is_bit_identical(tmp_path, ref_3d, slot, at_step):
    job = launch(tmp_path, "3d", nnodes=4, spares=1, steps=STEPS, script=SCRIPT, model_args=MODEL)
    kill_node(job.wait_step(at_step, timeout=240), slot=slot)
    assert job.finish(timeout=300) == 0, job.log()[-3000:]
    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert len(done) == 1, job.log()[-3000:]
    assert done[0]["replayed_steps"] <= 1
    assert done[0]["replaced_slots"] == {str(slot): by_event(ev, "spare_promoted")[0]["node"]}
    assert_identical(job.out, ref_3d)

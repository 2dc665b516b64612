"""3D parallelism (pipeline x data x tensor, FSDP2 over dp) protected end to end: kill a node, compare bit for bit.

examples/train_3d.py runs unmodified under torchrun (the fault-free reference, 8 ranks) and under phoenixrun
(4 nodes x 2 ranks + 2 spares; each node one TP pair of one stage). Every parameter and optimizer tensor is a
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


def test_3d_node_kills_are_bit_identical(tmp_path, ref_3d):
    """Rank 0's node (first stage) killed at step 1, then a last-stage node at step 4: two hot swaps, one run."""
    job = launch(tmp_path, "3d", nnodes=4, spares=2, steps=STEPS, script=SCRIPT, model_args=MODEL)
    for n, (slot, at_step) in enumerate([(0, 1), (3, 4)], start=1):
        kill_node(job.wait_step(at_step, timeout=240), slot=slot)
        job.wait_for(lambda _: len(by_event(job.events(), "recovery_done")) >= n, timeout=240,
                     what=f"recovery {n} done")
    assert job.finish(timeout=300) == 0, job.log()[-3000:]
    ev = job.events()
    done, promoted = by_event(ev, "recovery_done"), by_event(ev, "spare_promoted")
    assert len(done) == 2, job.log()[-3000:]
    assert all(d["replayed_steps"] <= 1 for d in done)
    assert [d["replaced_slots"] for d in done] == [{"0": promoted[0]["node"]}, {"3": promoted[1]["node"]}]
    assert_identical(job.out, ref_3d)

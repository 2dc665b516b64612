"""Persistent fallback with real processes: agents write DCP checkpoints off the training path, and
the job falls back to them when in-memory recovery is impossible, or resumes from them when started
again on the same run directory."""
import signal
import time

import pytest

from phoenixrun import persist
from tests.harness import assert_identical, by_event, kill_node, launch, torchrun

pytestmark = pytest.mark.e2e
STEPS = 200      # long enough for the checkpoint I/O process to be up and writing before the end


@pytest.fixture(scope="module")
def ref3(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref3"), "ref", nproc=3, steps=STEPS)


def wait_checkpoint(job, world: int, at_least: int, timeout: float = 120.0) -> int:
    """The newest complete checkpoint on disk, once one of step >= at_least exists."""
    root = job.run_dir / "checkpoints"
    deadline = time.time() + timeout
    while time.time() < deadline:
        step = persist.newest_complete(root, world)
        if step is not None and step >= at_least:
            return step
        assert job.proc.poll() is None, job.log()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no complete checkpoint of step >= {at_least}:\n{job.log()[-3000:]}")


def test_owner_and_replica_holder_lost_together_falls_back_to_disk(tmp_path, ref3):
    # 3 nodes x 1 rank, one replica per shard: rank 0's replica lives on slot 1, so losing slots 0
    # and 1 together leaves rank 0's optimizer shard nowhere in memory
    job = launch(tmp_path, "both", nnodes=3, nproc=1, spares=2, steps=STEPS, extra_flags=["--persist-every", "10"])
    wait_checkpoint(job, 3, at_least=10)
    state = job.wait_step(1)
    kill_node(state, 0)
    kill_node(state, 1)
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    failed = by_event(ev, "recovery_failed")
    assert failed and "rank 0" in failed[0]["reason"], failed
    fb = by_event(ev, "fallback_restart")
    assert len(fb) == 1 and fb[0]["restore_step"] % 10 == 0 and fb[0]["restore_step"] >= 10
    assert by_event(ev, "fallback_done")
    assert len(by_event(ev, "spare_promoted")) == 2
    assert_identical(job.out, ref3)              # deterministic replay from the checkpoint's step


def test_preempted_job_resumes_from_its_run_directory_skipping_a_damaged_checkpoint(tmp_path, ref3):
    flags = ["--persist-every", "10", "--persist-keep", "3"]
    job = launch(tmp_path, "pre", nnodes=3, nproc=1, steps=STEPS, extra_flags=flags)
    wait_checkpoint(job, 3, at_least=20)
    job.proc.send_signal(signal.SIGTERM)         # preemption: agents persist what is committed, then exit
    assert job.proc.wait(timeout=60) != 0
    root = job.run_dir / "checkpoints"
    newest = persist.newest_complete(root, 3)
    older = persist.newest_complete(root, 3, exclude=[newest])
    assert older is not None and newest > older
    # bit rot in the newest checkpoint: one flipped byte in one rank's data file
    data = persist.rank_dir(root, newest, 1) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0x01
    data.write_bytes(bytes(raw))

    again = launch(tmp_path, "pre", nnodes=3, nproc=1, steps=STEPS, extra_flags=flags)
    assert again.finish() == 0, again.log()[-3000:]
    ev = again.events()
    assert [e["step"] for e in by_event(ev, "checkpoint_rejected")] == [newest]
    fb = by_event(ev, "fallback_restart")
    assert [f["restore_step"] for f in fb][-2:] == [newest, older] and "resuming" in fb[-1]["reason"]
    assert_identical(again.out, ref3)            # never resumed from the damaged one


def test_owner_and_replica_holder_killed_apart_fall_back_with_warm_workers(tmp_path, ref3):
    """The second loss arrives while the first is being recovered: the cascade finds rank 0's shard nowhere in
    memory and falls back to disk; the promoted spares keep their warm workers."""
    # training holds at step 30 (one worker's snapshot copy pauses; the others wait for it in a collective):
    # the kills land mid-job however fast or slow this machine is. The first recovery is held while the spare
    # fetches rank 0's state from slot 1 (on an idle machine it takes ~30 ms: a kill 0.2 s later missed it)
    job = launch(tmp_path, "apart", nnodes=3, nproc=1, spares=2, steps=STEPS, extra_flags=["--persist-every", "10"],
                 PHOENIXRUN_TEST_PAUSE="d2h:30,fetch+")
    job.wait_file(tmp_path / "paused-d2h")
    wait_checkpoint(job, 3, at_least=20)
    state = job.wait_for(lambda s: sum(n["role"] == "spare" and n["warm_ready"] for n in s["nodes"]) == 2,
                         what="warm spares ready")
    kill_node(state, 0)
    job.wait_file(tmp_path / "paused-fetch")
    kill_node(state, 1)
    (tmp_path / "release-fetch").touch()
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    fb, done = by_event(ev, "fallback_restart"), by_event(ev, "fallback_done")
    assert fb and done and fb[-1]["restore_step"] == 20, fb
    assert len(by_event(ev, "spare_promoted")) == 2
    assert_identical(job.out, ref3)

"""A rank restored on a spare gets its parameters from a "DP peer": the bytes must be the ones the lost rank
sealed itself (its checksum travels with its replica). Real /dev/shm slot files, no processes."""
from pathlib import Path

import pytest

from phoenixrun.agents.slots import IntegrityError, LocalSlots, SlotError
from phoenixrun.slot_format import SlotHeader
from tests.harness import by_event, kill_node

STEP = 7
SIZE = 256


def seal(slots: LocalSlots, rank: int, private: bytes, shared: bytes, step: int = STEP) -> tuple[bytes, bytes]:
    """Write, seal and commit snapshot `step` of `rank` as its worker and agent would; return (replicated prefix,
    shared region). (tests/test_fetch_once.py uses it too.)"""
    h = SlotHeader(step=step, meta_cap=64, meta_len=2, private_len=len(private), shared_len=len(shared))
    slots.allocate(rank, h.total_len)
    idx = slots.begin_write(rank)
    mm = slots.view(rank, idx)
    mm[64:66] = b"{}"
    mm[h.private_off:h.private_off + len(private)] = private
    mm[h.shared_off:h.shared_off + len(shared)] = shared
    mm[:64] = h.pack()
    sealed = slots.finish_write(rank, idx, step)
    slots.commit(rank, idx, step)
    return bytes(mm[:sealed.replicated_len]), bytes(mm[sealed.shared_off:sealed.shared_off + sealed.shared_len])


@pytest.fixture
def node():
    """Two agents' slot memories: the lost node's (what it sealed) and the spare's."""
    lost, spare = LocalSlots(prefix="phoenixrun-test-integrity-lost"), LocalSlots(prefix="phoenixrun-test-integrity-spare")
    yield lost, spare
    lost.clear()
    spare.clear()


def test_the_lost_ranks_own_bytes_are_installed(node):
    lost, spare = node
    replica, shared = seal(lost, 1, b"\x01" * 64, bytes(range(256)))
    spare.install(1, replica, shared, STEP)
    assert spare.available() == {1: [STEP]}
    mm = spare.view(1, spare.slot_of(1, STEP))
    h = SlotHeader.unpack(mm)
    assert bytes(mm[h.shared_off:h.shared_off + h.shared_len]) == shared


@pytest.mark.parametrize("wrong", [
    pytest.param(lambda s: bytes(reversed(s)), id="another stage's parameters, same size"),
    pytest.param(lambda s: s[:-1] + bytes([s[-1] ^ 1]), id="one bit flipped"),
])
def test_a_right_size_wrong_payload_is_refused(node, wrong):
    lost, spare = node
    replica, shared = seal(lost, 1, b"\x01" * 64, bytes(range(256)))
    bad = wrong(shared)
    assert len(bad) == len(shared) and bad != shared
    with pytest.raises(IntegrityError, match=r"rank 1 step 7: the parameters fetched from its DP peer do not match "
                                             r"the checksum rank 1 recorded"):
        spare.install(1, replica, bad, STEP)
    assert spare.available().get(1, []) == []          # nothing was committed for that rank


def test_a_peer_that_is_another_rank_is_refused(node):
    """The pure pipeline case: the "peer" is rank 0 (stage 0), the lost rank is rank 1 (stage 1), same sizes."""
    lost, spare = node
    _, stage0 = seal(lost, 0, b"\x00" * 64, bytes([3]) * SIZE)
    replica1, _ = seal(lost, 1, b"\x01" * 64, bytes([5]) * SIZE)
    with pytest.raises(IntegrityError, match="does not hold the same replicated state"):
        spare.install(1, replica1, stage0, STEP)


def test_wrong_size_and_corrupt_replica_are_refused(node):
    lost, spare = node
    replica, shared = seal(lost, 1, b"\x01" * 64, bytes(range(256)))
    with pytest.raises(IntegrityError, match="255 bytes, expected 256"):
        spare.install(1, replica, shared[:-1], STEP)
    corrupt = bytearray(replica)
    corrupt[-1] ^= 0xFF
    with pytest.raises(IntegrityError, match="fails its checksum"):
        spare.install(1, bytes(corrupt), shared, STEP)
    assert issubclass(IntegrityError, SlotError)       # the agent's restore path reports it (restore_failed)


PP = Path(__file__).resolve().parent / "scripts" / "pp_two_stages.py"


@pytest.mark.e2e
def test_pipeline_stage_is_never_restored_from_the_other_stage(tmp_path):
    """Pure PP, 2 stages, no --pp: phoenixrun's plan takes the other stage for a DP peer. Both stages start from the
    same weights (protect()'s start-up comparison passes), then diverge: before, a node kill ended in exit 0 with
    stage 1 holding stage 0's weights, then in a refused restore. The model is not DDP, so nothing proves the
    "peer" holds its bytes: its weights are rank-private, and the hot swap ends bit-identical to a fault-free
    torchrun run."""
    import json
    import subprocess

    from tests.harness import BIN, env
    from tests.test_process_groups import launch_script
    args = ["--steps", "12", "--same-init"]
    subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(PP), *args, "--out",
                    str(tmp_path / "ref")], check=True, env=env(), cwd=tmp_path, capture_output=True, timeout=300)
    job = launch_script(tmp_path, "pp", PP, [*args, "--step-seconds", "0.1"], nnodes=2, nproc=1, spares=1)
    kill_node(job.wait_step(4), slot=1)
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    assert len(by_event(ev, "recovery_done")) == 1 and not by_event(ev, "recovery_failed"), job.log()[-3000:]
    for r in (0, 1):
        ref = json.loads((tmp_path / "ref" / f"rank{r}.json").read_text())
        got = json.loads((job.out / f"rank{r}.json").read_text())
        assert (got["param_sha256"], got["losses"]) == (ref["param_sha256"], ref["losses"]), f"stage {r} differs"
    assert "snapshotted as rank-private and replicated" in job.log() and "not DDP" in job.log()


@pytest.fixture(scope="module")
def ref3(tmp_path_factory):
    from tests.harness import torchrun
    return torchrun(tmp_path_factory.mktemp("ref3"), "ref", nproc=3, steps=STEPS3)


STEPS3 = 16


def _corrupt_holder_job(tmp_path, name: str, corrupt: str, *flags: str):
    """3 nodes x 1 rank + 1 spare, two replica holders per rank; node 1 killed at step 5; `corrupt`: whose
    replica bytes go bad as they are served (phoenixrun/testing.py corrupt_point)."""
    from tests.harness import launch
    job = launch(tmp_path, name, nnodes=3, nproc=1, spares=1, steps=STEPS3,
                 extra_flags=["--replicas", "2", *flags], PHOENIXRUN_TEST_CORRUPT=corrupt)
    kill_node(job.wait_step(5), slot=1)
    assert job.finish() == 0, job.log()[-3000:]
    return job, job.events()


@pytest.mark.smoke
@pytest.mark.e2e
def test_a_corrupt_replica_is_refused_and_the_next_holder_restores(tmp_path, ref3):
    """--replicas 2: the first holder asked serves rank 1's replica with one bit flipped. The spare's agent refuses
    it (its checksum), says so, and restores from the second holder: bit-identical to a fault-free torchrun run."""
    from tests.harness import assert_identical
    job, ev = _corrupt_holder_job(tmp_path, "one-bad", "get_private")
    plan = by_event(ev, "recovery_plan")[0]
    assert len(plan["fetch"]["1"]["private"]) == 2, plan          # both holders named, in order
    refused = by_event(ev, "restore_refused")
    assert [(r["rank"], r["part"], r["integrity"], r["addr"]) for r in refused] == \
        [(1, "private", True, plan["fetch"]["1"]["private"][0])], refused
    assert "fails its checksum" in refused[0]["reason"]
    assert len(by_event(ev, "recovery_done")) == 1 and not by_event(ev, "recovery_failed")
    assert_identical(job.out, ref3)


@pytest.mark.e2e
def test_every_holder_corrupt_is_a_refused_restore_then_the_fallback(tmp_path, ref3):
    """Every holder's copy bad: each is refused in turn, then the restore (integrity): in-memory recovery is
    impossible and the job takes its fallback (no checkpoint here: a torchrun-style restart), still bit-identical."""
    from tests.harness import assert_identical
    job, ev = _corrupt_holder_job(tmp_path, "all-bad", "get_private*", "--max-restarts", "1")
    plan = by_event(ev, "recovery_plan")[0]
    refused = by_event(ev, "restore_refused")
    assert [(r["part"], r["integrity"], r["addr"]) for r in refused] == \
        [("private", True, a) for a in plan["fetch"]["1"]["private"]], refused
    failed = by_event(ev, "recovery_failed")
    assert len(failed) == 1 and "every source of its private state was refused" in failed[0]["reason"], failed
    assert len(by_event(ev, "restart")) == 1 and not by_event(ev, "recovery_done")
    assert_identical(job.out, ref3)

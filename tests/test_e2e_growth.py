"""End to end: snapshots that grow with the state (issue 20).

`--state-growth 4096` makes the example's state dict grow by 4 KiB a step, so the first metadata layout
(64 KiB + 256 B a tensor, about 75 KiB for this model) is outgrown at about step 18 and the doubled one at
about 37: on the code before growth the job livelocked there (a "transient" local reset to the same
step, again and again).
"""
import json
import re

import pytest

from tests.harness import assert_identical, by_event, kill_node, launch, results, torchrun

STEPS = 40
GROWTH = ["--state-growth", "4096"]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    """The unprotected reference: torchrun, 2 ranks, the same growing state."""
    return torchrun(tmp_path_factory.mktemp("ref2"), "ref", nproc=2, steps=STEPS, script_args=GROWTH)


def _slot_bytes(stats_dir, rank: int) -> dict[int, int]:
    """step -> bytes of a slot laid out for that snapshot (the worker's per-step protection figures)."""
    lines = (stats_dir / f"rank{rank}.jsonl").read_text().splitlines()
    return {s["step"]: s["slot_bytes"] for s in map(json.loads, lines)}


def _same_state(a, b) -> None:
    ra, rb = results(a), results(b)
    for r in ra:
        assert ra[r]["state_sha256"] == rb[r]["state_sha256"], f"rank {r}: the restored state dict differs"


@pytest.mark.smoke
def test_state_growing_past_the_first_layout_needs_no_recovery(tmp_path, ref2):
    stats = tmp_path / "stats"
    stats.mkdir()
    job = launch(tmp_path, "grow", nnodes=1, nproc=2, steps=STEPS, script_args=GROWTH,
                 PHOENIXRUN_STATS_DIR=str(stats))
    assert job.finish() == 0, job.log()[-3000:]
    faults = by_event(job.events(), "fault_detected")
    assert not faults, f"a fault-free run needed recoveries: {faults[:2]}"
    for rank in (0, 1):
        sizes = _slot_bytes(stats, rank)
        layouts = sorted(set(sizes.values()))
        assert len(layouts) >= 2, f"rank {rank}: the snapshot never outgrew its first layout ({layouts})"
        # geometric headroom: 160 KiB of growth is a couple of re-layouts, not one a step
        assert len(layouts) <= 3, f"rank {rank}: re-laid out {len(layouts) - 1} times: {layouts}"
    assert_identical(job.out, ref2)
    _same_state(job.out, ref2)


def test_node_lost_after_the_replicas_grew_recovers_bit_identically(tmp_path, ref2):
    stats = tmp_path / "stats"
    stats.mkdir()
    job = launch(tmp_path, "growkill", nnodes=2, nproc=1, spares=1, steps=STEPS, script_args=GROWTH,
                 PHOENIXRUN_STATS_DIR=str(stats))
    state = job.wait_step(25, timeout=240)     # past the first layout (about step 18): snapshots and replicas grew
    kill_node(state, 1)
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert done and done[0]["replaced_slots"], job.log()[-3000:]
    plan = by_event(ev, "recovery_plan")[-1]
    assert set(plan["fetch"]) == {"1"}            # the spare took rank 1 from its replica holder
    grown_before_kill = [s for s in _slot_bytes(stats, 1).items() if s[0] <= plan["restore_step"]]
    assert len({b for _, b in grown_before_kill}) >= 2, "the kill came before any re-layout: the test is void"
    assert_identical(job.out, ref2)
    _same_state(job.out, ref2)


def _limit_file_size(nbytes: int):
    def apply():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))   # Python ignores SIGXFSZ: writes get EFBIG
    return apply


def test_a_snapshot_that_cannot_grow_stops_the_job_with_a_clear_error_not_a_loop(tmp_path):
    # files of at most 1.5 MB (a real limit, inherited by the agent): the first slots (~0.6 MB) fit, the state
    # grows 64 KiB a step and its slots cannot follow past ~20 steps
    limit = 1_500_000
    job = launch(tmp_path, "full", nnodes=1, nproc=2, steps=60, script_args=["--state-growth", "65536"],
                 preexec_fn=_limit_file_size(limit))
    assert job.finish() != 0, job.log()[-3000:]
    ev = job.events()
    faults = by_event(ev, "fault_detected")
    assert [(f["signal"], f["class"], f["action"]) for f in faults] == [("health", "host_pcie", "external_fallback")], \
        faults
    reason = by_event(ev, "job_finished")[-1]["reason"]
    assert "snapshot memory exhausted: cannot allocate" in reason and "File too large" in reason, reason
    assert "phoenixrun.protect()" in reason and re.search(r"\(rank [01] on slot 0\)", reason), reason
    assert not by_event(ev, "recovery_started"), "a fault that cannot be recovered from was retried"

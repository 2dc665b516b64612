"""End to end: a DataLoader loop's data position across a hot swap (issue 28).

A DDP loop over a DataLoader + DistributedSampler, several epochs, an LR scheduler; one node SIGKILLed mid-epoch
while the job is held (one rank's snapshot copy paused at step 12), a warm spare takes its place. Given to protect()
(`data=`, `stateful=`), every rank - the survivor with its own process and the replacement - replays exactly the
batches, learning rates and updates of a fault-free torchrun run. Keeping its own iterator (the naive loop), the job
must not finish as if nothing happened: the survivor's replay is caught on other inputs and the job stops, naming the
fix.
"""

import pytest

from tests.harness import ROOT, by_event, kill_node, launch, results, torchrun

SCRIPT = ROOT / "tests" / "scripts" / "dataloader_loop.py"
STEPS = 40      # 5 epochs of 8 batches a rank: the fault lands in the second
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref"), "ref", nproc=2, steps=STEPS, script=SCRIPT, model_args=[])


def _kill_held(job, tmp_path, slot: int) -> tuple[dict, dict]:
    job.wait_file(tmp_path / "paused-d2h")
    state = job.wait_for(lambda s: len(s.get("nodes", [])) == 3, what="every node registered")
    survivor = next(n for n in state["nodes"] if n["role"] == "active" and n["slot"] != slot)
    killed = kill_node(state, slot)
    (tmp_path / "release-d2h").touch()
    return killed, survivor


@pytest.mark.smoke
def test_a_protected_loader_replays_the_fault_free_batches(tmp_path, ref):
    job = launch(tmp_path, "managed", nnodes=2, nproc=1, spares=1, steps=STEPS, script=SCRIPT, model_args=[],
                 script_args=["--mode", "managed"], PHOENIXRUN_TEST_PAUSE="d2h:12+")
    _, survivor = _kill_held(job, tmp_path, slot=1)
    assert job.finish() == 0, job.log()[-3000:]
    done = by_event(job.events(), "recovery_done")
    assert len(done) == 1 and done[0]["replaced_slots"] and done[0]["replayed_steps"] <= 1, job.log()[-3000:]
    got, want = results(job.out), results(ref)
    assert got.keys() == want.keys() == {0, 1}
    for r in want:   # every step's sample indices, learning rate and loss; the final parameters and momenta
        same = {k: v for k, v in got[r].items() if k not in ("pid", "generation")}
        assert same == {k: v for k, v in want[r].items() if k not in ("pid", "generation")}, \
            f"rank {r} differs from the fault-free run"
    mine = next(r for r in got.values() if r["pid"] in survivor["worker_pids"])   # the survivor kept its process
    assert mine["generation"] == 1


def test_a_loop_that_keeps_its_own_iterator_is_stopped_not_silently_wrong(tmp_path):
    job = launch(tmp_path, "naive", nnodes=2, nproc=1, spares=1, steps=STEPS, script=SCRIPT, model_args=[],
                 script_args=["--mode", "naive"], PHOENIXRUN_TEST_PAUSE="d2h:12+")
    _kill_held(job, tmp_path, slot=1)
    code = job.finish()
    log = job.log()
    assert code != 0, log[-3000:]
    assert "was replayed on other inputs" in log and "data=loader" in log, log[-3000:]
    assert not list(job.out.glob("rank*.json"))          # nothing finished as if it were right
    assert by_event(job.events(), "job_finished")[-1]["exit_code"] != 0


def test_a_collective_only_the_replacement_issues_fails_at_once_naming_it(tmp_path):
    """A restored process that broadcasts once at its first batch (what accelerate's loader does on its first
    `next()`) while the survivor goes on to its gradient all-reduce: the job stops with the op and the script's line
    named on both ranks, not after the collective timeout (set far beyond the test's own limit here)."""
    job = launch(tmp_path, "rogue", nnodes=2, nproc=1, spares=1, steps=STEPS, script=SCRIPT, model_args=[],
                 script_args=["--mode", "rogue"], extra_flags=["--collective-timeout", "900"],
                 PHOENIXRUN_TEST_PAUSE="d2h:12+")
    _kill_held(job, tmp_path, slot=1)
    code = job.finish()
    log = job.log()
    assert code != 0, log[-3000:]
    assert "collective mismatch in the first step after a recovery" in log, log[-3000:]
    assert "broadcast at" in log and "dataloader_loop.py" in log and "allreduce at" in log, log[-3000:]
    assert not list(job.out.glob("rank*.json"))


@pytest.mark.parametrize("order", ["--compile", "--compile-ddp"])
def test_a_compiled_module_is_hot_swapped_bit_identical(tmp_path, order):
    """torch.compile'd before DDP wraps it (nanoGPT's order) or after (the aot_eager backend: dynamo's graphs and
    AOTAutograd without a C++ toolchain's minutes): the survivor's compiled graphs keep running on the restored
    parameters, the replacement compiles its own, and every step matches a fault-free torchrun run of the same
    compiled loop."""
    args = ["--mode", "managed", order, "aot_eager"]
    want = results(torchrun(tmp_path, "ref-compiled", nproc=2, steps=STEPS, script=SCRIPT, model_args=[],
                            script_args=args))
    job = launch(tmp_path, "compiled", nnodes=2, nproc=1, spares=1, steps=STEPS, script=SCRIPT, model_args=[],
                 script_args=args, PHOENIXRUN_TEST_PAUSE="d2h:12+")
    _kill_held(job, tmp_path, slot=1)
    assert job.finish() == 0, job.log()[-3000:]
    assert len(by_event(job.events(), "recovery_done")) == 1, job.log()[-3000:]
    got = results(job.out)
    for r in want:
        assert {k: v for k, v in got[r].items() if k not in ("pid", "generation")} == \
               {k: v for k, v in want[r].items() if k not in ("pid", "generation")}, f"rank {r} differs"

"""End to end with real processes: survivors in long steps quiesce at their next gradient bucket and keep their
processes (issue 17 item 4).

The script's steps take about 10 s, nearly all of it in backward, with a DDP bucket's all-reduce between two 0.5 s
sleeps (tests/scripts/long_steps.py). A node is SIGKILLed early in a step; the survivors compute without a
collective, so the master learns of it from the missing heartbeats (--node-timeout 3). Before this change the
survivors then ran the rest of their backward before they noticed (the next collective's wait is at its end),
about 6.5 s, past the agents' constant 5 s quiesce grace: they were killed and respawned. Now each acknowledges
the quiesce at its next bucket, and the grace follows the measured step time anyway.
"""
from pathlib import Path

import pytest

from tests.harness import ROOT, assert_identical, by_event, kill_node, launch, results, torchrun

SCRIPT = ROOT / "tests" / "scripts" / "long_steps.py"
LAYERS, SLEEP, STEPS = 20, 0.5, 2
pytestmark = pytest.mark.e2e


def _started(prog: Path, rank: int, step: int) -> bool:
    p = prog / f"start{rank}.log"
    return p.exists() and any(line.split()[0] == str(step) for line in p.read_text().splitlines() if line)


def test_survivors_of_a_long_step_quiesce_at_the_next_bucket_and_keep_their_processes(tmp_path):
    prog = tmp_path / "progress"
    args = ["--layers", str(LAYERS), "--sleep", str(SLEEP), "--progress-dir", str(prog)]
    job = launch(tmp_path, "long", nnodes=3, nproc=1, spares=1, steps=STEPS, script=SCRIPT, model_args=[],
                 script_args=args, extra_flags=["--node-timeout", "3"])
    # S_1 committed on every rank (the state after step 0): every rank is in step 1's sleeps
    job.wait_step(1, timeout=240)
    state = job.wait_for(lambda s: all(_started(prog, r, 1) for r in range(3)), what="every rank in step 1")
    before = {n["slot"]: n["worker_pids"] for n in state["nodes"] if n["role"] == "active"}
    kill_node(state, slot=1)
    assert job.finish(timeout=240) == 0, job.log()[-3000:]

    ev = job.events()
    done = by_event(ev, "recovery_done")
    assert len(done) == 1 and done[0]["attempts"] == 1, done
    assert done[0]["restored_step"] == 1 and done[0]["replayed_steps"] <= 1, done
    # the survivors (slots 0 and 2: ranks 0 and 2) finished in the processes they had before the kill: none was
    # killed for missing its quiesce grace, none restarted
    res = results(job.out)
    for slot in (0, 2):
        assert [res[slot]["pid"]] == before[slot], (slot, before, res[slot]["pid"], job.log()[-3000:])
    assert not [f for f in by_event(ev, "fault_detected") if f.get("slot") != 1], by_event(ev, "fault_detected")

    # the quiesce did not wait for the step's end: quiesce order -> every survivor acknowledged, against a
    # fault-free step (before: the rest of the backward, or the 5 s grace and a respawn)
    quiesce_s = done[0]["phases"]["quiesce_s"]
    step_s = min(r["step_seconds"][0] for r in res.values())          # step 0: no fault in it
    assert step_s >= (LAYERS - 1) * SLEEP                              # (the first layer's input needs no grad)
    assert quiesce_s < 0.25 * step_s, (quiesce_s, step_s, done[0]["phases"])

    # bit-identical to a fault-free torchrun of the same job (the sleeps change no number)
    ref = torchrun(tmp_path, "ref", nproc=3, steps=STEPS, script=SCRIPT, model_args=[],
                   script_args=["--layers", str(LAYERS), "--sleep", "0"])
    assert_identical(job.out, ref)

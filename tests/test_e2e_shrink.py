"""Shrink and grow (docs/operations.md, "Shrink and grow"), end to end with real processes on the DDP + ZeRO
example: 3 nodes x 1 rank, no spare, --on-no-spare shrink. A node is SIGKILLed: the job goes on as 2 ranks (the
lost rank's ZeRO shard re-partitioned from its replica), a new agent registers and the job grows back to 3.
Asserted: the job finishes 0; job_shrunk and job_grown in events.jsonl and the shrunk world in `phoenixrun
status`; no optimizer state lost (the shards' Adam moments cover every parameter exactly once, and every one
counts all the job's steps: a moment lost on the way and recreated would count fewer); every rank holds the
same parameters."""
from __future__ import annotations

import subprocess

import pytest

from tests.harness import BIN, EXAMPLE, SMALL, by_event, env, kill_node, launch, results

STEPS = 60
PACE = ["--step-seconds", "0.5"]   # the small model's steps take 0.1 s: the grow-back must land before the end


@pytest.mark.smoke
@pytest.mark.e2e
def test_a_job_shrinks_without_a_spare_and_grows_back_when_one_registers(tmp_path):
    job = launch(tmp_path, "shrink", nnodes=3, nproc=1, spares=0, steps=STEPS,
                 extra_flags=["--on-no-spare", "shrink", "--spare-wait", "1"], script_args=PACE)
    kill_node(job.wait_step(4), slot=1)
    shrunk = job.wait_for(lambda s: s.get("active_nnodes") == 2 and s["phase"] == "running", what="the shrink")
    shown = subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(job.run_dir)],
                           capture_output=True, text=True, env=env(), timeout=60)
    assert shown.returncode == 0 and "shrunk: 2 of 3 nodes" in shown.stdout, shown.stdout + shown.stderr
    late = subprocess.Popen(
        [str(BIN / "phoenixrun"), "agent", "--rdzv-endpoint", shrunk["endpoint"], "--nproc-per-node", "1",
         "--heartbeat-interval", "0.1", "--secret-file", str(job.run_dir / "secret"), "--",
         str(EXAMPLE), "--steps", str(STEPS), "--out", str(job.out), *SMALL, *PACE],
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert job.finish() == 0, job.log()[-4000:]
        assert late.wait(timeout=60) == 0
    finally:
        if late.poll() is None:
            late.kill()
    events = job.events()
    s, g = by_event(events, "job_shrunk"), by_event(events, "job_grown")
    assert len(s) == 1 and (s[0]["was_world_size"], s[0]["world_size"]) == (3, 2), s
    assert len(g) == 1 and (g[0]["was_world_size"], g[0]["world_size"]) == (2, 3), g
    assert s[0]["restored_step"] < g[0]["restored_step"] < STEPS     # it trained shrunk, then grown
    assert by_event(events, "job_finished")[-1]["exit_code"] == 0
    res = results(job.out)
    assert sorted(res) == [0, 1, 2] and {r["world_size"] for r in res.values()} == {3}
    assert len({r["param_sha256"] for r in res.values()}) == 1       # no rank diverged from its DP peers
    numel = res[0]["param_numel"]
    assert sum(r["optim_numel"] for r in res.values()) == numel       # every parameter's moments, once
    assert all(r["optim_steps"] == [STEPS] for r in res.values()), {k: r["optim_steps"] for k, r in res.items()}
    assert all(len(r["losses"]) == STEPS for r in res.values())

"""torchrun semantics for scripts that do not use the phoenixrun API (PHOENIXRUN_PROTECT=0)."""
import os
import signal

import pytest

from tests.harness import assert_identical, by_event, launch, torchrun

STEPS = 16
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("ref"), "ref", nproc=4, steps=STEPS)


def _kill_one_worker(job):
    state = job.wait_for(lambda s: s["phase"] == "running" and all(
        len(n["worker_pids"]) == 2 for n in s["nodes"] if n["role"] == "active"), what="workers up")
    victim = next(n for n in state["nodes"] if n["slot"] == 1)["worker_pids"][1]
    os.kill(victim, signal.SIGKILL)
    return victim


def test_plain_script_restarts_and_completes(tmp_path, ref):
    job = launch(tmp_path, "plain", nnodes=2, steps=STEPS, extra_flags=["--max-restarts", "1"],
                 PHOENIXRUN_PROTECT="0")
    _kill_one_worker(job)
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    assert len(by_event(ev, "restart")) == 1
    assert by_event(ev, "job_finished")[-1]["exit_code"] == 0
    assert_identical(job.out, ref)          # a full restart replays from step 0: same result


def test_plain_script_without_restarts_fails_naming_rank(tmp_path):
    job = launch(tmp_path, "fail", nnodes=2, steps=STEPS, extra_flags=["--max-restarts", "0"],
                 PHOENIXRUN_PROTECT="0")
    _kill_one_worker(job)
    rc = job.finish()
    assert rc != 0
    fin = by_event(job.events(), "job_finished")[-1]
    assert fin["exit_code"] == rc and "rank 3" in fin["reason"], fin


def test_two_nodes_torchrun_style(tmp_path, ref):
    """Each node runs `phoenixrun --nnodes 2 --rdzv-endpoint ... --node-rank R` (rank 0 also hosts the master)."""
    import socket
    import subprocess

    from tests.harness import BIN, EXAMPLE, SMALL, env, results
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    e = env(PHOENIXRUN_SECRET="shared-by-the-scheduler")
    procs = [subprocess.Popen(
        [str(BIN / "phoenixrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--local-addr", "127.0.0.1", "--node-rank", str(r), "--run-dir", str(tmp_path / f"node{r}"), str(EXAMPLE),
         "--steps", str(STEPS), "--out", str(out), *SMALL], env=e, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sorted(results(out)) == [0, 1, 2, 3]
    assert_identical(out, ref)

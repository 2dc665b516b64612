"""An unmodified torchrun script (tests/scripts/plain_ddp.py: DDP over gloo, no phoenixrun API) gets
torchrun's semantics: restarts on any failure, a lost node replaced by a spare, each attempt on its
own rendezvous store, node ranks as given. Real processes throughout."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from phoenixrun.agents.phases import QUIESCE_GRACE_CAP_S
from tests.harness import BIN, Job, by_event, env

pytestmark = pytest.mark.e2e
PLAIN = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"
# the shortest --recovery-timeout phoenixrun takes (config.RULES: above the agents' 45 s quiesce grace cap)
RECOVERY_TIMEOUT_S = int(QUIESCE_GRACE_CAP_S) + 1


def plain(tmp: Path, name: str, nnodes: int = 2, nproc: int = 1, flags: list[str] | None = None,
          script_args: list[str] | None = None) -> Job:
    run_dir, out = tmp / f"{name}-run", tmp / f"{name}-out"
    log = open(tmp / f"{name}-run.log", "w")
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--run-dir", str(run_dir), "--heartbeat-interval", "0.1", *(flags or []), str(PLAIN),
           "--out", str(out), *(script_args or [])]
    return Job(run_dir, out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp))


def ranks(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def wait_progress(job: Job, step: int, world: int, timeout: float = 180.0) -> None:
    """Until every rank of the first attempt has finished `step` (the script's own progress files)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if job.proc.poll() is not None:
            raise AssertionError(f"job exited ({job.proc.returncode}) before step {step}:\n{job.log()[-3000:]}")
        done = [job.out / f"progress-{r}" for r in range(world)]
        if all(p.exists() and int((p.read_text() or "0 -1").split()[1]) >= step for p in done):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached:\n{job.log()[-3000:]}")


def assert_finished_after_one_restart(job: Job, world: int, steps: int) -> list[dict]:
    rc = job.finish()
    assert rc == 0, job.log()[-4000:]
    ev = job.events()
    assert len(by_event(ev, "restart")) == 1, [e["event"] for e in ev]
    res = ranks(job.out)
    assert sorted(res) == list(range(world))
    for r in res.values():      # every rank of the second attempt trained to the end
        assert r["attempt"] == 1 and len(r["losses"]) == steps and r["world"] == world
    # DDP keeps the replicas equal: a restart that mixed attempts or ranks would not
    assert len({r["param_sha256"] for r in res.values()}) == 1
    assert "connectFullMesh" not in job.log()
    return ev


def test_raise_once_restarts_and_finishes(tmp_path):
    job = plain(tmp_path, "raise", flags=["--max-restarts", "1"], script_args=["--steps", "6", "--fail-once", "1"])
    ev = assert_finished_after_one_restart(job, 2, 6)
    fault = by_event(ev, "fault_detected")[0]
    assert fault["rank"] == 1 and fault["returncode"] == 1


def test_worker_killed_mid_training_restarts_on_a_fresh_store(tmp_path):
    job = plain(tmp_path, "wkill", flags=["--max-restarts", "1"], script_args=["--steps", "12", "--step-sleep", "0.1"])
    wait_progress(job, 3, 2)
    state = job.current()
    assert {n["slot"]: n["ranks"] for n in state["nodes"]} == {0: [0], 1: [1]}   # status --json: where ranks run
    victim = next(n for n in state["nodes"] if n["slot"] == 1)["worker_pids"][0]
    os.kill(victim, signal.SIGKILL)
    ev = assert_finished_after_one_restart(job, 2, 12)
    started = by_event(ev, "master_started")[0]
    restart = by_event(ev, "restart")[0]
    assert restart["store_port"] not in (None, started.get("store_port"))


@pytest.mark.smoke
def test_node_killed_mid_training_restarts_with_the_spare(tmp_path):
    job = plain(tmp_path, "nkill", flags=["--max-restarts", "1", "--spares", "1"],
                script_args=["--steps", "12", "--step-sleep", "0.1"])
    wait_progress(job, 3, 2)
    state = job.current()
    node = next(n for n in state["nodes"] if n["slot"] == 1 and n["role"] == "active")
    spare = next(n for n in state["nodes"] if n["role"] == "spare")
    for pid in [node["agent_pid"], *node["worker_pids"]]:
        os.kill(pid, signal.SIGKILL)
    ev = assert_finished_after_one_restart(job, 2, 12)
    promoted = by_event(ev, "spare_promoted")
    assert [(p["slot"], p["node"]) for p in promoted] == [(1, spare["node_id"])]
    assert by_event(ev, "job_finished")[-1]["restarts"] == 1
    # one console line names the lost node, not the survivor whose worker died of it (issue 29 items 3, 4)
    lines = [x for x in job.log().splitlines() if "incident:" in x]
    assert len(lines) == 1 and f"incident: node lost on slot 1 (node {node['node_id']}, " in lines[0], lines
    assert "[node_lost: " in lines[0] and "-> torchrun-style restart 1, " in lines[0], lines


def test_restart_that_cannot_come_up_fails_within_bounded_time(tmp_path):
    """Rank 1 of the second attempt never reaches init_process_group: rank 0 would wait for it for the
    store timeout (30 min); the master stops the job naming rank 1 after 2 x --recovery-timeout (the shortest it
    takes: above the agents' quiesce grace cap, config.RULES)."""
    job = plain(tmp_path, "stall", flags=["--max-restarts", "1", "--recovery-timeout", str(RECOVERY_TIMEOUT_S)],
                script_args=["--steps", "6", "--fail-once", "0", "--stall-init", "1"])
    rc = job.finish(timeout=2 * RECOVERY_TIMEOUT_S + 180)
    assert rc == 1, job.log()[-3000:]
    ev = job.events()
    restart, fin = by_event(ev, "restart")[0], by_event(ev, "job_finished")[-1]
    assert "rank(s) [1] never reached init_process_group" in fin["reason"], fin
    assert fin["t"] - restart["t"] < 2 * RECOVERY_TIMEOUT_S + 30, fin["t"] - restart["t"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(tmp: Path, name: str, args: list[str], **extra_env: str) -> subprocess.Popen:
    """One node's `phoenixrun` (its own working directory, as on its own host), output to name.log."""
    cwd = tmp / name
    cwd.mkdir()
    e = env(PHOENIXRUN_SECRET="shared-by-the-scheduler", **extra_env)
    return subprocess.Popen([str(BIN / "phoenixrun"), *args], env=e, cwd=cwd, stdout=open(tmp / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)


def test_node_ranks_given_are_the_slots_whatever_the_join_order(tmp_path):
    """nanoGPT's documented command: node rank 1 started first still gets ranks 2-3."""
    port, out = _free_port(), tmp_path / "out"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--local-addr", "127.0.0.1"]
    script = [str(PLAIN), "--out", str(out), "--steps", "3"]
    one = _node(tmp_path, "n1", [*common, "--node-rank", "1", *script], NODE_TAG="1")
    deadline = time.time() + 60      # node 1's agent is up and polling for the master before node 0 starts
    while not any("agent" in c.cmdline() for c in psutil.Process(one.pid).children()):
        assert time.time() < deadline and one.poll() is None
        time.sleep(0.1)
    # which of the two registers first is a race once node 0's master is up; the ranks must follow the node ranks
    # either way, which is what is asserted
    zero = _node(tmp_path, "n0", [*common, "--node-rank", "0", *script], NODE_TAG="0")
    assert [p.wait(timeout=240) for p in (zero, one)] == [0, 0], (tmp_path / "n0.log").read_text()[-3000:]
    res = ranks(out)
    assert sorted(res) == [0, 1, 2, 3]
    for r, rec in res.items():
        assert rec["node_tag"] == rec["group_rank"] == str(r // 2), (r, rec)


def test_cluster_command_with_spares_on_every_node(tmp_path):
    """`phoenixrun --nnodes 1 --spares 1 --rdzv-endpoint HOST:PORT train.py` on 3 nodes: the rendezvous host
    runs the master, one node trains, one is a spare, the third is told it is not needed and exits 0.
    (The card's 64 + 2 on 66 nodes, at the smallest size.)"""
    port, out = _free_port(), tmp_path / "out"
    cmd = ["--nnodes", "1", "--nproc-per-node", "1", "--spares", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--local-addr", "127.0.0.1", str(PLAIN), "--out", str(out), "--steps", "4"]
    nodes = [_node(tmp_path, f"n{i}", cmd) for i in range(3)]
    codes = [p.wait(timeout=240) for p in nodes]
    logs = "\n".join((tmp_path / f"n{i}.log").read_text() for i in range(3))
    assert codes == [0, 0, 0], logs[-4000:]
    assert sorted(ranks(out)) == [0]
    # each node's run directory under .phoenixrun/ (without --rdzv-id a launch names its own: phoenixrun/runid.py)
    masters = [i for i in range(3) if list((tmp_path / f"n{i}" / ".phoenixrun").glob("*/master.json"))]
    assert len(masters) == 1, masters
    ev = [json.loads(x) for x in next((tmp_path / f"n{masters[0]}" / ".phoenixrun").glob("*/events.jsonl"))
          .read_text().splitlines()]
    roles = sorted(e["role"] for e in by_event(ev, "node_joined"))
    assert roles == ["active", "spare"], roles
    refused = by_event(ev, "node_refused")
    assert len(refused) == 1 and "not needed" in refused[0]["reason"]
    assert "this node is not needed" in logs


def test_agents_that_cannot_start_end_the_launcher_with_the_cause(tmp_path):
    """An agent that dies before registering (here: it cannot listen on its --local-addr) -> the launcher
    exits non-zero within seconds naming it, instead of waiting for the node forever."""
    port = _free_port()
    t0 = time.time()
    p = _node(tmp_path, "bad", ["--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--local-addr", "192.0.2.1", str(PLAIN), "--out", str(tmp_path / "out")])
    rc = p.wait(timeout=120)
    took = time.time() - t0
    log = (tmp_path / "bad.log").read_text()
    assert rc != 0 and took < 30, (rc, took, log[-2000:])
    assert "the agent of node 0 exited with code 1 before the job started" in log
    assert "Cannot assign requested address" in log, log[-2000:]


def test_non_editable_install_runs_from_the_repo_root(tmp_path):
    """`pip install .` (a wheel, not editable) and `phoenixrun` run from the checkout's root, where
    ./phoenixrun (without the agents subpackage) would shadow the installed package. A venv of its own
    (torch and the other dependencies from the dev venv through a .pth: no download, and not the dev venv's
    editable install, whose finder would supply phoenixrun.agents and hide the bug)."""
    import sysconfig
    root = Path(__file__).resolve().parents[1]
    target, venv = tmp_path / "site", tmp_path / "venv"
    subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(root)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    assert (target / "phoenixrun" / "agents" / "agent.py").exists()
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "dev_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    e = env(PYTHONPATH=str(target))
    shadowed = subprocess.run([str(py), "-c", "import phoenixrun.agents"], env=e, cwd=root, capture_output=True)
    assert shadowed.returncode != 0          # the trap is there: from the root, ./phoenixrun comes first
    out = tmp_path / "out"
    r = subprocess.run([str(py), str(target / "bin" / "phoenixrun"), "--standalone", "--nnodes", "1",
                        "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(PLAIN), "--out", str(out),
                        "--steps", "2"], env=e, cwd=root, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(ranks(out)) == [0, 1]
    assert "No module named" not in r.stderr


def test_streams_kept_apart_prefixed_once_stdin_given_filter_applied(tmp_path):
    streams = Path(__file__).resolve().parent / "scripts" / "streams.py"
    r = subprocess.run([str(BIN / "phoenixrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                        "--local-ranks-filter", "0", "--run-dir", str(tmp_path / "run"), str(streams)],
                       input="hello\n", capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "[rank0]:out-line rank 0" in r.stdout and "err-line" not in r.stdout
    assert "[rank0]:err-line rank 0" in r.stderr and "out-line" not in r.stderr
    assert "[rank0]:got 'hello' from stdin" in r.stdout                       # stdin reaches the workers
    assert "[rank0]:partial-no-newline" in r.stdout                            # a line without its newline
    assert "[rank0]: RuntimeError: boom from rank 0" in r.stderr               # torch's own prefix, not doubled
    assert "[rank0]:[rank0]" not in r.stderr + r.stdout
    assert "rank 1" not in r.stdout and "[rank1]" not in r.stderr               # --local-ranks-filter 0

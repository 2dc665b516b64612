"""The shipped sbatch templates on a real (single-machine) Slurm: tests/slurm_harness.py.

The templates are submitted exactly as shipped; the tests override only what a user would on the
sbatch command line or in the environment: the account (-A), the size (-N, SPARES, NPROC_PER_NODE)
and PATH (so the batch script finds this checkout's phoenixrun). Each job trains
examples/train_gpt.py (tiny: 1 layer, d_model 64, gloo on CPU) and is checked through the files
phoenixrun writes: every rank's OUT/rank{R}.json and RUN_DIR/events.jsonl (`job_finished`,
`recovery_done`), plus Slurm's own record of the job (COMPLETED, exit 0:0).

The node-failure test runs the Vista template with one warm spare, waits until training steps
advance (`phoenixrun status --json`), then kills one active node the way a real node dies: SIGKILL
its agent and workers (pids from `status --json`) and mark it DOWN in Slurm (which alone does not
kill a node's processes). The job must recover onto the spare and end as if nothing had happened:
the final parameters are bit-identical to the fault-free run of the same size.

Needs root and Debian's Slurm packages (tests/slurm_setup.sh installs them); skipped with the
reason otherwise. Run: python -m pytest tests/test_slurm.py -q
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_harness import SlurmCluster, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "launch_templates"
TRAIN = [str(REPO / "examples" / "train_gpt.py"), "--layers", "1", "--d-model", "64", "--vocab", "128",
         "--seq", "16", "--batch", "2"]
LONG_STEPS = 250          # the failure run and its fault-free reference
JOB_TIMEOUT = 150.0
_reference: dict[str, str] = {}   # fault-free final param digest of the 2-node x 1 Vista run


def _bin_dir() -> Path:
    here = Path(sys.executable).parent
    if (here / "phoenixrun").exists():
        return here
    import shutil
    found = shutil.which("phoenixrun")
    if not found:
        pytest.fail("phoenixrun is not installed next to this python or on PATH (pip install -e .)")
    return Path(found).parent


@pytest.fixture(scope="module")
def slurm():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"cannot run a local Slurm here: {reason}")
    cluster = SlurmCluster(nnodes=3, gpus_per_node=4)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


class Job:
    def __init__(self, cluster: SlurmCluster, jid: str, cwd: Path, out: Path, bin_dir: Path):
        self.c, self.jid, self.cwd, self.out, self.bin_dir = cluster, jid, cwd, out, bin_dir
        self.run_dir = cwd / f"phoenixrun-{jid}"      # the templates' default RUN_DIR ($PWD/phoenixrun-$SLURM_JOB_ID)
        self.log = cwd / f"phoenixrun-{jid}.out"      # their default output (-o %x-%j.out)

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def status(self) -> dict | None:
        p = subprocess.run([str(self.bin_dir / "phoenixrun"), "status", "--run-dir", str(self.run_dir), "--json"],
                           capture_output=True, text=True, timeout=30)
        return json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip() else None

    def diagnostics(self) -> str:
        log = self.log.read_text(errors="replace")[-5000:] if self.log.exists() else "(no job output)"
        events = "\n".join(json.dumps(e) for e in self.events()[-20:])
        return (f"--- job {self.jid} {self.c.job_info(self.jid)}\n--- output (tail):\n{log}\n--- events:\n{events}\n"
                f"--- slurmctld.log (tail):\n{self.c.logs_tail(15)}")


def submit(cluster: SlurmCluster, tmp: Path, template: str, flags: list[str], env: dict[str, str],
           steps: int, extra: tuple[str, ...] = ()) -> Job:
    bin_dir = _bin_dir()
    out = tmp / "out"
    e = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", **env}
    jid = cluster.sbatch([*flags, str(TEMPLATES / template), *TRAIN, "--steps", str(steps), "--out", str(out), *extra],
                         cwd=tmp, env=e)
    return Job(cluster, jid, tmp, out, bin_dir)


def check_completed(job: Job, world: int, steps: int) -> list[dict]:
    """The job ended COMPLETED 0:0, phoenixrun says job_finished exit 0, and every rank wrote its result."""
    info = job.c.wait_job(job.jid, timeout=JOB_TIMEOUT)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", job.diagnostics()
    finished = [e for e in job.events() if e["event"] == "job_finished"]
    assert finished and finished[-1]["exit_code"] == 0, job.diagnostics()
    ranks = []
    for r in range(world):
        path = job.out / f"rank{r}.json"
        assert path.exists(), f"missing {path}\n" + job.diagnostics()
        res = json.loads(path.read_text())
        assert res["rank"] == r and res["world_size"] == world and res["steps"] == steps
        assert len(res["losses"]) == steps and all(isinstance(x, float) for x in res["losses"])
        ranks.append(res)
    assert not (job.out / f"rank{world}.json").exists()
    # DDP keeps the replicas identical: every rank ends with the same parameters
    assert len({r["param_sha256"] for r in ranks}) == 1, [r["param_sha256"] for r in ranks]
    return ranks


def training(slurm: SlurmCluster, job: Job, steps: int, timeout: float = 120) -> dict:
    """The job's status once training steps advance with both actives and the spare registered, early enough to
    fail a node mid-run."""
    deadline = time.time() + timeout
    st = None
    while time.time() < deadline:
        if slurm.job_info(job.jid).get("JobState") not in ("PENDING", "RUNNING"):
            pytest.fail("the job ended before a node could be failed\n" + job.diagnostics())
        st = job.status() if (job.run_dir / "master.json").exists() else None
        if st and (st.get("step") or 0) >= 3 and sum(n["role"] == "spare" for n in st["nodes"]) == 1:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"steps did not advance (last status: {st})\n" + job.diagnostics())
    assert st["step"] < steps - 20, f"too late to fail a node mid-run: step {st['step']}"
    return st


def sigkill(pids: list[int]) -> None:
    """Kill these processes the way a dying node does (already gone: fine)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_perlmutter_template_completes(slurm, tmp_path):
    job = submit(slurm, tmp_path, "perlmutter.sbatch", ["-A", "phxtest", "-N", "2"],
                 {"SPARES": "0", "NPROC_PER_NODE": "2"}, steps=8)
    check_completed(job, world=4, steps=8)
    log = job.log.read_text()
    assert "2 active + 0 spare nodes x 2 workers" in log
    # the master listened on the first node's NodeAddr (fake node names do not resolve)
    started = next(e for e in job.events() if e["event"] == "master_started")
    assert started["endpoint"].startswith(slurm.addrs[slurm.nodes[0]] + ":"), started


@pytest.mark.smoke
def test_generic_template_completes(slurm, tmp_path):
    job = submit(slurm, tmp_path, "generic.sbatch", ["-N", "2"], {"SPARES": "0", "NPROC_PER_NODE": "1"}, steps=8)
    check_completed(job, world=2, steps=8)


def test_job_exit_code_is_the_masters(slurm, tmp_path):
    """A training script that fails: phoenixrun stops the job (no hot swap for a bug in user code) and
    the batch script exits with the master's code, so Slurm records the job as FAILED with it."""
    # d_model 63 with 4 heads: the model cannot be built (embed_dim must be divisible by num_heads)
    job = submit(slurm, tmp_path, "generic.sbatch", ["-N", "1"], {"SPARES": "0", "NPROC_PER_NODE": "1"},
                 steps=8, extra=("--d-model", "63"))
    info = slurm.wait_job(job.jid, timeout=JOB_TIMEOUT)
    finished = [e for e in job.events() if e["event"] == "job_finished"]
    assert finished and finished[-1]["exit_code"] != 0, job.diagnostics()
    assert info.get("JobState") == "FAILED", job.diagnostics()
    assert info.get("ExitCode") == f"{finished[-1]['exit_code']}:0", job.diagnostics()
    assert not list(job.out.glob("rank*.json"))


def test_vista_template_completes(slurm, tmp_path):
    job = submit(slurm, tmp_path, "vista.sbatch", ["-A", "phxtest", "-N", "2"], {"SPARES": "0"}, steps=LONG_STEPS)
    ranks = check_completed(job, world=2, steps=LONG_STEPS)
    _reference["param_sha256"] = ranks[0]["param_sha256"]
    # active nodes registered with their own addresses
    hosts = {e["host"] for e in job.events() if e["event"] == "node_joined"}
    assert hosts == {slurm.addrs[n] for n in slurm.nodes[:2]}, hosts


def test_node_failure_is_survived_by_a_spare(slurm, tmp_path):
    job = submit(slurm, tmp_path, "vista.sbatch", ["-A", "phxtest", "-N", "3"], {"SPARES": "1"}, steps=LONG_STEPS)
    master_node = None
    victim = None
    try:
        st = training(slurm, job, LONG_STEPS)
        master_node = slurm.job_info(job.jid)["BatchHost"]
        active = [n for n in st["nodes"] if n["role"] == "active"]
        assert len(active) == 2
        # fail an active node that does not host the master (losing that one is --requeue's business)
        target = next(n for n in active if slurm.node_of_addr(n["host"]) != master_node)
        victim = slurm.node_of_addr(target["host"])
        sigkill([target["agent_pid"], *target["worker_pids"]])
        slurm.set_down(victim, reason="phoenixrun-test-node-failure")
        killed_at = time.time()

        ranks = check_completed(job, world=2, steps=LONG_STEPS)
        events = job.events()
        names = [e["event"] for e in events]
        assert "fault_detected" in names and "recovery_done" in names, job.diagnostics()
        done = next(e for e in events if e["event"] == "recovery_done")
        assert done["replayed_steps"] <= 1, done
        assert done["t"] - killed_at < 60, done
        # the warm spare (any node, the master's included) took the failed node's slot
        joined = {e["node"]: e for e in events if e["event"] == "node_joined"}
        spares = [n for n, e in joined.items() if e["role"] == "spare"]
        promoted = [e for e in events if e["event"] == "spare_promoted"]
        assert len(spares) == 1 and len(promoted) == 1, job.diagnostics()
        assert promoted[0]["node"] == spares[0] and promoted[0]["replaces"] == target["node_id"], promoted
        assert promoted[0]["slot"] == target["slot"], (promoted, target)
        assert slurm.node_of_addr(joined[spares[0]]["host"]) != victim
        assert not [e for e in events if e["event"] == "job_finished" and e["exit_code"] != 0]
        if "param_sha256" in _reference:  # same seed, same world size, same steps: bit-identical to fault-free
            assert ranks[0]["param_sha256"] == _reference["param_sha256"]
    finally:
        slurm.cmd("scancel", job.jid, check=False)   # no-op when it ended
        if victim:
            slurm.resume(victim)
            slurm.wait_idle(timeout=60)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_master_node_failure_is_survived_by_the_standby(slurm, tmp_path):
    """STANDBY=1: the master on the second node, a standby master on the batch node. The master's node dies
    (SIGKILL of its master, its agent and their workers; the node marked DOWN): the standby takes over on its
    own endpoint, the agents rejoin it, and the job ends bit-identical to a fault-free torchrun. The master's
    node also runs an agent: active or spare, whichever registered first; the job's one spare covers it."""
    from tests.harness import assert_identical, torchrun
    steps = LONG_STEPS
    ref = torchrun(tmp_path, "ref", nproc=2, steps=steps, model_args=TRAIN[1:])
    job = submit(slurm, tmp_path, "vista.sbatch", ["-A", "phxtest", "-N", "3"],
                 {"SPARES": "1", "STANDBY": "1", "LEASE_TTL": "3", "STANDBY_PORT": str(_free_port())}, steps=steps)
    victim = None
    try:
        st = training(slurm, job, steps)
        assert st["master_epoch"] == 1, st
        batch_host = slurm.job_info(job.jid)["BatchHost"]
        master_host = st["endpoint"].rsplit(":", 1)[0]
        victim = slurm.node_of_addr(master_host)
        assert victim != batch_host, (victim, batch_host)   # the standby waits on the batch host
        on_victim = [n for n in st["nodes"] if n["host"] == master_host]
        assert len(on_victim) == 1, st["nodes"]
        victim_agent = on_victim[0]
        sigkill([st["master_pid"], victim_agent["agent_pid"], *victim_agent["worker_pids"]])
        slurm.set_down(victim, reason="phoenixrun-test-master-node-failure")
        killed_at = time.time()
        # phoenixrun status follows the master that took over (master.json), with its epoch
        taken = None
        while taken is None and slurm.job_info(job.jid).get("JobState") == "RUNNING" and time.time() < killed_at + 90:
            s = job.status()
            taken = s if s and s.get("master_epoch") == 2 else None
            time.sleep(0.5)
        ranks = check_completed(job, world=2, steps=steps)
        events = job.events()
        takeover = [e for e in events if e["event"] == "master_takeover"]
        assert len(takeover) == 1, job.diagnostics()
        t = takeover[0]
        assert t["epoch"] == 2 and t["previous_epoch"] == 1 and t["previous_endpoint"] == st["endpoint"], t
        assert t["endpoint"].startswith(slurm.addrs[batch_host] + ":"), t
        assert t["t"] - killed_at < 60, t
        assert taken is not None and taken["endpoint"] == t["endpoint"], taken
        started = [e for e in events if e["event"] == "master_started"]
        assert [e["epoch"] for e in started] == [1, 2], started
        assert any(e["event"] == "master_standby" for e in events)
        if victim_agent["role"] == "active":      # its ranks moved to the spare under the new master
            done = [e for e in events if e["event"] == "recovery_done"]
            assert done and done[0]["t"] > t["t"] and done[0]["replayed_steps"] <= 1, job.diagnostics()
        assert not [e for e in events if e["event"] == "job_finished" and e["exit_code"] != 0]
        assert len({r["param_sha256"] for r in ranks}) == 1
        assert_identical(job.out, ref)
        print(f"victim's agent was {victim_agent['role']}; takeover {t['t'] - killed_at:.1f}s after the kill")
    finally:
        slurm.cmd("scancel", job.jid, check=False)
        if victim:
            slurm.resume(victim)
            slurm.wait_idle(timeout=60)


def test_time_limit_warning_persists_a_checkpoint_and_requeues(slurm, tmp_path):
    """Slurm requeues nothing by itself at the time limit: the template's `#SBATCH --signal=B:USR1@120` makes
    Slurm send the batch shell SIGUSR1 (here sent by hand, as Slurm would: `scancel --signal=USR1 --batch`); the
    template stops the masters, then the agents (which persist their snapshots on SIGTERM), and requeues the job
    with `scontrol requeue`. The requeued job (same id and RUN_DIR) resumes from that checkpoint and completes;
    both runs' output is in the one file (--open-mode=append)."""
    job = submit(slurm, tmp_path, "generic.sbatch", ["-N", "2"], {"SPARES": "0", "NPROC_PER_NODE": "1"},
                 steps=LONG_STEPS)
    try:
        deadline, st = time.time() + 120, None
        while time.time() < deadline and not (st and (st.get("step") or 0) >= 5):
            if slurm.job_info(job.jid).get("JobState") not in ("PENDING", "RUNNING"):
                pytest.fail("the job ended before the time limit's warning\n" + job.diagnostics())
            st = job.status() if (job.run_dir / "master.json").exists() else None
            time.sleep(0.3)
        assert st and st["step"] < LONG_STEPS - 20, f"steps did not advance in time: {st}\n" + job.diagnostics()
        slurm.cmd("scancel", "--signal=USR1", "--batch", job.jid)
        info = slurm.wait_job(job.jid, timeout=300)
        assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", job.diagnostics()
        assert info.get("Restarts") == "1", info
        ranks = check_completed(job, world=2, steps=LONG_STEPS)
        log = job.log.read_text()
        assert "SIGUSR1: the time limit is near; stopping the job so that the agents persist a checkpoint" in log
        assert f"requeueing job {job.jid} (the time limit is near; requeue 1 of at most 5)" in log, log[-3000:]
        assert log.count(f"job {job.jid}: 2 active + 0 spare nodes") == 2, log[-3000:]   # both runs, appended
        events = job.events()
        assert [e["event"] for e in events].count("master_started") == 2, job.diagnostics()
        resumed = [e for e in events if e["event"] == "fallback_restart"]
        assert resumed and resumed[-1]["restore_step"] >= st["step"], job.diagnostics()
        assert [e["exit_code"] for e in events if e["event"] == "job_finished"][-1:] == [0]
        if "param_sha256" in _reference:    # resumed from disk, the same parameters as the uninterrupted run
            assert ranks[0]["param_sha256"] == _reference["param_sha256"]
    finally:
        slurm.cmd("scancel", job.jid, check=False)

"""A run's identity (phoenixrun/runid.py) and the launcher's preflight decisions (phoenixrun/preflight.py), as
tables; then the real thing: two runs started in one directory, a busy rendezvous port (issue 29 items 1, 2)."""
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from phoenixrun import preflight, runid
from phoenixrun.runid import RUNS, RunIdError, identity, resume_note

RUNS_HERE = [("run-aaaa", 10.0), ("standalone-bbbb", 30.0), ("run-cccc", 20.0)]


@pytest.mark.parametrize("rdzv_id, run_dir, resume, standalone, slurm, want", [
    # nothing names the run: a new one, in a new directory, standalone or not (was: every non-standalone run
    # shared .phoenixrun/phoenixrun and resumed the previous one's checkpoints)
    ("", None, False, False, None, ("run-tok", RUNS / "run-tok", "new")),
    ("", None, False, True, None, ("standalone-tok", RUNS / "standalone-tok", "new")),
    # named: by --rdzv-id (torchrun's), by the directory, by the Slurm job (the same on every node and requeue)
    ("myjob", None, False, False, None, ("myjob", RUNS / "myjob", "rdzv-id")),
    ("my job/1", None, False, False, None, ("my job/1", RUNS / "my-job-1", "rdzv-id")),
    ("myjob", Path("/d/x"), False, False, "77", ("myjob", Path("/d/x"), "rdzv-id")),
    ("", Path("/d/gpt"), False, True, "77", ("gpt", Path("/d/gpt"), "run-dir")),
    ("", None, False, True, "77", ("slurm-77", RUNS / "slurm-77", "slurm")),
    # --resume without a name: the newest run here
    ("", None, True, False, None, ("standalone-bbbb", RUNS / "standalone-bbbb", "resume")),
    ("myjob", None, True, False, None, ("myjob", RUNS / "myjob", "rdzv-id")),
])
def test_identity(rdzv_id, run_dir, resume, standalone, slurm, want):
    got = identity(rdzv_id, run_dir, resume, standalone, slurm, RUNS_HERE, "tok")
    assert (got.run_id, got.run_dir, got.how) == want


def test_resume_with_nothing_to_resume_is_refused():
    with pytest.raises(RunIdError, match="no run to resume"):
        identity("", None, True, False, None, [], "tok")
    with pytest.raises(RunIdError, match="holds no earlier run"):
        resume_note("x", Path("d"), True, has_state=False)


@pytest.mark.parametrize("resume, has_state, says", [
    (False, False, None), (False, True, "continues in"), (True, True, "continues in")])
def test_resume_note(resume, has_state, says):
    note = resume_note("x", Path("d"), resume, has_state)
    assert (note is None) if says is None else (says in note)


def test_has_state(tmp_path):
    assert not runid.has_state(tmp_path, None)
    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    assert runid.has_state(tmp_path, None)
    assert not runid.has_state(tmp_path, tmp_path / "elsewhere")
    (tmp_path / "events.jsonl").write_text('{"event": "master_started"}\n')
    assert runid.has_state(tmp_path, tmp_path / "elsewhere")


@pytest.mark.parametrize("connected, answer, want", [
    (False, None, "none"),
    (True, b"", "silent"),
    (True, b'HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n\r\n'
           b'{"error": "unauthorized: missing or wrong job secret"}', "phoenixrun"),
    (True, b"HTTP/1.0 501 Unsupported method\r\n\r\n<!DOCTYPE HTML>", "other"),
    (True, b"HTTP/1.1 401 Unauthorized\r\n\r\nLogin required", "other"),
    (True, b"SSH-2.0-OpenSSH_9.6\r\n", "other"),
])
def test_verdict(connected, answer, want):
    assert preflight.verdict(connected, answer) == want


@pytest.mark.parametrize("what, host_master, says", [
    ("none", True, None), ("none", False, None),
    ("other", True, "in use by another program"), ("other", False, "in use by another program"),
    ("silent", True, "in use by another program"), ("silent", False, None),   # a loaded master may be slow
    ("phoenixrun", True, "another phoenixrun master"),
    ("phoenixrun", False, None),           # every node runs the same command: another launcher here got it first
])
def test_port_problem(what, host_master, says):
    msg = preflight.port_problem("127.0.0.1", 29500, what, host_master)
    if says is None:
        assert msg is None
    else:
        assert says in msg and "127.0.0.1:29500" in msg and "--master-port" in msg and "\n" not in msg


@pytest.mark.parametrize("agents, nproc, cores, warned", [
    (4, 2, 2, False),        # make demo: 3 nodes + 1 spare x 2 workers on 2 cores
    (66, 1, 2, True), (66, 1, 32, False), (8, 4, 2, True), (1, 64, 2, True), (66, 8, 128, False)])
def test_oversubscribed(agents, nproc, cores, warned):
    w = preflight.oversubscribed(agents, nproc, cores)
    assert (w is not None) == warned
    if warned:
        assert f"{agents} agents" in w and f"{cores} CPU core" in w


# ---------------------------------------------------------------- real processes

def _phoenixrun(tmp_path, *args, timeout=60):
    from tests.harness import BIN, env
    t0 = time.monotonic()
    p = subprocess.run([str(BIN / "phoenixrun"), *args], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=timeout)
    return p, time.monotonic() - t0


class _Http501(threading.Thread):
    """What held the port in the issue: a web server that answers the master's POST with 501 and an HTML page."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.recv(4096)
            c.sendall(b"HTTP/1.0 501 Unsupported method ('POST')\r\nContent-Type: text/html\r\n\r\n<!DOCTYPE HTML>")
            c.close()


@pytest.mark.parametrize("how", [[], ["--node-rank", "0"]])
def test_busy_rendezvous_port_fails_fast_in_one_line(tmp_path, how):
    from tests.harness import EXAMPLE
    server = _Http501()
    server.start()
    try:
        p, took = _phoenixrun(tmp_path, "--nnodes", "1", "--master-port", str(server.port), *how, str(EXAMPLE),
                              "--steps", "2")
    finally:
        server.sock.close()
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and took < 10, (p.returncode, took, p.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("phoenixrun: error: rendezvous port"), p.stderr[-2000:]
    assert f"127.0.0.1:{server.port}" in lines[0] and "--master-port" in lines[0]
    assert not (tmp_path / ".phoenixrun").exists()      # nothing started, nothing written

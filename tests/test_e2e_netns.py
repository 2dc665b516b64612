"""Several machines, for real: each node's agent in its own network namespace behind a bridge, the master on the
bridge's address, every address flag left at its default. A node advertising loopback from another machine is
refused with a clear error; a link-down partition is detected and replaced, and the job finishes bit-identical.

Needs root and `ip netns` (skipped with the reason otherwise)."""
import json
import os
import shutil
import subprocess

import psutil
import pytest

from tests.harness import BIN, EXAMPLE, SMALL, Job, assert_identical, by_event, env, torchrun

pytestmark = pytest.mark.e2e
STEPS = 40
TAG = f"{os.getpid() % 100000}"
NET = f"10.213.{os.getpid() % 250}"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    r = _ip("netns", "add", f"prq{TAG}")
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", f"prq{TAG}")
    return None


@pytest.fixture
def net():
    """A bridge at NET.1 (where the master listens) and namespaces n1..n3 at NET.2-4, one veth each."""
    why = _unavailable()
    if why:
        pytest.skip(why)
    br, made = f"prb{TAG}", []

    def run(*args):
        r = _ip(*args)
        assert r.returncode == 0, f"ip {' '.join(args)}: {r.stderr}"
    try:
        run("link", "add", br, "type", "bridge")
        made.append(("link", br))
        run("addr", "add", f"{NET}.1/24", "dev", br)
        run("link", "set", br, "up")
        for i in (1, 2, 3):
            ns, host_end, ns_end = f"prn{TAG}{i}", f"prv{TAG}{i}", f"prp{TAG}{i}"
            run("netns", "add", ns)
            made.append(("netns", ns))
            run("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            made.append(("link", host_end))
            run("link", "set", ns_end, "netns", ns)
            run("link", "set", host_end, "master", br)
            run("link", "set", host_end, "up")
            run("-n", ns, "addr", "add", f"{NET}.{i + 1}/24", "dev", ns_end)
            run("-n", ns, "link", "set", ns_end, "up")
            run("-n", ns, "link", "set", "lo", "up")
        yield {i: (f"prn{TAG}{i}", f"prv{TAG}{i}", f"{NET}.{i + 1}") for i in (1, 2, 3)}
    finally:
        for kind, name in reversed(made):
            _ip(kind, "del", name)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def test_nodes_on_separate_networks_with_default_flags_survive_a_link_down(tmp_path, net):
    ref = torchrun(tmp_path, "ref", nproc=2, steps=STEPS)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    e = env()
    log = open(tmp_path / "run.log", "w")
    procs = []

    def agent(i: int, *flags: str) -> subprocess.Popen:
        cmd = ["ip", "netns", "exec", net[i][0], str(BIN / "phoenixrun"), "agent", "--rdzv-endpoint", endpoint,
               "--nproc-per-node", "1", "--secret-file", str(run_dir / "secret"), *flags, "--",
               str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *SMALL]
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=tmp_path)
        procs.append(p)
        return p

    master = subprocess.Popen([str(BIN / "phoenixrun"), "master", "--nnodes", "2", "--nproc-per-node", "1",
                               "--run-dir", str(run_dir), "--port", "0"],
                              stdout=log, stderr=subprocess.STDOUT, env=e, cwd=tmp_path)
    procs.append(master)
    job = Job(run_dir, out, master)
    try:
        port = json.loads(job.wait_file(run_dir / "master.json", timeout=60))["endpoint"].rsplit(":", 1)[1]
        endpoint = f"{NET}.1:{port}"
        # another machine advertising loopback: refused at once, with the reason and what to do
        bad = agent(3, "--host", "127.0.0.1")
        assert bad.wait(timeout=60) == 2
        assert f"connects from {net[3][2]}" in (tmp_path / "run.log").read_text()
        for i in (1, 2):
            agent(i)
        job.wait_for(lambda s: len(s["nodes"]) == 2, what="two nodes")
        agent(3)                                                   # the spare (it joins once the slots are full)
        job.wait_for(lambda s: any(n["role"] == "spare" for n in s["nodes"]), what="the spare")
        state = job.wait_step(3)
        assert sorted(n["host"] for n in state["nodes"] if n["role"] == "active") == [net[1][2], net[2][2]]
        victim = next(n for n in state["nodes"] if n["slot"] == 1)
        _ip("link", "set", next(v[1] for v in net.values() if v[2] == victim["host"]), "down")   # the cable
        assert master.wait(timeout=240) == 0, job.log()[-3000:]
        ev = job.events()
        assert [f["node"] for f in by_event(ev, "fault_detected")][:1] == [victim["node_id"]]
        assert by_event(ev, "spare_promoted")[0]["replaces"] == victim["node_id"]
        assert by_event(ev, "recovery_done")
        assert_identical(out, ref)
    finally:
        for p in procs:
            _kill_tree(p)

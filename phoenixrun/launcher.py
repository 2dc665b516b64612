"""Process orchestration for the CLI: start a master and/or agents as their own processes.

`--standalone` runs a master plus nnodes + spares agents on this machine, each agent simulating
one node. Multi-node use runs the master on node rank 0 and one agent per node (torchrun style),
or `phoenixrun master` / `phoenixrun agent` separately (as the Slurm templates do).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from phoenixrun import auth, preflight, runid
from phoenixrun.config import AgentConfig, LaunchConfig, MasterConfig


MAX_MASTER_RESTARTS = 10


# The master and the agents import phoenixrun as installed, never from the working directory: `python -m`
# puts the cwd first on sys.path, and from a checkout's root `./phoenixrun` (which has no `agents` subpackage:
# that maps from agents/ only when installed) shadowed a non-editable install - every agent died with
# ModuleNotFoundError and the launcher waited forever.
_BOOT = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
         "from phoenixrun.cli import main; main()")


def _py() -> list[str]:
    return [sys.executable, "-c", _BOOT]


def master_argv(m: MasterConfig) -> list[str]:
    """`phoenixrun master ...` running with exactly this config."""
    return _py() + ["master"] + m.to_argv()


def agent_argv(a: AgentConfig) -> list[str]:
    """`phoenixrun agent ... -- SCRIPT ARGS` running with exactly this config (the secret: in the environment)."""
    return _py() + ["agent"] + a.to_argv()


def wait_for_master(run_dir: Path, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> dict[str, Any]:
    """The master's endpoint once it has written it. The wait ends early if the master exits; the timeout only
    catches a master that hangs while starting (60 s was reached on a 2-core machine at a load average of 37)."""
    path = Path(run_dir) / "master.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the master exited with code {proc.returncode} before it was ready")
        if path.exists():
            info: dict[str, Any] = json.loads(path.read_text())
            if info.get("pid") == proc.pid:
                return info
        time.sleep(0.05)
    raise RuntimeError(f"the master did not start within {timeout:.0f}s")


def started(run_dir: Path) -> bool:
    """Has the master started the job (every slot filled)? From its event log."""
    try:
        with open(Path(run_dir) / "events.jsonl", "rb") as f:
            return any(b'"job_started"' in line for line in f)
    except OSError:
        return False


def failed_agents(agents: list[subprocess.Popen[bytes]]) -> list[tuple[int, int]]:
    """(index, exit code) of the agents that exited with an error - not killed by a signal, as a fault drill
    does. Polling also reaps the agents that were killed (a zombie's slot files would stay)."""
    return [(i, a.returncode) for i, a in enumerate(agents) if a.poll() is not None and a.returncode > 0]


def _listening(endpoint: str | None) -> bool:
    import socket
    host, _, port = (endpoint or "").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False


def preflight_problem(c: LaunchConfig) -> str | None:
    """Why this launch cannot start (a one-line error), or None; says what the user should know before it does
    (a run that continues in its directory, a standalone job too large for this machine)."""
    if c.host_master:
        note = runid.resume_note(c.master.run_id, c.master.run_dir, c.resume,
                                 runid.has_state(c.master.run_dir, c.master.persistence.persist_dir))
        if note:
            print(f"phoenixrun: {note}", file=sys.stderr, flush=True)
    if c.standalone:
        warning = preflight.oversubscribed(c.master.nnodes + c.spares, c.master.nproc_per_node, os.cpu_count() or 1)
        if warning:
            print(f"phoenixrun: warning: {warning}", file=sys.stderr, flush=True)
        return None
    host, _, port = (c.endpoint or "").rpartition(":")
    return preflight.port_problem(host, int(port), preflight.probe(host, int(port)), c.host_master)


class ProcessSet:
    """Children of the launcher; all are torn down on any exit path."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, env=env)
        self.procs.append(p)
        return p

    def terminate(self, grace: float = 5.0, first: subprocess.Popen[bytes] | None = None, later_grace: float = 25.0) -> None:
        """SIGTERM, then SIGKILL after the grace. `first` (the master) goes first: an agent that gets SIGTERM asks
        the master to drain its node and leaves at once only if the master is gone; the agents then get
        `later_grace` (a drain, or the 20 s an agent waits for one, must not be cut short by SIGKILL: its workers
        would be left behind)."""
        groups = [([first], grace)] if first is not None else []
        for group, wait_s in [*groups, ([p for p in self.procs if p is not first], later_grace)]:
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.time() + wait_s
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def run(c: LaunchConfig) -> int:
    """Run a job: master (standalone or node rank 0) and this node's agent(s). Returns the exit code."""
    problem = preflight_problem(c)
    if problem:
        print(f"phoenixrun: error: {problem}", file=sys.stderr, flush=True)
        return 1
    return _run(c)


def _run(c: LaunchConfig) -> int:
    """run(), once the preflight found nothing in the way."""
    run_dir = c.master.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if c.standalone:     # a job of its own: $PHOENIXRUN_SECRET or a new one, whatever the directory held
        secret = os.environ.get(auth.SECRET_ENV) or auth.new_secret()
        auth.write_secret(run_dir, secret)
    else:                # other masters (a standby) may share the directory: the secret is created once
        secret = auth.master_secret(run_dir)
    env = {**os.environ, **c.extra_env, auth.SECRET_ENV: secret}
    procs = ProcessSet()
    master = None
    stop: dict[str, int | None] = {"sig": None}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["sig"] = signum
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if c.host_master:
            master = procs.start(master_argv(c.master), env)
            try:
                info = wait_for_master(run_dir, master)
            except RuntimeError:
                if c.standalone or c.agent.node_rank is not None or not _listening(c.endpoint):
                    raise
                # every node runs the same command and another one on this host got the port first
                master = None
        if master is not None:
            endpoint = info["endpoint"]
            print(f"phoenixrun: run {c.master.run_id}: master {endpoint}, run dir {run_dir} "
                  f"(watch with: phoenixrun status --run-dir {run_dir} --watch)", file=sys.stderr, flush=True)
        else:
            endpoint = c.endpoint
        count = c.master.nnodes + c.spares if c.standalone else 1
        agents = []
        for i in range(count):
            agents.append(procs.start(agent_argv(c.agent_for(endpoint, i)), env))
        watched = master if master is not None else agents[0]
        master_restarts = 0
        job_started = False
        while True:
            while watched.poll() is None and stop["sig"] is None:
                failed = failed_agents(agents)
                if failed and master is not None and not job_started:
                    # no job starts without them: say so now, not never
                    job_started = started(run_dir)
                    if not job_started:
                        i, code = failed[0]
                        raise RuntimeError(f"the agent of node {i} exited with code {code} before the job started "
                                           f"(its error is printed above); {len(failed)} of {len(agents)} failed")
                time.sleep(0.1)
            if stop["sig"] is not None:
                return 128 + stop["sig"]
            if master is None or master.returncode >= 0 or master_restarts >= MAX_MASTER_RESTARTS:
                break
            # the master was killed, not finished: the job runs on without it; bring it back on the
            # same endpoint and store port, where the agents rebuild its state by rejoining
            master_restarts += 1
            print(f"phoenixrun: the master died (signal {-master.returncode}); restarting it on {endpoint} "
                  f"({master_restarts}/{MAX_MASTER_RESTARTS})", file=sys.stderr, flush=True)
            time.sleep(min(5.0, 0.5 * master_restarts))
            same_place = c.master.updated(port=int(endpoint.rsplit(":", 1)[1]), store_port=info["store_port"])
            master = procs.start(master_argv(same_place), env)
            info = wait_for_master(run_dir, master)
            watched = master
        if master is not None:
            # agents exit once they read the stop directive; give them a moment
            for a in agents:
                try:
                    a.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        return watched.returncode
    except RuntimeError as e:
        print(f"phoenixrun: error: {e}", file=sys.stderr)
        return 1
    finally:
        procs.terminate(first=master)
        for s, h in old.items():
            signal.signal(s, h)

"""What the launcher checks before it starts anything, so that a user's mistake costs seconds, not minutes of
silence (issue 29): a rendezvous port another program holds, a standalone job far larger than this machine, a
run, log or checkpoint directory that cannot be written.

The decisions (`verdict`, `port_problem`, `oversubscribed`, `dir_problem`) are pure; `probe` and `try_dir` are
the side effects: one connects to the rendezvous port and asks what answers there, the other creates a directory
and a file in it.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

# How a phoenixrun master answers a request without the job secret (control/server.py: 401, a JSON error naming
# the secret); anything else on the port is another program.
_OURS = (b"HTTP/1.1 401 ", b"job secret")
PROBE_TIMEOUT_S = 2.0
# processes (agents + workers) per CPU core beyond which a standalone job is warned about
MAX_PROCS_PER_CORE = 8


def verdict(connected: bool, answer: bytes | None) -> str:
    """What listens on a port: 'none' (nothing: connection refused), 'phoenixrun' (a phoenixrun master),
    'silent' (it accepted the connection but said nothing in time), 'other' (another program). Pure."""
    if not connected:
        return "none"
    if not answer:
        return "silent"
    return "phoenixrun" if answer.startswith(_OURS[0]) and _OURS[1] in answer else "other"


def port_problem(host: str, port: int, what: str, host_master: bool) -> str | None:
    """The one-line error for a launch whose rendezvous port is unusable, or None. Pure.

    what: verdict() of the port; host_master: this launch runs the master (it must listen there)."""
    fix = "free it, or choose another port (--master-port PORT, or --rdzv-endpoint HOST:PORT on every node)"
    if what == "other" or (what == "silent" and host_master):
        return (f"rendezvous port {host}:{port} is in use by another program (EADDRINUSE), not a phoenixrun "
                f"master: {fix}")
    if what == "phoenixrun" and host_master:
        return (f"rendezvous port {host}:{port} is in use by another phoenixrun master (another job, or an earlier "
                f"launch still running: phoenixrun status --endpoint {host}:{port}): stop it, or {fix.split(', ', 1)[1]}")
    return None


def oversubscribed(agents: int, nproc: int, cores: int) -> str | None:
    """The warning for a standalone job of far more processes than this machine has cores, or None. Pure."""
    procs = agents * (1 + nproc)
    if procs <= MAX_PROCS_PER_CORE * max(1, cores):
        return None
    return (f"--standalone starts {agents} agents with {agents * nproc} workers ({procs} processes) on "
            f"{cores} CPU core{'s' if cores != 1 else ''}: expect slow starts, missed heartbeats and false node "
            f"losses; each agent simulates a whole node - use fewer nodes here, or a cluster")


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str:
    """verdict() of what listens on host:port, asked with an unauthenticated GET /v1/state."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return verdict(False, None)
    answer = b""
    try:
        s.settimeout(timeout)
        s.sendall(f"GET /v1/state HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        deadline = time.monotonic() + timeout
        while len(answer) < 4096 and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    except OSError:
        pass
    finally:
        s.close()
    return verdict(True, answer)


def try_dir(path: Path) -> OSError | None:
    """Create `path` (with its parents) and a file in it, as the job will; the error that stops it, or None.
    Creating and writing is the only test that holds for root too (permission bits do not stop root; a path under
    a regular file, a read-only mount or a full disk do). Leaves nothing behind: what it created it removes (a
    launch stopped by a later check, a busy port say, has written nothing)."""
    path = Path(path)
    created = [p for p in [path, *path.parents] if not p.exists()]
    probe_file = path / f".phoenixrun-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe_file.write_bytes(b"")
        probe_file.unlink()
    except OSError as e:
        return e
    finally:
        for p in created:            # innermost first
            try:
                p.rmdir()
            except OSError:
                pass
    return None


def dir_problem(what: str, path: Path, error: OSError | None, fix: str) -> str | None:
    """The one-line error for a directory the job cannot write, or None. Pure.

    what: how the user named it (`--run-dir`, `the run directory`); fix: what to type instead."""
    if error is None:
        return None
    reason = error.strerror or type(error).__name__
    return f"{what} {path} cannot be written ({reason}): {fix}"

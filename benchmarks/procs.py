"""What the benchmarks measure of a job's processes: their CPU time, and when a warm spare has settled.

A warm spare's pre-started workers import torch and the script before they wait: several CPU seconds each, a one-off
start that on this shared machine takes the job's cores (on a cluster the spare is its own node). Benchmarks that
measure the job with a spare wait for that start to end (`settle`) and report it apart.
"""
from __future__ import annotations

import time

import psutil


def cpu_s(p: psutil.Process) -> float:
    """CPU seconds (user + system) the process has used."""
    t = p.cpu_times()
    return t.user + t.system


def settle(root: psutil.Process, spare_pids: set[int], spares: int, timeout: float = 120.0) -> float | None:
    """Wait until the warm workers below the spare agents `spare_pids` (descendants of `root`) are up and idle (each
    under 2% of a core over a second); the time from which they were (None: they did not settle within `timeout`,
    or the job ended)."""
    deadline = time.time() + timeout
    while spares and time.time() < deadline:
        try:
            workers = [c for p in root.children(recursive=True) if p.pid in spare_pids for c in p.children()]
            before = {w.pid: cpu_s(w) for w in workers}
            t0 = time.time()
            time.sleep(1.0)
            busy = [cpu_s(w) - before[w.pid] for w in workers]
        except psutil.Error:
            if not root.is_running():
                return None
            continue
        if workers and max(busy) < 0.02:
            return t0
    return None

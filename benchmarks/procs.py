"""What the benchmarks measure of a job's processes: their CPU time, and when pre-started workers have settled.

A warm spare's pre-started workers import torch and the script before they wait: several CPU seconds each, a one-off
start that on this shared machine takes the job's cores (on a cluster the spare is its own node). So does each
active node's standby worker (agents/standby.py), started once the node trains: on a cluster it takes one of the
node's many host cores, here one of the two the job's ranks use. Benchmarks that measure the job wait for those
starts to end (`settle`, `standbys_settled`) and report them apart.
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


def standbys_settled(root: psutil.Process, agent_pids: set[int], nproc: int, timeout: float = 120.0) -> float | None:
    """Wait until each active agent in `agent_pids` (descendants of `root`) has its standby worker up and idle: one
    child more than its `nproc` ranks, the newest of them under 2% of a core over a second; the time from which it
    was (None: not within `timeout`, or the job ended - a job with standbys off never settles)."""
    deadline = time.time() + timeout
    while agent_pids and time.time() < deadline:
        try:
            agents = [p for p in root.children(recursive=True) if p.pid in agent_pids]
            kids = [a.children() for a in agents]
            if len(agents) < len(agent_pids) or any(len(k) < nproc + 1 for k in kids):
                if root.status() == psutil.STATUS_ZOMBIE:   # the job ended first
                    return None
                time.sleep(0.5)
                continue
            newest = [max(k, key=lambda c: c.create_time()) for k in kids]
            before = {w.pid: cpu_s(w) for w in newest}
            t0 = time.time()
            time.sleep(1.0)
            busy = [cpu_s(w) - before[w.pid] for w in newest]
        except psutil.Error:
            if not root.is_running():
                return None
            continue
        if max(busy) < 0.02:
            return t0
    return None

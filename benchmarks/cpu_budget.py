"""Where the CPU of a protected job goes, per training step: worker, agent, warm spare (issue 17, item 1).

Runs examples/train_gpt.py (2 nodes x 2 ranks, d256 by default, + a warm spare, standalone, CPU) with protection
on, waits until it is past its warm-up, then samples every process of the job at once with py-spy for --window
seconds (`py-spy record --nonblocking --format raw`: the processes are never paused). Each process's CPU time over
the same window comes from the kernel (psutil), and the steps the job finished in it from the master's state. A
process's CPU is split over what its samples were doing (the innermost frame of ours or torch's that names a known
part, below) and divided by the steps: CPU milliseconds per step and part. Samples whose Python stack is a wait
(Condition.wait, select, socket reads, ...) are idle and count as nothing; samples with no Python frame at all are
native code running without the GIL - gloo's threads and torch's kernels - and are reported as such.

Without py-spy (pip install py-spy) it says so and exits 2. Run with the job's machine otherwise quiet: the
split is CPU time, not wall time, so load elsewhere changes it less than it changes step times, but it does.

    python benchmarks/cpu_budget.py [--window 15] [--d-model 256] [--spares 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Job reads the master's state; the launch is our own (default heartbeats, not the tests' 0.1 s)
from benchmarks.procs import cpu_s, settle  # noqa: E402
from tests.harness import BIN, ROOT, Job  # noqa: E402

# The innermost frame matching one of these (file or function substring, checked in order) names the part a sample
# was spent in; frames are "function (path:line)" as py-spy prints them.
IDLE = ("Condition.wait", "Event.wait", "Queue.get (queue.py:180)", "select (", "selectors.py", "readinto",
        "_recv_exact", "accept (", "time.sleep", "sleep (", "poll (selectors", "recv_into", "_wait_for_tstate_lock",
        "wait (threading.py")
PARTS = [
    # worker
    ("snapshot: copy into the slot (D2H/H2H)", ("runtime/snapshot.py",)),
    ("snapshot: step hooks and commit (api.py)", ("runtime/api.py", "runtime/adaptive.py", "runtime/layout_check.py")),
    ("worker <-> agent messages", ("runtime/agent_link.py",)),
    ("process group wrapper", ("runtime/process_group.py",)),
    ("optimizer (ZeRO, Adam)", ("torch/optim/", "zero_redundancy_optimizer.py")),
    ("backward", ("autograd/graph.py", "autograd/__init__.py", "_tensor.py")),
    ("forward and loss", ("torch/nn/", "train_gpt.py")),
    ("collectives (Python side)", ("distributed_c10d.py", "torch/distributed/")),
    # agent
    ("agent: checksum", ("crc32c", "slot_format.py")),
    ("agent: replication (send, receive, install)", ("agents/replicator.py", "agents/peer.py")),
    ("agent: slots", ("agents/slots.py",)),
    ("agent: worker channel", ("agents/ipc.py", "agents/worker_ops.py")),
    ("agent: master link (heartbeats, directives)", ("agents/master_link.py", "protocol/client.py", "http/client.py",
                                                     "agents/reporter.py")),
    ("agent: supervision", ("agents/supervisor.py", "agents/workers.py", "subprocess.py")),
    ("agent: other", ("agents/",)),
    ("master", ("phoenixrun/control/",)),
]
NATIVE = "native, no Python frame (gloo threads, torch kernels)"
OTHER = "other Python"


def classify(frames: list[str]) -> str | None:
    """The part one sample was spent in; None for an idle sample. frames: outermost first."""
    if not frames or frames == [""]:
        return NATIVE
    if any(w in frames[-1] for w in IDLE):
        return None
    for f in reversed(frames):
        for name, keys in PARTS:
            if any(k in f for k in keys):
                return name
    return OTHER


def role_of(p: psutil.Process, master_pid: int, spare_pids: set[int]) -> str:
    cmd = " ".join(p.cmdline())
    if p.pid == master_pid:
        return "master"
    if " agent " in cmd:
        return "spare agent" if p.pid in spare_pids else "agent"
    if "train_gpt" in cmd:
        return "spare worker" if p.ppid() in spare_pids else "worker"
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=float, default=15.0, help="seconds sampled")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=10, help="steps before the window opens")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    spy = shutil.which("py-spy") or (str(BIN / "py-spy") if (BIN / "py-spy").exists() else None)
    if spy is None:
        print("cpu_budget: py-spy is not installed (pip install py-spy); it samples the job's processes",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="phx-cpu-"))
    run_dir = tmp / "run"
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", "2", "--nproc-per-node", "2", "--spares",
           str(a.spares), "--run-dir", str(run_dir), str(ROOT / "examples" / "train_gpt.py"), "--steps", "100000",
           "--out", str(tmp / "out"), "--d-model", str(a.d_model)]
    env = {**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = Job(run_dir, tmp / "out", proc)
    try:
        state = job.wait_step(a.warmup)
        spare_pids = {n["agent_pid"] for n in state["nodes"] if n["role"] == "spare"}
        root = psutil.Process(proc.pid)
        # the spare's start (torch imports) is not what is measured here
        if a.spares and settle(root, spare_pids, a.spares) is None:
            print("cpu_budget: the spare's workers did not settle; its figures include their start", file=sys.stderr)
        procs = [p for p in root.children(recursive=True)]
        roles = {p.pid: role_of(p, state["master_pid"], spare_pids) for p in procs}
        procs = [p for p in procs if roles[p.pid] != "other"]      # e.g. the checkpoint I/O process
        before = {p.pid: cpu_s(p) for p in procs}
        step0 = job.state()["step"]
        spies = {p.pid: subprocess.Popen([spy, "record", "--pid", str(p.pid), "--duration", str(int(a.window)),
                                          "--rate", str(a.rate), "--nonblocking", "--format", "raw", "--output",
                                          str(tmp / f"{p.pid}.raw")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in procs}
        t0 = time.time()
        for s in spies.values():
            try:
                s.wait(timeout=max(1.0, t0 + a.window + 30 - time.time()))
            except subprocess.TimeoutExpired:
                s.kill()     # its samples so far are in its file (raw output is written as it goes)
        wall = time.time() - t0
        steps = job.state()["step"] - step0
        after = {p.pid: cpu_s(p) for p in procs}
        load = os.getloadavg()[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if steps <= 0:
        print("cpu_budget: no step finished inside the window; give a longer --window", file=sys.stderr)
        return 1
    # role -> part -> CPU ms per step (summed over the role's processes, then divided by their number)
    budget: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    count = collections.Counter(roles.values())
    for pid, role in roles.items():
        path = tmp / f"{pid}.raw"
        samples: collections.Counter = collections.Counter()
        if path.exists():
            for line in path.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                samples[classify(stack.split(";"))] += int(n)
        busy = sum(n for k, n in samples.items() if k is not None)
        cpu_ms = (after[pid] - before[pid]) * 1000 / steps
        for part, n in samples.items():
            if part is not None and busy:
                budget[role][part] += cpu_ms * n / busy / count[role]
        budget[role]["(total CPU)"] += cpu_ms / count[role]
    result = {"window_s": round(wall, 1), "steps": steps, "step_ms": round(wall * 1000 / steps, 1),
              "load_average_1min": round(load, 1), "d_model": a.d_model, "spares": a.spares,
              "processes": dict(count), "per_process_ms_per_step": {r: {k: round(v, 2) for k, v in c.most_common()}
                                                                    for r, c in budget.items()}}
    print(f"d{a.d_model}, 2 nodes x 2 ranks + {a.spares} spare: {steps} steps in {wall:.1f} s "
          f"({result['step_ms']} ms a step), load average {load:.1f}")
    for role, parts in result["per_process_ms_per_step"].items():
        print(f"\n{role} (x{count[role]}), CPU ms per step, per process:")
        for part, ms in parts.items():
            print(f"  {ms:8.2f}  {part}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

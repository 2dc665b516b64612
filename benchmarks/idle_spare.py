"""CPU a waiting warm spare burns: its agent and its pre-started workers, while a fault-free job runs.

Starts examples/train_gpt.py on --standalone 2 nodes x 2 ranks + 1 spare, waits until the spare's
workers are up (warm), then samples psutil cpu_times (user + system) of the spare's agent and of
every process below it (warm workers, checkpoint I/O process) over --window seconds, and prints
the CPU used in cores (CPU seconds / wall seconds) per process and in total. The active agents
are measured the same way, for comparison.

    python benchmarks/idle_spare.py [--window 20] [--steps 400]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
from benchmarks.procs import cpu_s, settle  # noqa: E402


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def status(run: Path) -> dict | None:
    r = subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(run), "--json"],
                       capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=20.0, help="seconds to sample over")
    p.add_argument("--steps", type=int, default=400, help="job length (must outlast startup + window)")
    p.add_argument("--persist-every", type=int, default=0, help="also run the agents' checkpoint I/O process")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run = tmp / "run"
        persist = ["--persist-every", str(a.persist_every)] if a.persist_every else []
        cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", "2", "--nproc-per-node", "2", "--spares", "1",
               "--run-dir", str(run), *persist, str(ROOT / "examples" / "train_gpt.py"),
               "--steps", str(a.steps), "--out", str(tmp / "out")]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING"})
        try:
            deadline = time.time() + 300
            while True:   # steady state: every node's workers up (the spare's warm), the job past its first steps
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"job ended or never got going (rc {proc.poll()})")
                st = status(run)
                if st and (st["step"] or 0) >= 5 and all(len(n["worker_pids"]) == 2 for n in st["nodes"]):
                    break
                time.sleep(0.5)
            procs = {n["role"] + f"-{n['node_id']}": tree(n["agent_pid"]) for n in st["nodes"]}
            spare = next(ps for k, ps in procs.items() if k.startswith("spare"))
            # the spare's workers import torch and the script's modules before they wait: seconds of CPU that
            # are a one-off start cost, not waiting. Measure once they have settled (benchmarks/procs.py).
            spare_pid = next(n["agent_pid"] for n in st["nodes"] if n["role"] == "spare")
            if settle(psutil.Process(proc.pid), {spare_pid}, 1, timeout=max(1.0, deadline - time.time())) is None:
                print("the spare's workers did not settle: the window includes their start", file=sys.stderr)
            print(f"spare start cost (agent + warm workers, CPU s until settled): {sum(cpu_s(q) for q in spare):.2f}")
            st = status(run) or st
            before = {k: [cpu_s(q) for q in ps] for k, ps in procs.items()}
            t0, step0 = time.time(), st["step"]
            time.sleep(a.window)
            wall = time.time() - t0
            after = {k: [cpu_s(q) for q in ps] for k, ps in procs.items()}
            step1 = (status(run) or {}).get("step", -1)
            if proc.poll() is not None:
                raise SystemExit("the job ended inside the window: raise --steps")
            print(f"window {wall:.1f} s, steps {step0}->{step1}, load average {os.getloadavg()}")
            for k, ps in sorted(procs.items()):
                per = [(q.name() if i else "agent", q.pid, (y - x) / wall)
                       for i, (q, x, y) in enumerate(zip(ps, before[k], after[k]))]
                total = sum(c for _, _, c in per)
                print(f"{k}: {total:.4f} cores  (" + ", ".join(f"{n}[{pid}] {c:.4f}" for n, pid, c in per) + ")")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

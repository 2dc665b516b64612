"""The main demo: a standalone phoenixrun job survives a node failure by hot swap.

Starts 3 nodes x 2 workers + 1 warm spare (all on this machine), SIGKILLs one node's agent and
workers together once training is under way, shows the cluster view, and waits for the job to
finish. Everything shown comes from the master's status API and its events log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from phoenixrun.protocol.client import ControlError
from phoenixrun.control.events import read_events
from phoenixrun.status import client_for, render

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="demo-run")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20, help="kill a node once every rank has passed this step")
    p.add_argument("--slot", type=int, default=1, help="node slot to kill")
    args = p.parse_args()
    console = Console()
    run_dir = Path(args.run_dir)
    out = Path(f"{args.run_dir}-out")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "phoenixrun"), "--standalone", "--nnodes", "3", "--nproc-per-node", "2",
           "--spares", "1", "--run-dir", str(run_dir), str(HERE / "train_gpt.py"), "--steps", str(args.steps),
           "--out", str(out)]
    console.rule("[bold]phoenixrun demo")
    console.print("$ " + " ".join(cmd))
    job = subprocess.Popen(cmd, env={**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING"})
    state = None
    while job.poll() is None:
        try:
            state = client_for(run_dir, None, None).get_json("/v1/state")
        except ControlError:
            state = None
        if state and state.get("step") is not None and state["step"] >= args.kill_at:
            break
        time.sleep(0.2)
    if state is None or job.poll() is not None:
        console.print("[red]the job ended before the kill step")
        return job.wait()
    console.print(render(state))
    node = next(n for n in state["nodes"] if n["slot"] == args.slot)
    console.rule(f"[bold red]SIGKILL node slot {args.slot}: agent {node['agent_pid']} + workers {node['worker_pids']}")
    for pid in [node["agent_pid"], *node["worker_pids"]]:
        os.kill(pid, signal.SIGKILL)
    client = client_for(run_dir, None, None)
    while job.poll() is None:
        try:
            state = client.get_json("/v1/state")
        except ControlError:
            break
        if state["recoveries"] >= 1:
            console.print(render(state))
            break
        time.sleep(0.1)
    rc = job.wait()
    console.rule("[bold]events")
    for e in read_events(run_dir / "events.jsonl"):
        if e["event"] in ("fault_detected", "recovery_started", "spare_promoted", "recovery_done", "job_finished"):
            console.print(json.dumps(e))
    done = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "recovery_done"]
    if done:
        d = done[-1]
        console.print(f"[bold green]hot swap: {d['duration_s']:.2f}s from detection to resumed, restored step "
                      f"{d['restored_step']}, {d['replayed_steps']} step(s) replayed")
    console.print(f"job exit code {rc}; per-rank results in {out}/")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Soak: one long job, N faults of mixed kinds at random moments, spares replenished; is the result still
bit-identical to a fault-free run, and how long did each recovery take?

Fault kinds (picked at random, seeded): kill-node (SIGKILL an active node's agent and workers), kill-worker
(SIGKILL one worker), the `phoenixrun inject` faults crash-worker, comm-timeout, xid:79 and ecc, and the two
mixed cases of issue 20: crash-worker twice on one slot 0.5 s apart, and a node and its replica holder killed
0.2 s apart (rank state then exists on disk only: a fallback). After each fault the pool of spares is topped up
with `phoenixrun agent` processes.

    nice python benchmarks/soak.py [--faults 15] [--nodes 3] [--spares 2] [--steps 1100] [--gap 8 15]
                                   [--seed 1] [--json out.json]

The default --steps (1,100) dates from before snapshots could grow: past ~1,280 steps the example's growing `state`
outgrew its snapshot metadata slot and the job livelocked in local resets (seen in a 3000-step soak at step 1283).
Slots now grow at the step boundary (docs/api.md), so longer soaks are possible; the published figures are from
1,100-step runs.

Reports recoveries, cascades (extra cycles of a recovery, fallback retries), the duration of each recovery and
fallback (min/median/max) and whether the final parameters and optimizer state equal a fault-free torchrun run's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phoenixrun.protocol.client import ControlError
from phoenixrun.status import client_for
from phoenixrun.topology import Layout, place_replicas

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
SMALL = ["--layers", "1", "--d-model", "64", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "4"]
KINDS = ("kill-node", "kill-worker", "crash-worker", "comm-timeout", "xid:79", "ecc", "crash-worker-x2",
         "node+holder")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PHOENIXRUN_", "PET_", "TORCHELASTIC_"))}
    e.update({"PHOENIXRUN_LOG_LEVEL": "WARNING"})
    return e


def state(run_dir: Path) -> dict | None:
    try:
        return client_for(run_dir, None, None).get_json("/v1/state")
    except (ControlError, ValueError, OSError):
        return None


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def active(s: dict) -> dict[int, dict]:
    return {n["slot"]: n for n in s["nodes"] if n["role"] == "active" and n["slot"] is not None}


def inject(run_dir: Path, slot: int, fault: str) -> None:
    try:
        client_for(run_dir, None, None).post("/v1/inject", {"slot": slot, "fault": fault})
    except ControlError as e:
        print(f"  inject {fault} into slot {slot} failed: {e}", flush=True)


def fault(kind: str, s: dict, run_dir: Path, rng: random.Random, holders: dict[int, list[int]]) -> str:
    nodes = active(s)
    slot = rng.choice(sorted(nodes))
    if kind == "kill-node":
        kill([nodes[slot]["agent_pid"], *nodes[slot]["worker_pids"]])
    elif kind == "kill-worker":
        kill(rng.sample(nodes[slot]["worker_pids"], 1) if nodes[slot]["worker_pids"] else [])
    elif kind == "crash-worker-x2":
        inject(run_dir, slot, "crash-worker")
        time.sleep(0.5)
        inject(run_dir, slot, "crash-worker")
    elif kind == "node+holder":
        other = next((h for h in holders.get(slot, []) if h in nodes and h != slot), None)
        kill([nodes[slot]["agent_pid"], *nodes[slot]["worker_pids"]])
        if other is not None:
            time.sleep(0.2)
            kill([nodes[other]["agent_pid"], *nodes[other]["worker_pids"]])
            return f"{kind} slots {slot},{other}"
    else:
        inject(run_dir, slot, kind)
    return f"{kind} slot {slot}"


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "min": round(min(xs), 2), "median": round(statistics.median(xs), 2),
            "max": round(max(xs), 2)} if xs else {"n": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=15)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--spares", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1100)
    ap.add_argument("--gap", type=float, nargs=2, default=(8.0, 15.0), help="seconds between faults (uniform)")
    ap.add_argument("--persist-every", type=int, default=10)
    ap.add_argument("--max-fallbacks", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kinds = a.kinds.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="phoenixrun-soak-"))
    script = ["--steps", str(a.steps), *SMALL]
    world = a.nodes * a.nproc

    t0 = time.time()
    subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(world), str(EXAMPLE),
                    *script, "--out", str(tmp / "ref")], check=True, env=env(), cwd=tmp, capture_output=True)
    print(f"fault-free reference (torchrun, {world} ranks, {a.steps} steps): {time.time() - t0:.0f}s", flush=True)

    run_dir, out = tmp / "run", tmp / "out"
    log = open(tmp / "run.log", "w")
    flags = ["--persist-every", str(a.persist_every), "--max-fallbacks", str(a.max_fallbacks)]
    job = subprocess.Popen([str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(a.nodes), "--nproc-per-node",
                            str(a.nproc), "--spares", str(a.spares), "--run-dir", str(run_dir), *flags, str(EXAMPLE),
                            *script, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp)
    holders = {}
    for r, hs in place_replicas(Layout(a.nodes, a.nproc), 1).items():
        holders.setdefault(r // a.nproc, []).extend(hs)
    extra: list[subprocess.Popen] = []
    injected: list[str] = []
    t_start = time.time()
    while job.poll() is None and len(injected) < a.faults:
        time.sleep(rng.uniform(*a.gap))
        s = state(run_dir)
        if s is None or s["phase"] != "running" or s["step"] is None or len(active(s)) < a.nodes:
            continue     # a moment when nothing runs is not a random moment of training: draw again
        what = fault(rng.choice(kinds), s, run_dir, rng, holders)
        injected.append(what)
        print(f"  t={time.time() - t_start:6.1f}s step {s['step']}: {what}", flush=True)
        # top the spares up (a killed or fenced node does not come back; a repaired one joins as a spare)
        spares = sum(n["role"] == "spare" for n in s["nodes"])
        lost = {"kill-node": 1, "node+holder": 2, "xid:79": 1, "ecc": 1}.get(what.split()[0], 0)
        endpoint = json.loads((run_dir / "master.json").read_text())["endpoint"]
        for _ in range(max(0, a.spares - spares + lost)):
            extra.append(subprocess.Popen(
                [str(BIN / "phoenixrun"), "agent", "--rdzv-endpoint", endpoint, "--nproc-per-node", str(a.nproc),
                 "--secret-file", str(run_dir / "secret"), "--heartbeat-interval", "0.5", "--", str(EXAMPLE),
                 *script, "--out", str(out)], stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp))
    try:
        rc = job.wait(timeout=3600)
    finally:
        for p in extra:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in extra:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    wall = time.time() - t_start

    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    by = lambda name: [e for e in events if e["event"] == name]   # noqa: E731
    done, fb_done = by("recovery_done"), by("fallback_done")
    ref = {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp / "ref").glob("rank*.json")}
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    identical = rc == 0 and ref.keys() == got.keys() and all(
        ref[r][k] == got[r][k] for r in ref for k in ("param_sha256", "optim_sha256", "losses"))
    report = {
        "faults": injected, "exit_code": rc, "wall_s": round(wall, 1), "bit_identical": identical,
        "recoveries": len(done), "fallbacks": len(fb_done), "restarts": len(by("restart")),
        "cascades": sum(d.get("attempts", 1) - 1 for d in done) + len(by("fallback_restart")) - len(fb_done),
        "recovery_s": summary([d["duration_s"] for d in done]),
        "fallback_s": summary([d["duration_s"] for d in fb_done]),
        "spares_promoted": len(by("spare_promoted")), "run_dir": str(run_dir),
        "job_finished": (by("job_finished") or [{}])[-1].get("reason"),
    }
    print(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Detection latency and recovery time per fault class, measured from the events log.

Each fault is injected with `phoenixrun inject` into a running standalone job (2 nodes x 2 ranks
+ 1 spare, the small example model); latency is `fault_detected.t - fault_injected.t` (the
injection is queued to the node's agent with its next heartbeat reply, so up to one heartbeat
interval of the figure is delivery), recovery is `recovery_done.duration_s`. A NaN loss is not recovered
(the job stops); its latency includes waiting for the poisoned worker's next `job.observe_loss()`.

    python benchmarks/detection.py [--hang-timeout 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import BIN, by_event, env, launch  # noqa: E402  (the e2e harness is the one way to run jobs)

# partition: dropped until the job ends (the launcher then stops that agent); nan: the job stops (exit 1)
FAULTS = ["crash-worker", "kill-node", "hang", "xid:79", "xid:48", "xid:13", "partition", "comm-timeout", "nan"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hang-timeout", type=float, default=3.0)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for fault in args.faults.split(","):
        with tempfile.TemporaryDirectory(prefix="phoenixrun-detect-") as tmp:
            job = launch(Path(tmp), "job", nnodes=2, spares=1, steps=40,
                         extra_flags=["--hang-timeout", str(args.hang_timeout)])
            job.wait_for(lambda s: (s["step"] or 0) >= 6 and all(len(n["worker_pids"]) == 2 for n in s["nodes"]),
                         what="training with a warm spare")
            subprocess.run([str(BIN / "phoenixrun"), "inject", "--run-dir", str(job.run_dir), "--node", "1",
                            "--fault", fault], check=True, env=env(), capture_output=True)
            rc = job.finish()
            ev = job.events()
            injected = by_event(ev, "fault_injected")[0]
            detected = [e for e in by_event(ev, "fault_detected") if not e.get("during_recovery")][0]
            done = by_event(ev, "recovery_done")
            rows.append({"fault": fault, "class": detected["class"], "action": detected["action"], "exit_code": rc,
                         "detect_s": round(detected["t"] - injected["t"], 3),
                         "recovery_s": done[0]["duration_s"] if done else None,
                         "replayed_steps": done[0]["replayed_steps"] if done else None})
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'fault':<13} {'class':<16} {'action':<17} {'detect s':>9} {'recovery s':>11} {'exit':>5}")
    for r in rows:
        rec = f"{r['recovery_s']:.3f}" if r["recovery_s"] is not None else "-"
        print(f"{r['fault']:<13} {r['class']:<16} {r['action']:<17} {r['detect_s']:>9.3f} {rec:>11} {r['exit_code']:>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

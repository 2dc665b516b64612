"""Collect measured recovery phases into one samples file for `phoenixrun simulate --recovery-fit`.

Inputs: JSON summaries of benchmarks/recovery.py (each trial's `recovery_done` phases and
detection time, at world size nodes x nproc) and of benchmarks/master_scale.py (the master's own
recovery time with instantly-acking simulated agents, `control_s`, at nodes x nproc GPUs).

    python benchmarks/recovery_fit.py --recovery r-2x1.json r-4x2.json ... --scale s-1024.json ... \\
        --out docs/recovery-samples.json [--cpu-normalize 2]

--cpu-normalize CORES: on a small machine every process of a bigger job gets a smaller share of
the cores, so the worker-side phases grow with the job for that reason alone. This divides them by
the oversubscription max(1, processes / CORES) (processes = ranks + the spare's workers), i.e.
assumes they are CPU-bound. Detection, plan and the control plane are left as measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PHASES = ("quiesce_s", "plan_s", "restore_s", "rebuild_s", "fetch_s", "state_s")
WORKER_SIDE = ("quiesce_s", "restore_s", "rebuild_s", "fetch_s", "state_s")
# results written before protocol/timings.py named the one load of model and optimizer state twice
# (`params_s` = `optimizer_s`, the same number): read as `state_s`
OLD_NAMES = {"state_s": "optimizer_s"}


def from_recovery(path: Path, cores: float | None) -> list[dict]:
    d = json.loads(path.read_text())
    cfg = d["config"]
    nodes, nproc = cfg["nodes"], cfg.get("nproc", 2)
    gpus = nodes * nproc
    factor = max(1.0, (gpus + nproc) / cores) if cores else 1.0
    out = []
    for i, t in enumerate(d["phoenixrun"]):
        phases = {"detect_s": round(t["detect_s"], 4)}
        for p in PHASES:
            v = t["phases"].get(p, t["phases"].get(OLD_NAMES.get(p, "")))
            phases[p] = None if v is None else round(v / factor, 5) if p in WORKER_SIDE else v
        out.append({"gpus": gpus, "source": f"recovery.py {nodes}x{nproc} trial {i}", "cpu_factor": factor,
                    "phases": phases})
    return out


def from_scale(path: Path) -> list[dict]:
    d = json.loads(path.read_text())
    cfg, rec = d["config"], d["recovery"]
    return [{"gpus": cfg["nodes"] * cfg["nproc_per_node"],
             "source": f"master_scale.py {cfg['nodes']} nodes x {cfg['nproc_per_node']}",
             "phases": {"control_s": rec["recovery_s"]}}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recovery", nargs="*", type=Path, default=[])
    p.add_argument("--scale", nargs="*", type=Path, default=[])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu-normalize", type=float, default=None, metavar="CORES",
                   help="divide worker-side phases by the CPU oversubscription on a machine with CORES cores")
    args = p.parse_args()
    if args.cpu_normalize is not None and args.cpu_normalize <= 0:
        p.error("--cpu-normalize must be > 0")
    samples = [s for f in args.recovery for s in from_recovery(f, args.cpu_normalize)] + [s for f in args.scale for s in from_scale(f)]
    if not samples:
        p.error("no inputs: pass --recovery and/or --scale files")
    args.out.write_text(json.dumps({"samples": samples}, indent=1) + "\n")
    print(f"{len(samples)} samples -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

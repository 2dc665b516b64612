"""Does a long protected run stay as fast at its end as at its start? (issue 31 item 6)

Runs examples/train_gpt.py under phoenixrun (2 nodes x 2 ranks, standalone, CPU, a tiny model so that a step is
short and any per-step cost that grows with the run shows) for --steps steps, fault-free, and reports the median
step time (slowest rank per step, from the ranks' result files) over the first and the last --span steps after
--warmup, their ratio, and the size of the state dict's JSON at the end. Before the fix the example kept a loss
and a time per step in `state`, which every snapshot encoded whole: the median step grew ~5x over 8,000 steps.

    python benchmarks/long_run.py [--steps 10000] [--span 500] [--out benchmarks/results/long-run.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import BIN, ROOT  # noqa: E402

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "2"]


def run(tmp: Path, steps: int, span: int, warmup: int, timeout: float = 7200) -> dict:
    out, run_dir = tmp / "out", tmp / "run"
    env = {**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING"}
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", "2", "--nproc-per-node", "2", "--run-dir",
           str(run_dir), str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), "--out", str(out), *TINY]
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=timeout)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    per_step = [max(r["step_seconds"][s] for r in ranks) for s in range(steps)]
    start = statistics.median(per_step[warmup:warmup + span])
    end = statistics.median(per_step[-span:])
    return {"steps": steps, "span": span, "warmup": warmup, "start_median_s": round(start, 5),
            "end_median_s": round(end, 5), "ratio": round(end / start, 3),
            "state_bytes": max(r["state_bytes"] for r in ranks), "load_avg": round(os.getloadavg()[0], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--span", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = run(Path(tmp), a.steps, a.span, a.warmup)
    print(json.dumps(r, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()

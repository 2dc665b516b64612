"""Lost time per fault for the loops people run: hot swap vs the torchrun-style restart of the same script.

For each framework script (a DataLoader loop, an accelerate loop, the HF Trainer, Lightning; tests/scripts/), two
arms in one sitting, each a --standalone job of NODES nodes x 1 rank + 1 warm spare with one node's agent and
workers SIGKILLed once every rank has finished step KILL (benchmarks/recovery.py's phoenix_trial):

- hot swap: the script opted in (data=/stateful=, the accelerate adapter, PhoenixTrainer, PhoenixDDPStrategy);
- restart: the same script with PHOENIXRUN_PROTECT=0 and --max-restarts 1, i.e. torchrun's semantics: every worker
  restarts with the spare. The scripts keep no checkpoint, so the restart also recomputes the KILL steps before the
  fault (a few ms each here, reported as step_s); the rest is what a restart costs whatever the checkpoint interval.

Lost time: the kill -> every rank has finished the interrupted step again (from the ranks' progress logs).

    python benchmarks/frameworks.py [--frameworks dataloader,accelerate,hf,lightning] [--trials 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.recovery import phoenix_trial  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "scripts"
FRAMEWORKS = {   # name -> (script, its arguments, the library it needs)
    "dataloader": (SCRIPTS / "dataloader_loop.py", ["--mode", "managed"], None),
    "accelerate": (SCRIPTS / "accelerate_loop.py", [], "accelerate"),
    "hf": (SCRIPTS / "hf_trainer.py", [], "transformers"),
    "lightning": (SCRIPTS / "lightning_loop.py", [], "lightning"),
}


def arms(name: str, nodes: int, steps: int, kill: int, tmp: Path) -> dict:
    script, script_args, _ = FRAMEWORKS[name]
    hot = phoenix_trial(tmp, nodes, 1, steps, kill, script_args, script, name="hot")
    restart = phoenix_trial(tmp, nodes, 1, steps, kill, script_args, script, flags=("--max-restarts", "1"),
                            env={"PHOENIXRUN_PROTECT": "0"}, name="restart")
    return {"hot_swap": hot, "restart": restart}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill", type=int, default=30)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    summary: dict = {"config": vars(args), "frameworks": {}}
    for name in args.frameworks.split(","):
        need = FRAMEWORKS[name][2]
        if need is not None and importlib.util.find_spec(need) is None:
            print(f"{name}: skipped ({need} is not installed: pip install -e '.[integrations]')", flush=True)
            continue
        rows = []
        for i in range(args.trials):
            with tempfile.TemporaryDirectory(prefix=f"phoenixrun-{name}-") as tmp:
                rows.append(arms(name, args.nodes, args.steps, args.kill, Path(tmp)))
            print(f"{name} trial {i}: {json.dumps(rows[-1])}", flush=True)
        med = {arm: statistics.median(r[arm]["lost_s"] for r in rows) for arm in ("hot_swap", "restart")}
        summary["frameworks"][name] = {
            "trials": rows, "hot_swap_lost_s": med["hot_swap"], "restart_lost_s": med["restart"],
            "ratio": med["restart"] / med["hot_swap"],
            "survivors_kept": sum(r["hot_swap"]["survivors_kept"] is True for r in rows),
            "exit_codes": sorted({r[a]["exit_code"] for r in rows for a in ("hot_swap", "restart")})}
        s = summary["frameworks"][name]
        print(f"{name}: lost per fault, medians of {len(rows)}: hot swap {s['hot_swap_lost_s']:.2f} s, restart "
              f"{s['restart_lost_s']:.2f} s ({s['ratio']:.1f}x); survivors kept their processes in "
              f"{s['survivors_kept']} of {len(rows)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(s["exit_codes"] == [0] for s in summary["frameworks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

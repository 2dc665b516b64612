"""Fault-free overhead of in-memory protection, protection on vs off, alternated in one run.

The same job (examples/train_gpt.py, 2 nodes x 2 ranks, standalone, CPU) runs with
PHOENIXRUN_PROTECT=0 (off), =1 (on), and =1 with a warm spare (--spares 1; on this one machine the
spare's agent and pre-started workers share the CPUs with the job), arms rotated within each round.
Both ratios are against the same unprotected arm. Per-iteration times come from the ranks'
result files; the first --warmup steps are dropped and the slowest 5% trimmed (as the paper
does). The protected arms run twice the steps and their ratios count only the steps that began after
the pre-started workers went idle - each active node's standby worker (started once the node trains)
and, in the spare arm, the spare's: their one-time start (each imports torch, several CPU seconds)
takes this machine's cores from the job, which on a cluster it never shares (a node has many host
cores, the spare is a node of its own); the ratio during that start is reported beside it. It reports the median step-time ratio, the D2H and H2H times against
the compute window (the paper's Fig. 9 breakdown), bytes replicated per step and host memory per rank, then grows
the model to find the knee where the transfer no longer hides behind compute.

With --persist-every N a third arm runs protection plus the agents' persistent checkpoints every
N steps, so both ratios come from the same run.

--layouts adds other parallelisms, each at its example's default model, with the same arms: `fsdp2`
(examples/train_fsdp2.py, 2 nodes x 2: every DTensor shard rank-private, so the parameters and moments
are replicated) and `3d` (examples/train_3d.py, TP 2 x PP 2 x FSDP2 2 on 4 nodes x 2).

    python benchmarks/overhead.py [--pairs 3] [--steps 40] [--sizes 256,512,768] [--persist-every 10]
                                  [--layouts ddp,fsdp2,3d]
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

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.procs import settle, standbys_settled  # noqa: E402
from tests.harness import BIN, ROOT, Job  # noqa: E402


# layout -> (example, nnodes, ranks per node)
LAYOUTS = {"ddp": ("train_gpt.py", 2, 2), "fsdp2": ("train_fsdp2.py", 2, 2), "3d": ("train_3d.py", 4, 2)}


def run_job(tmp: Path, name: str, protect: bool, steps: int, model: list[str], persist: list[str],
            spares: int = 0, layout: str = "ddp") -> dict:
    """The job's per-step times (slowest rank), the ranks' protection stats, and when protected `settled_step`: the
    first step that began after the pre-started workers (the nodes' standbys, the spare's) went idle (None: they
    did not, or unknown)."""
    out, stats, run_dir, progress = (tmp / f"{name}-{x}" for x in ("out", "stats", "run", "progress"))
    stats.mkdir(parents=True)
    progress.mkdir()
    env = {**os.environ, "PHOENIXRUN_PROTECT": "1" if protect else "0", "PHOENIXRUN_STATS_DIR": str(stats),
           "PHOENIXRUN_LOG_LEVEL": "WARNING"}
    script, nnodes, nproc = LAYOUTS[layout]
    timing = ["--progress-dir", str(progress)] if script == "train_gpt.py" else []
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--spares", str(spares), "--run-dir", str(run_dir), *persist, str(ROOT / "examples" / script),
           "--steps", str(steps), "--out", str(out), *model, *timing]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        settled = prestarted_settled(proc, run_dir, out, nproc, spares) if protect and timing else None
        if proc.wait(timeout=900) != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    finally:
        if proc.poll() is None:
            proc.kill()
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    # a step ends when its slowest rank is done: take the max over ranks per step
    per_step = [max(r["step_seconds"][s] for r in ranks) for s in range(steps)]
    lines = [json.loads(x) for p in stats.glob("*.jsonl") for x in p.read_text().splitlines()]
    return {"steps": per_step, "stats": lines, "settled_step": first_step_after(settled, progress, per_step)}


def prestarted_settled(proc: subprocess.Popen, run_dir: Path, out: Path, nproc: int, spares: int) -> float | None:
    """When every pre-started worker of the job went idle: the active nodes' standby workers and, with `spares`,
    the spare's warm workers (None: they did not)."""
    spare_t = spare_settled(proc, run_dir, out) if spares else 0.0
    if spare_t is None:
        return None
    try:
        state = Job(run_dir, out, proc).wait_for(
            lambda st: any(n.get("role") == "active" for n in st.get("nodes", [])), 300, "the active nodes")
    except AssertionError:
        return None
    active = {n["agent_pid"] for n in state["nodes"] if n.get("role") == "active"}
    standby_t = standbys_settled(psutil.Process(proc.pid), active, nproc, timeout=600)
    return None if standby_t is None else max(spare_t, standby_t)


def spare_settled(proc: subprocess.Popen, run_dir: Path, out: Path) -> float | None:
    """When the warm spare's pre-started workers went idle. Their start (each imports torch and the script: several
    CPU seconds) shares this machine's cores with the job's ranks; on a cluster it runs on the spare's own node."""
    try:
        state = Job(run_dir, out, proc).wait_for(
            lambda st: any(n.get("role") == "spare" for n in st.get("nodes", [])), 300, "a spare")
    except AssertionError:
        return None
    spare_pids = {n["agent_pid"] for n in state["nodes"] if n.get("role") == "spare"}
    return settle(psutil.Process(proc.pid), spare_pids, len(spare_pids), timeout=600)


def first_step_after(t: float | None, progress: Path, per_step: list[float]) -> int | None:
    """The first step every rank began after time `t` (a step begins when the rank's previous one ended; progress
    holds 'step unix_time' lines per rank). None: no `t`, or no step began after it."""
    if t is None:
        return None
    ends: dict[int, float] = {}
    for log in progress.glob("rank*.log"):
        for line in log.read_text().split("\n"):
            if line.strip():
                step, when = line.split()
                ends[int(step)] = max(ends.get(int(step), 0.0), float(when))
    return next((s for s in range(len(per_step)) if ends.get(s, 0.0) - per_step[s] >= t), None)


def _spread(xs: list[float], runs: int) -> float:
    """(max - min) / min of the per-run medians, the run's samples being consecutive chunks of xs."""
    if runs < 2:
        return 0.0
    n = len(xs) // runs
    meds = [statistics.median(xs[k * n:(k + 1) * n]) for k in range(runs)]
    return (max(meds) - min(meds)) / min(meds)


def trimmed(xs: list[float], warmup: int) -> list[float]:
    xs = sorted(xs[warmup:])
    return xs[: max(1, int(len(xs) * 0.95))]


def measure(tmp: Path, label: str, pairs: int, steps: int, warmup: int, model: list[str], persist: list[str],
            layout: str = "ddp") -> dict:
    """Arms: protection off, on, on + a warm spare, and (with --persist-every) on + persistent checkpoints,
    rotated per round."""
    arms = [("off", False, [], 0), ("on", True, [], 0), ("spare", True, [], 1)] + \
        ([("persist", True, persist, 0)] if persist else [])
    times: dict[str, list[float]] = {tag: [] for tag, *_ in arms}
    starting: dict[str, list[float]] = {tag: [] for tag, *_ in arms}   # steps while pre-started workers started
    settled_steps: dict[str, list[int | None]] = {tag: [] for tag, *_ in arms}
    spare_series: list[list[float]] = []   # the spare arm's every step, run by run (its start, then steady state)
    stats = []
    load = [os.getloadavg()[0]]
    for i in range(pairs):
        # rotate which goes first so drift in machine load hits every arm alike
        for tag, protect, flags, spares in arms[i % len(arms):] + arms[:i % len(arms)]:
            # a protected arm runs twice as long: its first steps share the CPUs with the standbys' (and the
            # spare's) start
            r = run_job(tmp, f"{label}-{tag}-{i}", protect, steps * (2 if protect else 1), model, flags, spares,
                        layout)
            load.append(os.getloadavg()[0])
            if spares:
                spare_series.append([round(x, 5) for x in r["steps"]])
            if protect:
                settled_steps[tag].append(r["settled_step"])
            if protect and r["settled_step"] is not None:
                starting[tag].extend(r["steps"][warmup:max(warmup, r["settled_step"])])
                times[tag].extend(trimmed(r["steps"], max(warmup, r["settled_step"])))
            else:   # unprotected, or never settled (or no progress times): every step counts, the start included
                times[tag].extend(trimmed(r["steps"], warmup))
            if tag == "on":
                stats.extend(s for s in r["stats"] if s["step"] > warmup)
    med = lambda key: statistics.median(s[key] for s in stats if s.get(key) is not None)  # noqa: E731
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "model": label, "step_on_s": on, "step_off_s": off, "ratio": on / off,
        "step_spare_s": statistics.median(times["spare"]), "ratio_spare": statistics.median(times["spare"]) / off,
        # the pre-started workers' one-time start on this shared machine (on a cluster: a node's spare host cores,
        # the spare's own node): the steps from --warmup until they went idle, and the step that was in each run
        "ratio_start": statistics.median(starting["on"]) / off if starting["on"] else None,
        "settled_step": settled_steps["on"],
        "ratio_spare_start": statistics.median(starting["spare"]) / off if starting["spare"] else None,
        "spare_settled_step": settled_steps["spare"],
        "spare_step_series_s": spare_series,
        # the spread of the off arm's per-run medians: how much the same job moves between runs right now
        "off_spread": _spread(times["off"], pairs), "load_avg_1m": [min(load), max(load)],
        "persist_every": int(persist[1]) if persist else 0,
        "step_persist_s": statistics.median(times["persist"]) if persist else None,
        "ratio_persist": statistics.median(times["persist"]) / off if persist else None,
        "d2h_s": med("d2h_s"), "h2h_s": med("h2h_s"), "window_s": med("window_s"), "stall_s": med("stall_s"),
        "replicated_bytes_per_rank": med("replicated_bytes"), "slot_bytes": med("slot_bytes"),
        # host memory per rank: two local slots + (k=1) two receive buffers for the peer's replicated part
        "host_bytes_per_rank": 2 * med("slot_bytes") + 2 * med("replicated_bytes"),
        "state_bytes_per_rank": med("private_bytes") + med("shared_bytes"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sizes", default="256,512,768", help="d_model values: the first is the default config")
    p.add_argument("--knee-pairs", type=int, default=None, help="rounds for the larger sizes (default: --pairs)")
    p.add_argument("--persist-every", type=int, default=0,
                   help="add a third arm: protection on + persistent checkpoints every N steps")
    p.add_argument("--layouts", default="ddp",
                   help=f"comma-separated, of {', '.join(LAYOUTS)}: ddp over --sizes, the others at their defaults")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="pace every step to at least this long (the suite's small run: a tiny model's job then "
                        "outlasts the pre-started workers' start; the ratios are then of sleeps, not of compute)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layout(s) {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    persist = ["--persist-every", str(args.persist_every)] if args.persist_every else []
    rows, others = [], []
    with tempfile.TemporaryDirectory(prefix="phoenixrun-overhead-") as tmp:
        if "ddp" in layouts:
            for i, d in enumerate(int(x) for x in args.sizes.split(",")):
                model = ["--d-model", str(d), "--layers", "2"] + \
                    (["--step-seconds", str(args.step_seconds)] if args.step_seconds else [])
                rows.append(measure(Path(tmp), f"d{d}", args.pairs if i == 0 or args.knee_pairs is None else args.knee_pairs, args.steps,
                                    args.warmup, model, persist))
                print(_fmt(rows[-1]), flush=True)
        for layout in (x for x in layouts if x != "ddp"):
            others.append(measure(Path(tmp), layout, args.pairs, args.steps, args.warmup, [], persist, layout))
            print(_fmt(others[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows + others, indent=2))
    if not rows:
        return 0
    # the knee: the first size whose D2H + H2H no longer fits in the compute window
    knee = next((r["model"] for r in rows if r["d2h_s"] + r["h2h_s"] > r["window_s"]), None)
    print(f"default config ratio {rows[0]['ratio']:.3f} without a spare, {rows[0]['ratio_spare']:.3f} with a warm "
          f"spare (goal <= 1.02); transfer stops hiding behind compute at: "
          f"{knee or 'not reached up to d_model ' + args.sizes.split(',')[-1]}")
    if args.persist_every:
        print(f"with --persist-every {args.persist_every}: ratio {rows[0]['ratio_persist']:.3f} "
              f"(vs {rows[0]['ratio']:.3f} without persistence, same run)")
    return 0


def _fmt(r: dict) -> str:
    persist = (f" (+ persist every {r['persist_every']}: {1000 * r['step_persist_s']:.1f} ms = ratio "
               f"{r['ratio_persist']:.3f})" if r["persist_every"] else "")
    start = (f" (while the spare's workers start: {r['ratio_spare_start']:.3f}, until steps "
             f"{r['spare_settled_step']})" if r.get("ratio_spare_start") else "")
    on_start = (f" (while the standby workers start: {r['ratio_start']:.3f}, until steps {r['settled_step']})"
                if r.get("ratio_start") else "")
    return (f"{r['model']}: step on {1000 * r['step_on_s']:.1f} ms / off {1000 * r['step_off_s']:.1f} ms = "
            f"ratio {r['ratio']:.3f}{on_start}; with a warm spare {1000 * r['step_spare_s']:.1f} ms = ratio "
            f"{r['ratio_spare']:.3f}{start}{persist}; off arm run-to-run spread {100 * r['off_spread']:.1f}%, load average "
            f"{r['load_avg_1m'][0]:.1f}-{r['load_avg_1m'][1]:.1f}; d2h {1000 * r['d2h_s']:.2f} ms, h2h {1000 * r['h2h_s']:.2f} ms vs compute "
            f"window {1000 * r['window_s']:.1f} ms (exposed stall {1000 * r['stall_s']:.2f} ms); replicated "
            f"{r['replicated_bytes_per_rank'] / 1e6:.2f} MB/rank/step; host memory {r['host_bytes_per_rank'] / 1e6:.1f}"
            f" MB/rank for {r['state_bytes_per_rank'] / 1e6:.1f} MB of state")


if __name__ == "__main__":
    sys.exit(main())

"""Hot swap vs checkpoint-restart: the same job and the same kill step, side by side in one run.

phoenixrun: --standalone, NODES nodes x NPROC ranks (default 2) + 1 warm spare; one node's agent and workers
are SIGKILLed once every rank is working on step KILL. torchrun: the same world size on one
agent with --max-restarts 1, the example checkpointing every K steps (per-rank torch.save,
resumed on restart); one worker is SIGKILLed at the same step.

For each it reports the lost time (kill -> every rank has finished the kill step again, from
the ranks' own progress logs), the recovery latency and the replayed steps, and the ratio.

    python benchmarks/recovery.py [--nodes 4] [--nproc 2] [--kill 80] [--ckpt-every 50] [--trials 3]
                                  [--no-baseline] [--json out.json]

--no-baseline skips torchrun: the per-phase recovery times are what the measured recovery curve
(`phoenixrun simulate --rank-result`, phoenixrun/sim/recovery_curve.py) adds to the control plane.

--long-steps S runs tests/scripts/long_steps.py instead of the example: steps of about S seconds spent in backward
(sleeps between DDP gradient buckets, so the machine's load hardly matters), the kill early in a step. It also
reports whether the survivors kept their worker processes (the same pids after the recovery) and the quiesce
phase against the step time.

--worker-death SIGKILLs one worker of slot 1 instead of a node (a local reset, no spare), in two arms per trial, one
after the other in one sitting: without a standby worker (--no-standby-worker: the dead rank's new process starts,
imports torch and restores) and with one (the rank goes to the node's standby waiting in phoenixrun.init(); the kill
waits until it is ready). Per arm: detection, recovery, lost time, whether the standby took the rank and the other
workers kept their processes; for the standby, its memory (RSS) and CPU while it waits (over IDLE_WINDOW_S).

    python benchmarks/recovery.py --worker-death --nodes 2 --nproc 2 --steps 400 --kill 40 --trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
LONG_STEPS = ROOT / "tests" / "scripts" / "long_steps.py"
IDLE_WINDOW_S = 5.0     # --worker-death: the standby's idle CPU is read over this many seconds before the kill


def progress(d: Path) -> dict[int, list[tuple[int, float]]]:
    out = {}
    for p in d.glob("rank*.log"):
        out[int(p.stem[4:])] = [(int(a), float(b)) for a, b in (x.split() for x in p.read_text().splitlines() if x)]
    return out


def wait_all_reached(d: Path, world: int, step: int, after: float, proc: subprocess.Popen, timeout=600) -> float:
    """The first time at which every rank has logged step >= `step` finishing after `after`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        prog = progress(d)
        if len(prog) == world:
            times = [min((t for s, t in lines if s >= step and t > after), default=None) for lines in prog.values()]
            if all(t is not None for t in times):
                return max(times)
        if proc.poll() is not None:
            raise RuntimeError(f"job ended (exit {proc.returncode}) before every rank passed step {step}")
        time.sleep(0.05)
    raise RuntimeError("timed out waiting for progress")


def latest_step(d: Path) -> int:
    return max(s for lines in progress(d).values() for s, _ in lines)


def status(run: Path) -> dict:
    return json.loads(subprocess.run([str(BIN / "phoenixrun"), "status", "--run-dir", str(run), "--json"],
                                     capture_output=True, text=True, check=True).stdout)


def phoenix_trial(tmp: Path, nodes: int, nproc: int, steps: int, kill: int, model: list[str],
                  script: Path = EXAMPLE, flags: tuple[str, ...] = (), env: dict | None = None,
                  name: str = "ph") -> dict:
    """One job with a node killed at step `kill`. `flags`/`env` make it another arm (benchmarks/frameworks.py: the
    same script unprotected, with --max-restarts: torchrun's restart); without a hot swap in its events, only the
    lost time and the survivors' processes are reported."""
    run, prog = tmp / f"{name}-run", tmp / f"{name}-progress"
    prog.mkdir(parents=True)
    world = nodes * nproc
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nodes), "--nproc-per-node", str(nproc), "--spares", "1",
           "--run-dir", str(run), *flags, str(script), "--steps", str(steps), "--out", str(tmp / f"{name}-out"),
           "--progress-dir", str(prog), *model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING", **(env or {})})
    wait_all_reached(prog, world, 0, 0, proc)
    while True:  # steady state of a real job: the spare's workers are up (warm) long before a failure
        state = status(run)   # (unprotected, a spare starts its workers only when a restart needs them)
        if all(len(n["worker_pids"]) == nproc for n in state["nodes"] if n["role"] == "active" or not flags):
            break
        time.sleep(0.2)
    node = next(n for n in state["nodes"] if n["slot"] == 1)
    survivors = {n["slot"]: sorted(n["worker_pids"]) for n in state["nodes"] if n["role"] == "active" and n["slot"] != 1}
    # at step KILL, or at the next step once the spare's wait took longer (long steps on a loaded machine)
    wait_all_reached(prog, world, max(kill - 1, latest_step(prog)), 0, proc)
    t_kill = time.time()
    for pid in [node["agent_pid"], *node["worker_pids"]]:
        os.kill(pid, signal.SIGKILL)
    target = latest_step(prog) + 1   # the step in flight when the node died
    if target >= steps:
        raise RuntimeError(f"the kill landed after the last step ({target} of {steps}): give more --steps")
    t_back = wait_all_reached(prog, world, target, t_kill, proc)
    try:   # the survivors' slots, now: the same processes, or respawned ones
        after = {n["slot"]: sorted(n["worker_pids"]) for n in status(run)["nodes"] if n["slot"] in survivors}
    except (subprocess.CalledProcessError, ValueError):
        after = None       # the job ended first: not known
    rc = proc.wait(timeout=600)
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    fault = next(e for e in ev if e["event"] == "fault_detected")
    done = next((e for e in ev if e["event"] == "recovery_done"), None)
    step_s = statistics.median(b - a for lines in progress(prog).values() for (s0, a), (s1, b) in zip(lines, lines[1:])
                               if s1 == s0 + 1 and b < t_kill)
    if done is None:
        return {"exit_code": rc, "lost_s": t_back - t_kill, "detect_s": fault["t"] - t_kill,
                "survivors_kept": after == survivors, "step_s": round(step_s, 3)}
    return {"exit_code": rc, "lost_s": t_back - t_kill, "detect_s": fault["t"] - t_kill,
            "recovery_s": done["duration_s"], "replayed_steps": done["replayed_steps"], "phases": done["phases"],
            "survivors_kept": after == survivors, "step_s": round(step_s, 3),
            "quiesce_over_step": round(done["phases"]["quiesce_s"] / step_s, 4)}


def _standby_of(agent_pid: int) -> psutil.Process | None:
    for c in psutil.Process(agent_pid).children():
        try:
            if c.environ().get("PHOENIXRUN_STANDBY") == "1":
                return c
        except psutil.Error:
            continue
    return None


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"job ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _pids_once_reported(run: Path, before: dict[int, list[int]], victim: int, nproc: int,
                        proc: subprocess.Popen) -> dict[int, list[int]] | None:
    """Each slot's worker pids once slot 1's agent has reported its reset: status shows what the last heartbeat
    carried, and on a loaded machine the job can be back at work before that heartbeat (CI read the victim's pid there
    once and called the survivors replaced). None if the job ended first."""
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        try:
            after = {n["slot"]: sorted(n["worker_pids"]) for n in status(run)["nodes"] if n["slot"] in before}
        except (subprocess.CalledProcessError, ValueError):
            return None
        if victim not in after.get(1, [victim]) and len(after[1]) == nproc:
            return after
        time.sleep(0.05)
    return None


def worker_death_trial(tmp: Path, nodes: int, nproc: int, steps: int, kill: int, model: list[str],
                       standby: bool) -> dict:
    """One job with one worker of slot 1 SIGKILLed at step `kill` or later: with the node's standby worker (once it
    waits in init()), or with --no-standby-worker."""
    name = "standby" if standby else "fresh"
    run, prog, log = tmp / f"{name}-run", tmp / f"{name}-progress", tmp / f"{name}.log"
    prog.mkdir(parents=True)
    world = nodes * nproc
    cmd = [str(BIN / "phoenixrun"), "--standalone", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
           "--run-dir", str(run), *([] if standby else ["--no-standby-worker"]), str(EXAMPLE), "--steps", str(steps),
           "--out", str(tmp / f"{name}-out"), "--progress-dir", str(prog), *model]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PHOENIXRUN_LOG_LEVEL": "INFO"})
    wait_all_reached(prog, world, 0, 0, proc)
    node = next(n for n in status(run)["nodes"] if n["slot"] == 1)
    idle: dict = {}
    sb = None
    if standby:
        sb = _wait(lambda: _standby_of(node["agent_pid"]), proc, "slot 1's standby worker")
        _wait(lambda: f"standby worker (pid {sb.pid}) is ready" in log.read_text(errors="replace"), proc,
              "the standby waiting in init()")
        try:
            cpu0, t0 = sum(sb.cpu_times()[:2]), time.time()
            time.sleep(IDLE_WINDOW_S)      # the measurement window of its idle cost
            idle = {"standby_idle_cpu_s_per_s": round((sum(sb.cpu_times()[:2]) - cpu0) / (time.time() - t0), 5),
                    "standby_rss_mb": round(sb.memory_info().rss / 2**20, 1)}
        except psutil.NoSuchProcess:
            raise RuntimeError(f"the standby (pid {sb.pid}) exited during its idle measurement (job exit "
                               f"{proc.poll()}): give more --steps or a longer step") from None
    before = {n["slot"]: sorted(n["worker_pids"]) for n in status(run)["nodes"] if n["role"] == "active"}
    wait_all_reached(prog, world, max(kill - 1, latest_step(prog)), 0, proc)
    victim = before[1][0]
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    target = latest_step(prog) + 1
    if target >= steps:
        raise RuntimeError(f"the kill landed after the last step ({target} of {steps}): give more --steps")
    t_back = wait_all_reached(prog, world, target, t_kill, proc)
    after = _pids_once_reported(run, before, victim, nproc, proc)
    rc = proc.wait(timeout=600)
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    fault = next(e for e in ev if e["event"] == "fault_detected" and not e.get("during_recovery"))
    done = next(e for e in ev if e["event"] == "recovery_done")
    others_kept = after is not None and after[0] == before[0] and before[1][1:] == [p for p in after[1]
                                                                                  if p in before[1]]
    return {"standby": standby, "exit_code": rc, "action": fault["action"], "lost_s": round(t_back - t_kill, 3),
            "detect_s": round(fault["t"] - t_kill, 3), "recovery_s": done["duration_s"],
            "detect_to_done_s": done.get("detect_to_done_s"), "replayed_steps": done["replayed_steps"],
            "standby_took_rank": bool(sb and after and sb.pid in after[1]), "others_kept": others_kept,
            "pids_before": before, "pids_after": after, **idle}


def worker_death(args) -> int:
    """--worker-death: both arms per trial, medians per arm."""
    rows: dict[bool, list[dict]] = {False: [], True: []}
    failed = []
    model = args.model.split()
    for i in range(args.trials):
        for standby in (False, True):
            with tempfile.TemporaryDirectory(prefix="phoenixrun-worker-death-") as tmp:
                try:
                    rows[standby].append(worker_death_trial(Path(tmp), args.nodes, args.nproc, args.steps, args.kill,
                                                            model, standby))
                except (RuntimeError, subprocess.CalledProcessError, StopIteration) as e:
                    failed.append(f"trial {i} ({'standby' if standby else 'fresh'}): {e}")
                    print(failed[-1], flush=True)
                    continue
            print(f"trial {i}: {json.dumps(rows[standby][-1])}", flush=True)
    summary = {"config": vars(args), "fresh": rows[False], "standby": rows[True], "failed_trials": failed,
               "load_avg": os.getloadavg()}
    print(f"{args.nodes} nodes x {args.nproc} ranks, one worker of slot 1 SIGKILLed, medians "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    for standby, label in ((False, "new process (--no-standby-worker)"), (True, "standby worker")):
        r = rows[standby]
        if not r:
            continue
        med = {k: statistics.median(x[k] for x in r) for k in ("detect_s", "recovery_s", "lost_s")}
        summary[f"{'standby' if standby else 'fresh'}_median"] = med
        print(f"  {label:<34}: detection {med['detect_s']:.3f} s, recovery {med['recovery_s']:.3f} s, lost "
              f"{med['lost_s']:.2f} s over {len(r)} trial(s); recoveries {[x['recovery_s'] for x in r]}")
    sb = rows[True]
    if sb:
        print(f"  the standby took the rank in {sum(x['standby_took_rank'] for x in sb)} of {len(sb)}; idle: "
              f"RSS {[x['standby_rss_mb'] for x in sb]} MB, CPU {[x['standby_idle_cpu_s_per_s'] for x in sb]} s/s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if rows[True] and rows[False] else 1


def torchrun_trial(tmp: Path, world: int, steps: int, kill: int, every: int, model: list[str]) -> dict:
    prog, ckpt = tmp / "tr-progress", tmp / "tr-ckpt"
    prog.mkdir(parents=True)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(world), "--max-restarts", "1",
           str(EXAMPLE), "--steps", str(steps), "--out", str(tmp / "tr-out"), "--progress-dir", str(prog),
           "--ckpt-dir", str(ckpt), "--ckpt-every", str(every), *model]
    # without this, stock torchrun's restarted workers read the previous attempt's gloo addresses from the shared
    # store and never connect ("Gloo connectFullMesh failed"; pytorch#135712, #167288)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    wait_all_reached(prog, world, kill - 1, 0, proc)
    victim = next(c for c in psutil.Process(proc.pid).children(recursive=True)
                  if "train_gpt.py" in " ".join(c.cmdline()) and c.environ().get("RANK") == "1")
    t_kill = time.time()
    victim.kill()
    target = latest_step(prog) + 1
    t_back = wait_all_reached(prog, world, target, t_kill, proc)
    # first replayed step logged after the kill: when the restarted attempt was training again
    resumed = min(t for lines in progress(prog).values() for s, t in lines if t > t_kill and s < target - 1)
    rc = proc.wait(timeout=600)
    last_ckpt = (kill // every) * every
    return {"exit_code": rc, "lost_s": t_back - t_kill, "recovery_s": resumed - t_kill,
            "replayed_steps": kill - last_ckpt}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--no-baseline", action="store_true", help="phoenixrun only (no torchrun trial)")
    p.add_argument("--kill", type=int, default=80)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--model", default="--d-model 128 --layers 2 --heads 4 --vocab 512 --seq 32 --batch 4")
    p.add_argument("--json", default=None)
    p.add_argument("--worker-death", action="store_true",
                   help="SIGKILL one worker (a local reset), with and without the node's standby worker")
    p.add_argument("--long-steps", type=float, default=None, metavar="S",
                   help="tests/scripts/long_steps.py with steps of about S s (0.5 s sleeps between gradient buckets); "
                        "phoenixrun only; use with a small --steps/--kill, e.g. --steps 5 --kill 2")
    args = p.parse_args()
    if args.worker_death:
        return worker_death(args)
    model, script = args.model.split(), EXAMPLE
    if args.long_steps is not None:
        layers = max(1, round(args.long_steps / 0.5))
        model, script, args.no_baseline = ["--layers", str(layers), "--sleep", "0.5"], LONG_STEPS, True
    ph, tr, failed = [], [], []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="phoenixrun-recovery-") as tmp:
            try:
                ph.append(phoenix_trial(Path(tmp), args.nodes, args.nproc, args.steps, args.kill, model, script))
            except (RuntimeError, subprocess.CalledProcessError) as e:   # e.g. the master not up in 60 s under load
                failed.append(f"trial {i}: {e}")
                print(f"trial {i}: phoenixrun failed: {e}", flush=True)
                continue
            print(f"trial {i}: phoenixrun {json.dumps(ph[-1])}", flush=True)
            if not args.no_baseline:
                tr.append(torchrun_trial(Path(tmp), args.nodes * args.nproc, args.steps, args.kill, args.ckpt_every,
                                         model))
                print(f"         torchrun   {json.dumps(tr[-1])}", flush=True)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    if not ph:
        print("no trial finished", flush=True)
        return 1
    summary = {"config": vars(args), "phoenixrun": ph, "torchrun": tr, "failed_trials": failed,
               "world_size": args.nodes * args.nproc,
               "phoenix_lost_s": med(ph, "lost_s"), "phoenix_recovery_s": med(ph, "recovery_s"),
               "phoenix_detect_s": med(ph, "detect_s")}
    print(f"{args.nodes} nodes x {args.nproc} ranks, kill at step {args.kill}, checkpoint every {args.ckpt_every}, "
          f"{len(ph)} of {args.trials} trial(s) finished, medians:")
    print(f"  phoenixrun hot swap : lost {summary['phoenix_lost_s']:.2f} s, detection {summary['phoenix_detect_s']:.3f} s, "
          f"recovery {summary['phoenix_recovery_s']:.3f} s, replayed {med(ph, 'replayed_steps')} step(s)")
    kept = sum(r["survivors_kept"] is True for r in ph)
    summary.update(survivors_kept=kept, phoenix_step_s=med(ph, "step_s"),
                   phoenix_quiesce_s=statistics.median(r["phases"]["quiesce_s"] for r in ph))
    print(f"  survivors kept their processes in {kept} of {len(ph)} trial(s); step {summary['phoenix_step_s']:.2f} s, "
          f"quiesce {summary['phoenix_quiesce_s']:.3f} s")
    if tr:
        summary.update(torchrun_lost_s=med(tr, "lost_s"), torchrun_restart_s=med(tr, "recovery_s"),
                       lost_time_ratio=med(tr, "lost_s") / med(ph, "lost_s"))
        print(f"  torchrun ckpt-restart: lost {summary['torchrun_lost_s']:.2f} s, "
              f"restart {summary['torchrun_restart_s']:.2f} s, replayed {med(tr, 'replayed_steps')} step(s)")
        print(f"  lost-time ratio (torchrun / phoenixrun): {summary['lost_time_ratio']:.1f}x (goal >= 20x)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

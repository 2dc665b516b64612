"""A run's identity: which run a launch is, and so which run directory (events, roster, checkpoints) it uses.

A fresh launch never picks up another run's state: without a name for the run it gets a new id, and so a new
run directory. Resuming is a deliberate act, one of (issue 29):

- the same `--rdzv-id` (torchrun's run id: nodes of one job share it; the same id again is the same run);
- the same `--run-dir` (naming the directory names the run: its id is the directory's name);
- the same Slurm job: under Slurm (`$SLURM_JOB_ID`) the id is `slurm-JOBID`, the same on every node and after a
  requeue (Slurm keeps the job id when it requeues a job);
- `--resume`: the newest run under `.phoenixrun/` of this directory (or the one the flags above name).

`identity` decides, from what it is given (no file system, no environment read): the launcher gathers the facts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUNS = Path(".phoenixrun")      # where runs without --run-dir live, relative to the working directory


class RunIdError(ValueError):
    """The flags name no run that can be resumed (the message says what to give instead)."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    run_dir: Path
    how: str           # how the id was chosen: "rdzv-id", "run-dir", "slurm", "resume", "new"


def _safe(name: str) -> str:
    """A run id usable as a directory name and a store key."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"


def identity(rdzv_id: str, run_dir: Path | None, resume: bool, standalone: bool, slurm_job_id: str | None,
             runs: list[tuple[str, float]], new_token: str) -> RunIdentity:
    """The run this launch is. Pure.

    runs: (name, last activity) of each run directory under .phoenixrun/ (for --resume without a name);
    new_token: a fresh random token, used only for a new run."""
    if rdzv_id:
        return RunIdentity(rdzv_id, run_dir or RUNS / _safe(rdzv_id), "rdzv-id")
    if run_dir is not None:
        return RunIdentity(_safe(Path(run_dir).resolve().name), run_dir, "run-dir")
    if slurm_job_id:
        rid = f"slurm-{_safe(slurm_job_id)}"
        return RunIdentity(rid, RUNS / rid, "slurm")
    if resume:
        if not runs:
            raise RunIdError(f"--resume: no run to resume under {RUNS}/ (give the run's --rdzv-id or --run-dir)")
        name = max(runs, key=lambda r: (r[1], r[0]))[0]
        return RunIdentity(name, RUNS / name, "resume")
    rid = ("standalone-" if standalone else "run-") + new_token
    return RunIdentity(rid, RUNS / rid, "new")


def resume_note(run_id: str, run_dir: Path, resume: bool, has_state: bool) -> str | None:
    """What the launcher says before the run starts (None: nothing), or RunIdError for a --resume with nothing to
    resume. Pure. has_state: the run directory already holds a run's events or checkpoints."""
    if resume and not has_state:
        raise RunIdError(f"--resume: {run_dir} holds no earlier run (no events, no checkpoints) to resume")
    if has_state:
        return (f"run {run_id} continues in {run_dir}: its events are appended to, and its newest complete "
                "checkpoint (if any) is restored")
    return None


def runs_under(root: Path) -> list[tuple[str, float]]:
    """(name, last activity) of each run directory under `root` (its events' mtime, else its own)."""
    out = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    for d in entries:
        if not d.is_dir():
            continue
        try:
            ev = d / "events.jsonl"
            out.append((d.name, (ev if ev.exists() else d).stat().st_mtime))
        except OSError:
            continue
    return out


def has_state(run_dir: Path, persist_dir: Path | None) -> bool:
    """Does the run directory (or the checkpoint directory) already hold a run's events or checkpoints?"""
    run_dir = Path(run_dir)
    if (run_dir / "events.jsonl").is_file() and (run_dir / "events.jsonl").stat().st_size > 0:
        return True
    ckpt = Path(persist_dir) if persist_dir is not None else run_dir / "checkpoints"
    try:
        return any(p.name.startswith("step_") for p in ckpt.iterdir())
    except OSError:
        return False

"""Recovery time vs scale, composed from measurements only - no fit, nothing beyond the largest size measured.

A hot swap's time at N GPUs is, on its critical path:

    detection(N)      the fault -> the master's `fault_detected`
  + control(N)        `fault_detected` -> every agent resumed, with agents that answer at once: the master's
                      broadcasts, plan and the acks' way back (benchmarks/master_scale.py, the real master and a
                      swarm of simulated agents speaking the real protocol, at each N it was run at)
  + ranks             what real ranks add to that: the survivors' quiesce and the replacement's fetch, group rebuild
                      and state load (`recovery_done` phases of benchmarks/recovery.py or benchmarks/detection.py
                      at a few ranks on this machine: the quiesce phase plus the restore phase, medians over their
                      trials)

Each term comes from its own benchmark run, and each composed point names its sources. The per-rank term is the
same at every N by construction: a replacement fetches only its own ranks' state from its peers and every rank
loads its own, so neither grows with the job; the one phase that does on a cluster - building the new
generation's communicators (NCCL's init grows with the world) - is measured here with gloo at a few ranks and
is a lower bound at N ranks: the report says so beside every row. The small job's own control plane (a few
milliseconds at 4-8 ranks) is counted twice, once in each term: the sum errs long, not short.

Sizes between two measured ones are not invented either: the curve has a point exactly where the control plane
was measured. Everything here is a pure function of parsed results; `load_*` read the benchmarks' JSON files and
refuse what is not one with a `CurveError` naming the file and what was expected.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

# results written before protocol/timings.py named the one load of model and optimizer state twice
OLD_NAMES = {"state_s": "optimizer_s"}
# the fault of a result written before master_scale.py named it: a silent node, before the ring watch found one
TIMEOUT = "silent, timeout"
REBUILD_CAVEAT = ("the rebuild is gloo's at a few ranks: on a cluster NCCL's communicator init grows with the "
                  "world, so this is a lower bound")


class CurveError(ValueError):
    """A results file that is not one the curve can use, or no usable measurement."""


@dataclass(frozen=True)
class ControlPoint:
    """The control plane at one measured size (benchmarks/master_scale.py)."""
    nodes: int
    gpus: int
    detect_s: float        # the fault -> detected
    control_s: float       # detected -> every agent resumed
    fault: str             # how: kill (its connections close), silent (a hung host) or TIMEOUT (an older result)
    source: str


@dataclass(frozen=True)
class RankPhases:
    """What real ranks add to the control plane, measured at `gpus` ranks: medians over `trials`."""
    gpus: int
    trials: int
    quiesce_s: float       # the survivors' stop (the master's quiesce phase)
    restore_s: float       # the restore phase: the replacement's fetch, every rank's rebuild and state load
    fetch_s: float | None  # of restore_s: the replacement agent's fetch of its ranks' state
    rebuild_s: float | None  # of restore_s: the new generation's process groups
    state_s: float | None  # of restore_s: model and optimizer state loaded from the node's slots
    source: str

    @property
    def total_s(self) -> float:
        return self.quiesce_s + self.restore_s


@dataclass(frozen=True)
class CurvePoint:
    """The composed recovery time at one measured size."""
    nodes: int
    gpus: int
    detect_s: float
    control_s: float
    ranks_s: float
    fault: str
    sources: tuple[str, ...]

    @property
    def total_s(self) -> float:
        """The fault -> every rank training again."""
        return self.detect_s + self.control_s + self.ranks_s


def compose(control: Sequence[ControlPoint], ranks: RankPhases) -> list[CurvePoint]:
    """One point per measured control-plane size (smallest first; at a size measured more than once, the median
    run's figures). Pure."""
    if not control:
        raise CurveError("no control-plane measurement: pass benchmarks/master_scale.py --json results")
    by_size: dict[tuple[int, str], list[ControlPoint]] = {}
    for c in control:
        by_size.setdefault((c.gpus, c.fault), []).append(c)
    points = []
    for (gpus, fault), runs in sorted(by_size.items()):
        runs = sorted(runs, key=lambda c: c.detect_s + c.control_s)
        mid = runs[(len(runs) - 1) // 2]      # the median run (the lower one of an even count): not a blend
        points.append(CurvePoint(mid.nodes, gpus, mid.detect_s, mid.control_s, ranks.total_s, fault,
                                 (mid.source, ranks.source)))
    return points


def efficiency(mttf_s: float, recovery_s: float, t_step_s: float, phi: float) -> float:
    """eta = MTTF / (MTTF + T_hotswap + phi t_step): the paper's first-order model for hot swap. Pure."""
    return mttf_s / (mttf_s + recovery_s + phi * t_step_s)


# ------------------------------------------------------------------------------------------------ the edges


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CurveError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CurveError(f"{path}: not a benchmark result (a JSON object expected)")
    return data


def _number(d: Mapping[str, Any], key: str, path: Path) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise CurveError(f"{path}: `{key}` is missing or not a non-negative number")
    return float(v)


def load_control(path: Path) -> ControlPoint:
    """A `benchmarks/master_scale.py --json` result. Detection: `detect_after_fault_s` (from the fault itself),
    or in results written before it existed `detect_s` (from the node's last heartbeat): those runs stopped the
    node without closing its connections and nothing but the heartbeat timeout found it (`TIMEOUT`)."""
    d = _read(path)
    cfg, rec = d.get("config"), d.get("recovery")
    if not isinstance(cfg, dict) or not isinstance(rec, dict):
        raise CurveError(f"{path}: not a master_scale.py result (expected its `config` and `recovery` objects; "
                         "a run that did not complete has no `recovery`)")
    nodes, nproc = int(_number(cfg, "nodes", path)), int(_number(cfg, "nproc_per_node", path))
    detect = _number(rec, "detect_after_fault_s" if "detect_after_fault_s" in rec else "detect_s", path)
    return ControlPoint(nodes, nodes * nproc, detect, _number(rec, "fault_to_all_resumed_s", path),
                        str(rec.get("fault") or cfg.get("fault") or TIMEOUT), f"{Path(path).name}")


def _trials(d: Mapping[str, Any], path: Path) -> tuple[int, list[Mapping[str, Any]]]:
    """(ranks, the node-loss trials' phase objects) of a recovery.py or detection.py result."""
    cfg = d["config"] if isinstance(d.get("config"), dict) else {}
    if isinstance(d.get("phoenixrun"), list):                          # benchmarks/recovery.py
        trials = [t for t in d["phoenixrun"] if isinstance(t, dict) and t.get("exit_code", 0) == 0]
        gpus = int(cfg.get("nodes", 0)) * int(cfg.get("nproc", 2))
    elif isinstance(d.get("classes"), dict) and isinstance(d["classes"].get("node-loss"), dict):   # detection.py
        trials = [t for t in d["classes"]["node-loss"].get("rows", []) if isinstance(t, dict)]
        gpus = int(cfg.get("nodes", 2)) * int(cfg.get("nproc", 2))
    else:
        raise CurveError(f"{path}: not a recovery.py or detection.py result with node-loss trials")
    phases = [t["phases"] for t in trials if isinstance(t.get("phases"), dict)]
    if not phases or gpus <= 0:
        raise CurveError(f"{path}: no completed node-loss trial with its recovery phases")
    return gpus, phases


def load_ranks(path: Path) -> RankPhases:
    """The per-rank phases of a `benchmarks/recovery.py --json` or `benchmarks/detection.py --json` result
    (its node-loss trials): medians over the trials."""
    d = _read(path)
    gpus, phases = _trials(d, path)

    def med(name: str, required: bool) -> float | None:
        xs = [float(v) for p in phases
              if isinstance(v := p.get(name, p.get(OLD_NAMES.get(name, ""))), (int, float)) and v >= 0]
        if not xs and required:
            raise CurveError(f"{path}: no trial has the `{name}` phase")
        return statistics.median(xs) if xs else None

    quiesce, restore = med("quiesce_s", True), med("restore_s", True)
    assert quiesce is not None and restore is not None
    return RankPhases(gpus, len(phases), quiesce, restore, med("fetch_s", False), med("rebuild_s", False),
                      med("state_s", False), f"{Path(path).name}")

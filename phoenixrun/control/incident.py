"""One plain line per incident for the launcher's console: what failed, where, what was done, how long it took,
the steps replayed and the spares left. events.jsonl holds everything; this line is what an operator reads.

Pure: built from the incident's `fault_detected` record and the record of what ended it (`recovery_done`,
`job_shrunk`, `fallback_done`, `restart` or a failed `job_finished`), as control/events.py writes them. The
master logs it where it writes the latter (control/recovery.py, control/coordinator.py). Table-tested in
tests/test_incident_line.py.
"""
from __future__ import annotations

import re
import signal as _signal
from typing import Any, Mapping

from phoenixrun.faults.classify import exit_signal_number

# the agent's own text for a failed worker (agents/supervisor.py exit_detail): says nothing the line does not
_EXIT_DETAIL = re.compile(r"^rank \S+ exited with (code|signal) -?\d+$")
DETAIL_CHARS = 120


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _plural(n: int | None, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def short_detail(text: str | None) -> str:
    """The line of a report's text that says most: the last non-empty one (an exception's message ends a
    traceback), cut to DETAIL_CHARS."""
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= DETAIL_CHARS else last[:DETAIL_CHARS - 3] + "..."


def what_failed(fault: Mapping[str, Any]) -> str:
    """The fault in a few words, from its fault_detected record ("node lost", "rank 3 killed by SIGKILL")."""
    sig, rank = fault.get("signal"), fault.get("rank")
    if sig == "node_lost":
        return "node lost"
    if sig == "left":
        return "node left"
    if sig == "worker_exit":
        rc = fault.get("returncode")
        num = exit_signal_number(rc) if isinstance(rc, int) else None
        return f"rank {rank} killed by {_signal_name(num)}" if num is not None else f"rank {rank} exited with code {rc}"
    words = {"worker_hang": f"rank {rank} hung", "worker_error": f"rank {rank} raised an exception",
             "nan_loss": f"rank {rank}: non-finite loss", "comm_error": f"rank {rank}: collective error",
             "health": "hardware health signal", "drain": "planned drain"}
    return words.get(str(sig), str(sig or "fault"))


def where(fault: Mapping[str, Any], host: str | None) -> str:
    slot = fault.get("slot")
    node = ", ".join(x for x in (f"node {fault['node']}" if fault.get("node") else "",
                                 f"host {host}" if host else "") if x)
    place = f"slot {slot}" if slot is not None else "no slot"
    return f"{place} ({node})" if node else place


def diagnosis(fault: Mapping[str, Any]) -> str:
    """The class and what the report said, e.g. "node_lost: agent unreachable"."""
    detail = short_detail(fault.get("detail"))
    if _EXIT_DETAIL.match(detail):
        detail = ""
    cls = fault.get("class")
    if cls and detail:
        return f"{cls}: {detail}"
    return cls or detail


def outcome_text(fault: Mapping[str, Any] | None, outcome: Mapping[str, Any]) -> str:
    """What was done, how long it took and the steps replayed, from the record that ended the incident."""
    ev = outcome.get("event")

    def replayed() -> str:
        if outcome.get("restored_step") is None:
            return ""
        n = outcome.get("replayed_steps")
        return f"; restored step {outcome['restored_step']}" + (f", {_plural(n, 'step')} replayed" if n is not None else "")

    took = f" in {_seconds(outcome['duration_s'])}" if outcome.get("duration_s") is not None else ""
    if ev == "recovery_done":
        spares = sorted((outcome.get("replaced_slots") or {}).items(), key=lambda kv: int(kv[0]))
        if len(spares) == 1:
            done = f"hot swap onto spare {spares[0][1]}"
        elif spares:
            done = "hot swap onto spares " + ", ".join(f"{n} (slot {s})" for s, n in spares)
        else:
            done = "local reset"
        attempts = outcome.get("attempts") or 1
        return done + took + (f" ({attempts} attempts)" if attempts > 1 else "") + replayed()
    if ev == "job_shrunk":
        return (f"no spare: shrunk to {_plural(outcome.get('nnodes'), 'node')} (world size "
                f"{outcome.get('world_size')})" + took + replayed())
    if ev == "fallback_done":
        return f"restart from the persistent checkpoint of step {outcome.get('restore_step')}" + took
    if ev == "restart":
        after = ""
        if fault is not None and fault.get("t") is not None and outcome.get("t") is not None:
            after = f", ordered {_seconds(max(0.0, outcome['t'] - fault['t']))} after detection"
        return (f"torchrun-style restart {outcome.get('restart_count')}{after}: every worker starts again "
                "from the beginning (every step replayed)")
    if ev == "job_finished":
        return f"stopped (exit {outcome.get('exit_code')}): {outcome.get('reason')}"
    return str(ev)


def incident_line(fault: Mapping[str, Any] | None, outcome: Mapping[str, Any], *, host: str | None = None,
                  spares_left: int | None = None) -> str:
    """incident: <what failed> on <slot (node, host)> [<class: detail>] -> <what was done>; <spares left>."""
    if fault is None:
        head = "incident: " + (outcome.get("reason") or "a fault")
    else:
        diag = diagnosis(fault)
        head = f"incident: {what_failed(fault)} on {where(fault, host)}" + (f" [{diag}]" if diag else "")
    tail = f"; {_plural(spares_left, 'spare')} left" if spares_left is not None else ""
    return f"{head} -> {outcome_text(fault, outcome)}{tail}"

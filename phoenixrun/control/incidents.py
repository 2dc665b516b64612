"""The incident being handled, and the one console line that closes it (the line itself: control/incident.py).

Opened by the coordinator with the fault it acts on (or by a hot swap an interrupted drain started), closed by the
first outcome that ends it: a hot swap, a shrink, a fallback, a restart, the job's end. Runs on the controller
thread only.
"""
from __future__ import annotations

import logging
from typing import Any

from phoenixrun.control.incident import incident_line
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.state import Role

log = logging.getLogger("phoenixrun.master")


class Incidents:
    def __init__(self, job: JobState):
        self.job = job
        self.current: dict[str, Any] | None = None   # the fault_detected record of the incident being handled

    def open(self, fault: dict[str, Any]) -> None:
        """The incident being handled is this fault (its fault_detected record); the next outcome closes it."""
        self.current = fault

    def close(self, outcome: dict[str, Any], level: int = logging.WARNING) -> bool:
        """Say on the console, in one line, how the open incident ended; False if none was open."""
        fault, self.current = self.current, None
        if fault is None:
            return False
        with self.job.cv:
            node = self.job.members.nodes.get(fault.get("node") or "")
            spares = sum(1 for n in self.job.members.nodes.values() if n.role == Role.SPARE)
        log.log(level, "%s", incident_line(fault, outcome, host=node.host if node else None, spares_left=spares))
        return True

"""Failure detection by silence: a node not heard from for --node-timeout is reported lost (to the inbox,
once per timeout period); a master that did not run for a while, or whose transport fell behind reading what
reached it (`horizon`: control/server.py's read_horizon), does not blame the nodes for it."""
from __future__ import annotations

import logging
import time
from typing import Callable

from phoenixrun.control.detection import judged_at
from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox
from phoenixrun.control.state import Role
from phoenixrun.protocol.names import Event, ReportKind

log = logging.getLogger("phoenixrun.master")


class HeartbeatMonitor:
    def __init__(self, job: JobState, events: EventLog, inbox: Inbox,
                 horizon: Callable[[], float | None] = lambda: None):
        self.job, self.events, self.inbox = job, events, inbox
        self.horizon = horizon     # the transport's: every request that reached the master before it was read

    def run(self) -> None:
        job = self.job
        tick = min(0.25, job.cfg.node_timeout / 4)
        woke = time.monotonic()
        while not job.stopped.is_set():
            time.sleep(tick)
            now = time.time()
            seen = judged_at(now, self.horizon())
            t = time.monotonic()
            slept, woke = t - woke, t
            with job.cv:
                if slept > 4 * tick:
                    self._forgive_stall(slept - tick)
                stale = []
                for nid in job.heard:   # least recently heard first: stop at the first fresh one
                    if seen - job.nodes[nid].last_heartbeat <= job.cfg.node_timeout:
                        break
                    stale.append(nid)
                for nid in stale:
                    n = job.nodes[nid]
                    if n.role not in (Role.FAILED, Role.DRAINED):   # gone on purpose: nothing to report
                        self.inbox.put({"kind": ReportKind.NODE_LOST, "node_id": n.node_id, "t": now,
                                        "detail": f"no heartbeat for {seen - n.last_heartbeat:.1f}s"})
                    n.last_heartbeat = now  # report once per timeout period
                    job.heard.move_to_end(nid)

    def _forgive_stall(self, seconds: float) -> None:
        """The master itself did not run for `seconds` (stopped, swapped out, starved): the heartbeats it
        did not read meanwhile are its own silence, not the nodes'. Without this, a master paused for longer
        than --node-timeout declared every node lost at once when it ran again (seen when a profiler
        paused it at 16K nodes: the job failed, "recovery kept failing")."""
        log.warning("the master did not run for %.1fs: heartbeat clocks moved on by as much", seconds)
        self.events.emit(Event.MASTER_STALLED, self.job.generation, seconds=round(seconds, 3))
        now = time.time()
        for n in self.job.nodes.values():   # capped: one heard since it ran again is no fresher than now
            n.last_heartbeat = min(n.last_heartbeat + seconds, now)

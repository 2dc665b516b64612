"""Failure detection (decisions: control/detection.py). By silence: a node not heard from for --node-timeout is
reported lost (to the inbox, once per timeout period); a master that did not run for a while, or whose transport
fell behind reading what reached it (the transport's read_horizon), does not blame the nodes for it. By a closed
link: an agent's directive-poll connection closed by its side and, confirmed, its peer port refusing - a killed
agent is reported within a monitor tick or two instead of a heartbeat timeout."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from phoenixrun.control.detection import PROBE_TIMEOUT_S, Link, Probe, closed_link, judged_at
from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox
from phoenixrun.control.probe import unreachable
from phoenixrun.control.state import Phase, Role
from phoenixrun.protocol.events import MasterStalled
from phoenixrun.protocol.reports import NodeLost

if TYPE_CHECKING:
    from phoenixrun.control.watch_desk import WatchDesk

log = logging.getLogger("phoenixrun.master")

GONE = (Role.FAILED, Role.DRAINED)     # gone on purpose or already replaced: nothing to report


class Transport(Protocol):
    """What the monitor asks of the master's transport (control/server.py's ControlServer)."""

    def read_horizon(self) -> float | None: ...

    def closed_links(self) -> list[tuple[str, float]]: ...

    def last_poll(self, node_id: str) -> float: ...


class HeartbeatMonitor:
    def __init__(self, job: JobState, events: EventLog, inbox: Inbox,
                 probe: Callable[..., set[str]] = unreachable):
        self.job, self.events, self.inbox, self.probe = job, events, inbox, probe
        self.transport: Transport | None = None    # set once the transport runs
        self._links: list[tuple[str, float]] = []  # closed links still to be confirmed
        self.watch: WatchDesk | None = None         # the ring watchers' suspicions (control/watch_desk.py)

    def run(self) -> None:
        job = self.job
        tick = min(0.25, job.cfg.recovery.node_timeout / 4)
        woke = time.monotonic()
        while not job.stopped.is_set():
            time.sleep(tick)
            now = time.time()
            seen = judged_at(now, self.transport.read_horizon() if self.transport else None)
            t = time.monotonic()
            slept, woke = t - woke, t
            self._check_links()
            if self.watch is not None:
                self.watch.judge_all(now)
            with job.cv:
                if slept > 4 * tick:
                    self._forgive_stall(slept - tick)
                stale = []
                for nid in job.members.heard:   # least recently heard first: stop at the first fresh one
                    if seen - job.members.nodes[nid].last_heartbeat <= job.cfg.recovery.node_timeout:
                        break
                    stale.append(nid)
                for nid in stale:
                    n = job.members.nodes[nid]
                    if n.role not in GONE:
                        job.members.lost.add(n.node_id)
                        self.inbox.put(NodeLost(node_id=n.node_id, t=now,
                                                detail=f"no heartbeat for {seen - n.last_heartbeat:.1f}s"))
                    n.last_heartbeat = now  # report once per timeout period
                    job.members.heard.move_to_end(nid)

    def declare_lost(self, node_id: str, detail: str) -> None:
        """A node found lost by other evidence than its silence (its ring watchers: control/watch_desk.py). Call
        with the lock held. The silence path does not report it again this timeout period."""
        n = self.job.members.nodes.get(node_id)
        if n is None or n.role in GONE:
            return
        now = time.time()
        self.job.members.lost.add(node_id)
        self.inbox.put(NodeLost(node_id=node_id, t=now, detail=detail))
        n.last_heartbeat = now
        self.job.members.heard.move_to_end(node_id)

    def _check_links(self) -> None:
        """Confirm the agents' closed links (control/detection.py's closed_link): probe the peer ports of those not
        heard from since, outside the lock, and report the ones that refuse."""
        transport = self.transport
        if transport is None:
            return
        self._links += transport.closed_links()
        if not self._links:
            return
        wait, ask = self._judge(transport, self._links, {})
        self._links = wait
        if not ask:
            return
        refused = self.probe({addr for _, _, addr in ask}, PROBE_TIMEOUT_S, silent_is_dead=False)
        # not refused: answered, or silent within the timeout - either way no loss now (silence is the timeout's)
        self._judge(transport, [(nid, closed_at) for nid, closed_at, _ in ask],
                    {nid: Probe.REFUSED if addr in refused else Probe.ANSWERED for nid, _, addr in ask})

    def _judge(self, transport: Transport, links: Iterable[tuple[str, float]], probed: dict[str, Probe]
               ) -> tuple[list[tuple[str, float]], list[tuple[str, float, str]]]:
        """Decide each closed link; report the lost. Returns (to look at again, to probe: with the address)."""
        wait, ask = [], []
        job, now = self.job, time.time()
        with job.cv:
            if job.course.phase in (Phase.FINISHED, Phase.FAILED):
                return [], []
            for nid, closed_at in links:
                n = job.members.nodes.get(nid)
                if n is None or n.role in GONE:
                    continue
                heard = max(n.last_heartbeat, transport.last_poll(nid))
                verdict = closed_link(closed_at, now, heard, probed.get(nid))
                if verdict == Link.WAIT:
                    wait.append((nid, closed_at))
                elif verdict == Link.PROBE:
                    ask.append((nid, closed_at, n.peer_addr))
                elif verdict == Link.LOST:
                    job.members.lost.add(nid)
                    self.inbox.put(NodeLost(node_id=nid, t=now,
                                            detail=f"its connection to the master closed {now - closed_at:.2f}s ago "
                                                   f"and its agent's port {n.peer_addr} refuses connections"))
                    n.last_heartbeat = now      # the silence path does not report it again this timeout period
                    job.members.heard.move_to_end(nid)
        return wait, ask

    def _forgive_stall(self, seconds: float) -> None:
        """The master itself did not run for `seconds` (stopped, swapped out, starved): the heartbeats it
        did not read meanwhile are its own silence, not the nodes'. Without this, a master paused for longer
        than --node-timeout declared every node lost at once when it ran again (seen when a profiler
        paused it at 16K nodes: the job failed, "recovery kept failing")."""
        log.warning("the master did not run for %.1fs: heartbeat clocks moved on by as much", seconds)
        self.events.emit(MasterStalled(seconds=round(seconds, 3)), self.job.course.generation)
        now = time.time()
        for n in self.job.members.nodes.values():   # capped: one heard since it ran again is no fresher than now
            n.last_heartbeat = min(n.last_heartbeat + seconds, now)

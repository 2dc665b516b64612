"""The master's recovery procedures, as the coordinator (control/coordinator.py) calls them: hot swap, planned
drain, shrink and grow, the persistent-checkpoint fallback and the torchrun-style restart.

Each recovery kind is a plan for one executor of the recovery cycle (control/cycle.py: quiesce -> plan ->
restore -> resume, with its acks, deadlines and cascades): control/hotswap.py, control/draining.py,
control/resize.py, control/fallback.py; the torchrun-style restart (control/restart.py) has no cycle. When a
kind's cycle fails for good, decide.after_failure says what comes next and `Recoveries` hands the job over to it
(a hot swap to a shrink, the fallback or a restart; a drain to a hot swap). They run on the master's controller
thread, one at a time; their collaborators come through the constructor; the state is read and changed under
its lock (control/jobstate.py).
"""
from __future__ import annotations

import time
from typing import Any

from phoenixrun.control.cycle import Cycle, NoSpare
from phoenixrun.control.decide import Next, fallback_attempts
from phoenixrun.control.draining import Drain
from phoenixrun.control.events import EventLog
from phoenixrun.control.fallback import Fallback, NoCheckpoint, newest_checkpoint
from phoenixrun.control.hotswap import HotSwap
from phoenixrun.control.incidents import Incidents
from phoenixrun.control.inflight import Acks, Cascade, InFlight, Probe, Stop, unreachable_nodes
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox, Orders
from phoenixrun.control.probe import unreachable
from phoenixrun.control.resize import Grow, Shrink
from phoenixrun.control.restart import Restart
from phoenixrun.control.state import NodeRecord, Phase, PlanError, pick_spare
from phoenixrun.faults import Action
from phoenixrun.protocol import reports as r
from phoenixrun.protocol.events import RecoveryFailed, RecoveryStarted

# what the master's other parts name from here
__all__ = ["Acks", "Cascade", "NoSpare", "Probe", "Recoveries", "Stop", "unreachable_nodes"]


class Recoveries:
    """Everything here runs on the controller thread (see the module docstring)."""

    def __init__(self, job: JobState, orders: Orders, events: EventLog, inbox: Inbox, probe: Probe = unreachable):
        self.cfg, self.job, self.orders, self.events, self.inbox = job.cfg, job, orders, events, inbox
        self.incidents = Incidents(job)     # the incident being handled: one console line closes it
        self.flight = InFlight(job, events, inbox, probe)
        self.cycle = Cycle(job, orders, events, self.flight, self.incidents)
        self.restarts = Restart(self.cycle)

    # ---------------------------------------------------------------- the inbox, as a recovery reads it
    def absorb(self, ev: r.Report) -> None:
        self.flight.absorb(ev)

    def drain_stale(self) -> None:
        self.flight.drain_stale()

    def pump(self, timeout: float, lost: set[int], acks: Acks[Any] | None = None) -> None:
        self.flight.pump(timeout, lost, acks)

    # ---------------------------------------------------------------- torchrun-style restart
    def restart(self, lost: set[int], failing_code: int | None, why: str) -> None:
        self.restarts(lost, failing_code, why)

    def check_attempt(self, ev: r.AttemptCheck) -> None:
        self.restarts.check(ev)

    # ---------------------------------------------------------------- persistent fallback
    def newest_checkpoint(self) -> int | None:
        return newest_checkpoint(self.job)

    def fallback(self, lost: set[int], reason: str, counted: bool = True) -> bool:
        """Restart every worker from the newest complete persistent checkpoint (control/fallback.py). False:
        nothing to fall back to (no checkpoint, or --max-fallbacks used up)."""
        tries = fallback_attempts(self.job.course.fallbacks, self.cfg.persistence.max_fallbacks, counted)
        if tries == 0:
            return False
        try:
            out = self.cycle.drive(Fallback(self.cycle, lost, reason, counted, tries))
        except NoCheckpoint:
            return False
        if out is not None:
            raise Stop(1, f"restart from the persistent checkpoint kept failing ({reason}); "
                          f"{tries} tries, --max-fallbacks {self.cfg.persistence.max_fallbacks} used up")
        return True

    # ---------------------------------------------------------------- hot swap
    def hot_swap(self, lost: set[int], node: NodeRecord, ev: r.Report, action: Action,
                 failing_code: int | None, fresh: dict[int, str] | None = None) -> None:
        """control/hotswap.py. fresh: slots a spare was promoted into before (an interrupted drain's), which hold
        no state yet."""
        t0 = time.time()
        cause = ev.described() or ev.kind.value
        if self.incidents.current is None:   # not opened by the coordinator (an interrupted drain): this is it
            self.incidents.open({"t": ev.at(t0), "node": node.node_id, "slot": node.slot,
                                "signal": ev.kind.value, "detail": cause})
        with self.job.cv:
            self.events.emit(RecoveryStarted(failed_node=node.node_id, slot=node.slot, cause=cause,
                                             action=action.value), self.job.course.generation + 1)
        out = self.cycle.drive(HotSwap(self.cycle, lost, t0, ev.at(t0), fresh))
        if out is None:
            return
        e = out.error
        if out.next is Next.SHRINK:
            assert isinstance(e, NoSpare)
            self.shrink(e.slots, node, t0, e.reached)
            return
        # Next.FALL_BACK: no in-memory state to resume from: the persistent checkpoint, else torchrun's restart
        if isinstance(e, PlanError):
            self.inbox.take(lambda q: isinstance(q, r.RestoreFailed))   # other ranks' of the same plan
            self.events.emit(RecoveryFailed(reason=str(e)), self.job.course.generation)
            why, lost = f"in-memory recovery impossible: {e}", set()
        else:
            why = f"recovery kept failing ({out.attempts} tries): {e}"
            self.events.emit(RecoveryFailed(reason=why), self.job.course.generation)
        if not self.fallback(lost, why):
            self.restart(lost, failing_code, why)

    # ---------------------------------------------------------------- shrink and grow
    def shrink(self, lost: set[int], node: NodeRecord, t0: float, reached: int) -> None:
        """Go on without the nodes of `lost` (no spare within --spare-wait, --on-no-spare shrink)."""
        shrink = Shrink(self.cycle, lost, node, t0, reached)
        if (out := self.cycle.drive(shrink)) is not None:
            raise Stop(1, shrink.stop_reason(out.error)) from None

    def grow(self) -> None:
        """A shrunk job with a spare registered: take it back in (control/resize.py)."""
        job = self.job
        with job.cv:
            spare = pick_spare(job.members.nodes, avoid_domains=[]) if job.shrunk and job.course.phase == Phase.RUNNING else None
        if spare is None:
            return
        grow = Grow(self.cycle, spare)
        if (out := self.cycle.drive(grow)) is not None:
            raise Stop(1, grow.stop_reason(out.error)) from None

    # ---------------------------------------------------------------- planned drain
    def drain(self, node: NodeRecord, slot: int, reason: str, t_requested: float) -> None:
        """Move a healthy node's ranks to a spare with nothing replayed (control/draining.py); interrupted, the
        drained slot is hot-swapped instead."""
        drain = Drain(self.cycle, node, slot, reason, t_requested)
        if (out := self.cycle.drive(drain)) is not None:     # Next.HOT_SWAP
            lost, ev = drain.interrupted(out.error)
            self.hot_swap(lost, node, ev, Action.NODE_REPLACE, None, fresh=drain.fresh)

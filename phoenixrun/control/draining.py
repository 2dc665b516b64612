"""A planned drain as a plan for the recovery cycle (control/cycle.py): move a healthy node's ranks to a spare with
nothing replayed (docs/operations.md, "Planned drains").

Every node is told to quiesce at one step boundary (`at_step`, decide.drain_step: past any step a rank can have
started by the time the order arrives); each rank runs on to it, waits for that step's snapshot to commit and
stops there, no socket shut down (no rank is inside a step with it). The plan (decide.plan_drain) restores every
rank at that step: the survivors from their own agents, the drained node's ranks on the spare, fetched from the
drained node's agent itself. Only then is the drained node told to stop. A fault meanwhile turns the drain into
an ordinary hot swap of the drained slot (decide.after_failure; the drained node is stopped first), which replays
at most one step."""
from __future__ import annotations

import logging
import time

from phoenixrun.control.cycle import Cycle, FromMemory, Quiesce, Quiesced, Restored, Resume
from phoenixrun.control.decide import AfterFailure, Recovery, drain_step, plan_drain
from phoenixrun.control.inflight import Cascade
from phoenixrun.control.state import NodeRecord, PlanError, Role, pick_spare
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol import reports as r
from phoenixrun.protocol.events import RecoveryDone, RecoveryStarted, SparePromoted

log = logging.getLogger("phoenixrun.master")

DRAIN_DELIVERY_S = 0.5   # a drain's quiesce order reaches every worker within this (plus the heartbeats' staleness)


class Drain:
    """One drain of `node` (its slot's ranks to a spare)."""
    kind = Recovery.DRAIN
    tries = 1

    def __init__(self, cycle: Cycle, node: NodeRecord, slot: int, reason: str, requested: float):
        self.cycle, self.job = cycle, cycle.job
        self.node, self.slot, self.reason, self.requested = node, slot, reason, requested
        self.started = time.time()
        self.lost: set[int] = set()
        self.fresh: dict[int, str] = {}     # the slot a spare was promoted into (holds no state of its own yet)
        self.reached = 0

    def quiesce(self) -> Quiesce:
        """Everyone, at the step boundary decide.drain_step picks."""
        job, node = self.job, self.node
        node.draining = self.reason
        newest = max(job.members.newest_snapshots().values(), default=0)
        heard = min((n.last_heartbeat for n in job.members.actives()), default=self.started)
        at_step = drain_step(newest, job.telemetry.steps_per_s(), max(0.0, self.started - heard) + DRAIN_DELIVERY_S)
        self.cycle.events.emit(RecoveryStarted(failed_node=node.node_id, slot=self.slot, cause="drain", action="drain",
                                               reason=self.reason, at_step=at_step), job.course.generation + 1)
        return Quiesce(tuple(job.members.slots.values()), at_step)

    def plan(self, quiesced: Quiesced | None, attempt: int) -> FromMemory:
        """decide.plan_drain; the spare takes the slot (none left: everyone resumes in place, the node stays)."""
        assert quiesced is not None, "a drain always quiesces (its quiesce() gives a Quiesce)"
        self.reached = quiesced.reached
        job, node = self.job, self.node
        with job.cv:
            spare = pick_spare(job.members.nodes, avoid_domains=[node.fault_domain])
            try:
                plan = plan_drain(job.course.layout, job.members.nodes, job.members.slots, self.slot,
                                  None if spare is None else spare.node_id)
            except PlanError as e:
                raise Cascade(f"drain plan impossible: {e}") from None
            if spare is not None:
                spare.role, spare.slot = Role.ACTIVE, self.slot
                node.role, node.slot = Role.DRAINED, None
                job.members.slots[self.slot] = spare.node_id
                job.course.fault_history.pop(self.slot, None)
                self.cycle.events.emit(SparePromoted(slot=self.slot, node=spare.node_id, replaces=node.node_id),
                                       job.course.generation)
                self.fresh = dict(plan.replaced_slots)
            else:
                node.draining = None     # no spare any more: everyone resumes in place, the node stays
                log.warning("drain of slot %s: the spare is gone; resuming in place", self.slot)
        return FromMemory(plan, cause="drain")

    def resume(self, quiesced: Quiesced | None, restore: FromMemory, restored: Restored, attempt: int) -> Resume:
        assert quiesced is not None, "a drain always quiesces"
        plan, now = restore.plan, time.time()
        stop = ((self.node.node_id, f"drained: {self.reason}"),) if plan.replaced_slots else ()
        return Resume(RecoveryDone(
            restored_step=plan.restore_step, cause="drain", replayed_steps=max(0, self.reached - plan.restore_step),
            steps_completed_before=self.reached, duration_s=round(now - self.started, 4),
            detect_to_done_s=round(now - self.requested, 4), replaced_slots=plan.replaced_slots,
            drained_node=self.node.node_id, attempts=1, phases={"quiesce_s": quiesced.seconds, **restored.phases}),
            close=False, stop=stop)    # its state is on the spare now: the drained node may go

    def failed(self, error: Exception, after: AfterFailure) -> None:
        pass

    def interrupted(self, error: Exception) -> tuple[set[int], r.Report]:
        """A fault (or a deadline) during the drain: the drained node is stopped; its slot is hot-swapped as a lost
        node's (state from replica holders and DP peers), with whatever else was lost. The hot swap's lost slots
        and its ev."""
        node = self.node
        log.warning("drain of %s interrupted, hot-swapping its slot instead: %s", node.node_id, error)
        with self.job.cv:
            slot = node.slot if node.slot is not None else next(iter(self.fresh), None)
            if node.role == Role.ACTIVE and slot is not None:
                self.lost.add(slot)
            node.role, node.slot = Role.DRAINED, None
            self.cycle.orders.direct([node.node_id], cmd.Stop(exit_code=0, reason=f"drain interrupted: {error}"))
        return self.lost, r.Drain(detail=f"drain interrupted: {error}", t=time.time())

"""Shrink and grow as plans for the recovery cycle (control/cycle.py): control/reshape.py decides, the cycle's
`Reshard` restarts every worker from memory on the new layout.

The old snapshots leave the agents' slots when the workers restart: a fault before every rank resumed cannot be
recovered in memory, and the job stops (decide.after_failure; with --persist-every, start it again to resume)."""
from __future__ import annotations

import time

from phoenixrun.control.cycle import Cycle, Quiesce, Quiesced, Reshard, Restored, Resume
from phoenixrun.control.decide import AfterFailure, Recovery
from phoenixrun.control.inflight import Stop
from phoenixrun.control.reshape import Refusal, plan_grow, plan_shrink
from phoenixrun.control.state import NodeRecord, Role
from phoenixrun.protocol.events import JobGrown, JobShrunk, RecoveryFailed, SparePromoted


class Resize:
    """Common to shrink and grow: the event that says the job has a new size."""
    lost: set[int]
    tries = 1
    started: float
    reached: int
    lost_nodes: dict[int, str] | None = None   # a shrink: old slot -> the node lost
    cause: str | None = None                   # a shrink: why
    added: str | None = None                   # a grow: the node taken in
    planned: str | None = None      # the plan's kind once made: a failure after it is the re-partition's

    def resume(self, quiesced: Quiesced | None, restore: Reshard, restored: Restored, attempt: int) -> Resume:
        plan = restore.plan
        shrink = plan.kind == "shrink"
        return Resume((JobShrunk if shrink else JobGrown)(
            nnodes=plan.new.nnodes, world_size=plan.new.world_size, was_nnodes=plan.old.nnodes,
            was_world_size=plan.old.world_size, restored_step=plan.restore_step,
            replayed_steps=max(0, self.reached - plan.restore_step), steps_completed_before=self.reached,
            slot_map=dict(plan.slot_map), duration_s=round(time.time() - self.started, 4), lost_nodes=self.lost_nodes,
            cause=self.cause, added=self.added), close=shrink)

    def failed(self, error: Exception, after: AfterFailure) -> None:
        pass

    def stop_reason(self, error: Exception) -> str:
        """Why the job stops when a cycle of this resize failed (decide.after_failure: no retry)."""
        if self.planned is None:
            return f"a fault while growing the job back: {error}"
        return f"a fault while the job was being re-partitioned ({self.planned}): {error}"


class Shrink(Resize):
    """Go on without the nodes of `lost` (no spare within --spare-wait, --on-no-spare shrink). The survivors are
    quiesced already (by the hot swap that found no spare) and their inventories current."""
    kind = Recovery.SHRINK

    def __init__(self, cycle: Cycle, lost: set[int], node: NodeRecord, started: float, reached: int):
        self.cycle, self.job = cycle, cycle.job
        self.shrunk, self.node, self.started, self.reached = lost, node, started, reached
        self.lost: set[int] = set()

    def quiesce(self) -> None:
        return None

    def plan(self, quiesced: Quiesced | None, attempt: int) -> Reshard:
        job, cfg, lost = self.job, self.cycle.cfg, self.shrunk
        with job.cv:
            alive = {s: job.members.nodes[nid] for s, nid in job.members.slots.items() if s not in lost}
            plan = plan_shrink(job.course.layout, lost, {s: n.snapshots for s, n in alive.items()},
                               {s: n.replicas for s, n in alive.items()}, job.course.placement)
            if isinstance(plan, Refusal):
                self.cycle.events.emit(RecoveryFailed(reason=f"cannot shrink: {plan.reason}"), job.course.generation)
                raise Stop(75, f"node(s) in slot(s) {sorted(lost)} lost, no spare registered within --spare-wait "
                               f"{cfg.recovery.spare_wait:g}s, and the job cannot shrink: {plan.reason}")
            gone = {}
            for s in lost:
                failed = job.members.nodes[job.members.slots[s]]
                gone[s] = failed.node_id
                failed.role, failed.slot = Role.FAILED, None
                job.course.fault_history.pop(s, None)
        self.lost_nodes, self.cause = gone, self.node.last_fault or "node lost"
        self.planned = plan.kind
        return Reshard(plan)


class Grow(Resize):
    """A shrunk job with a spare registered: quiesce, take the spare into a new last slot, re-partition."""
    kind = Recovery.GROW

    def __init__(self, cycle: Cycle, spare: NodeRecord):
        self.cycle, self.job, self.spare = cycle, cycle.job, spare
        self.started = time.time()
        self.lost: set[int] = set()
        self.reached = 0
        self.added = spare.node_id

    def quiesce(self) -> Quiesce:
        return Quiesce(tuple(self.job.members.slots.values()))

    def plan(self, quiesced: Quiesced | None, attempt: int) -> Reshard:
        assert quiesced is not None, "a reshape's plan follows its quiesce"
        self.reached = quiesced.reached
        job, spare = self.job, self.spare
        with job.cv:
            plan = plan_grow(job.course.layout, 1, {s: job.members.nodes[nid].snapshots for s, nid in job.members.slots.items()},
                             self.cycle.cfg.nnodes)
            if isinstance(plan, Refusal) or spare.role != Role.SPARE:
                why = plan.reason if isinstance(plan, Refusal) else "the spare is gone"
                raise Stop(1, f"cannot grow the job back after quiescing it: {why}")
            self.cycle.events.emit(SparePromoted(slot=plan.new_slots[0], node=spare.node_id, replaces=None),
                                   job.course.generation)
        self.planned = plan.kind
        return Reshard(plan, {plan.new_slots[0]: spare})

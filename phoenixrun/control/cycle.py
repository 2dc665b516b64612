"""One recovery cycle, carried out: quiesce -> plan -> fetch/restore -> resume.

Every recovery kind - hot swap (control/hotswap.py), planned drain (control/draining.py), shrink and grow
(control/resize.py), the persistent fallback (control/fallback.py) - is a `Plan`: it says who quiesces, makes its
plan from what they acknowledged (decisions: control/state.py's plan_recovery, decide.plan_drain, reshape.py),
returns it as one typed restore action (`FromMemory`, `FromCheckpoint`, `Reshard`) and says how the job resumes
(`Resume`). `Cycle` performs them, with the acks, the deadlines (--recovery-timeout per phase: control/inflight.py)
and the cascades: a cycle that fails is retried or handed over as decide.after_failure says, nothing is decided
here (the pattern of torch elastic's dynamic_rendezvous: a decision returns an action, one executor performs it).
Runs on the controller thread; the job's state is changed under its lock.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, Union

from phoenixrun import persist_layout as persist   # torch-free: the master never reaches the DCP writer
from phoenixrun.control.decide import AfterFailure, Failure, Next, Recovery, after_failure, no_spare
from phoenixrun.control.events import EventLog
from phoenixrun.control.incidents import Incidents
from phoenixrun.control.inflight import Acks, Cascade, InFlight, Stop
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Orders
from phoenixrun.control.reshape import ReshapePlan
from phoenixrun.control.state import NodeRecord, Phase, PlanError, RecoveryPlan, Role, pick_spare
from phoenixrun.faults.escalate import settle
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol import reports
from phoenixrun.protocol.events import EventRecord, FallbackRestart, RecoveryPlanned, SparePromoted
from phoenixrun.protocol.restore import RankSource
from phoenixrun.protocol.timings import Timings

log = logging.getLogger("phoenixrun.master")



class NoSpare(Exception):
    """No spare registered within --spare-wait for these slots, and --on-no-spare shrink: the caller shrinks."""

    def __init__(self, slots: set[int], reached: int = 0):
        super().__init__(f"no spare for slot(s) {sorted(slots)}")
        self.slots, self.reached = slots, reached    # reached: the survivors' next step as they quiesced


# ---------------------------------------------------------------- the legs of a cycle, as data
@dataclass(frozen=True)
class Quiesce:
    """Who quiesces, and a drain's step boundary (`at_step`)."""
    members: tuple[str, ...]
    at_step: int | None = None


@dataclass(frozen=True)
class Quiesced:
    generation: int
    acks: dict[str, reports.Quiesced]   # node id -> its quiesced ack
    seconds: float

    @property
    def reached(self) -> int:
        """The survivors' next step as they quiesced (what a restore replays from)."""
        return max((a.next_step for a in self.acks.values()), default=0)


@dataclass(frozen=True)
class FromMemory:
    """Restore every rank at plan.restore_step from the agents' memory: its own, or the plan's sources."""
    plan: RecoveryPlan
    cause: str | None = None      # the recovery_plan event's (a drain's)


@dataclass(frozen=True)
class FromCheckpoint:
    """Restart every worker from persistent checkpoint `step`."""
    step: int
    reason: str
    counted: bool                 # the try counts against --max-fallbacks


@dataclass(frozen=True)
class Reshard:
    """Restart every worker from memory on a new layout (shrink, grow); `joining`: new slot -> a spare taken in."""
    plan: ReshapePlan
    joining: dict[int, NodeRecord] = field(default_factory=dict)


Restore = Union[FromMemory, FromCheckpoint, Reshard]
R = TypeVar("R", bound=Restore)      # a plan's own kind of restore: what its plan() gives its resume()


@dataclass(frozen=True)
class Restored:
    generation: int
    acks: dict[str, reports.Resumed]   # node id -> its resumed ack
    phases: dict[str, float]      # plan_s, restore_s and the ranks' slowest timings


@dataclass(frozen=True)
class Resume:
    """How the job goes on once every rank resumed: the event that says so, and the orders."""
    done: EventRecord
    run: bool = True              # every node is told to run on (resume=True)
    count: bool = True            # one more recovery (status)
    close: bool = True            # it closes the incident (one console line)
    stop: tuple[tuple[str, str], ...] = ()     # (node id, reason): told to stop (exit 0) after the run order


@dataclass(frozen=True)
class Outcome:
    """A cycle that failed and is not retried: what comes next (decide.after_failure), the error, the tries."""
    next: Next
    error: Exception
    attempts: int


class Plan(Protocol[R]):
    """One recovery kind, as the executor drives it."""
    kind: Recovery
    lost: set[int]         # slots lost meanwhile: pump adds to it
    tries: int             # cycles it may take (decide.after_failure: the fallback's checkpoints)

    def quiesce(self) -> Quiesce | None:
        """Who quiesces (None: no quiesce leg). Called with the job's lock held."""

    def plan(self, quiesced: Quiesced | None, attempt: int) -> R:
        """The restore to carry out; raises PlanError (or Cascade, NoSpare) when there is none."""

    def resume(self, quiesced: Quiesced | None, restore: R, restored: Restored, attempt: int) -> Resume:
        """How the job goes on. Called with the job's lock held."""

    def failed(self, error: Exception, after: AfterFailure) -> None:
        """A cycle failed (the bookkeeping of the kind before a retry or a hand-over)."""


def failure_of(e: Exception) -> Failure:
    return Failure.NO_SPARE if isinstance(e, NoSpare) else Failure.PLAN if isinstance(e, PlanError) \
        else Failure.CASCADE


def slowest(acks: dict[str, reports.Resumed]) -> dict[str, float]:
    """The slowest rank's figure for each phase (protocol/timings.py) any resumed ack reported. Pure."""
    out = Timings()
    for r in acks.values():
        out = out.slowest(r.timings)
    return out.to_wire()


class Cycle:
    """The executor (see the module docstring)."""

    def __init__(self, job: JobState, orders: Orders, events: EventLog, flight: InFlight, incidents: Incidents):
        self.cfg, self.job, self.orders, self.events = job.cfg, job, orders, events
        self.flight, self.incidents = flight, incidents

    def drive(self, p: Plan[R]) -> Outcome | None:
        """Run cycles of `p` until one succeeds (None) or decide.after_failure says what comes instead."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self.once(p, attempt)
                return None
            except (Cascade, PlanError, NoSpare) as e:
                after = after_failure(p.kind, failure_of(e), attempt, p.tries)
                p.failed(e, after)
                if after.next is not Next.RETRY:
                    return Outcome(after.next, e, attempt)
                self.flight.settle(after.pause, p.lost)

    def once(self, p: Plan[R], attempt: int) -> None:
        """One cycle: quiesce -> plan -> restore -> resume."""
        quiesced = self.quiesce(p)
        since = time.time()
        restore = p.plan(quiesced, attempt)
        restored = self.restore(restore, p.lost, since)
        self.resume(p, quiesced, restore, restored, attempt)

    # ---------------------------------------------------------------- the legs
    def quiesce(self, p: Plan[Any]) -> Quiesced | None:
        """A new generation; its members stop at a step boundary and report their snapshot inventory."""
        t = time.time()
        job = self.job
        with job.cv:
            q = p.quiesce()
            if q is None:
                return None
            job.course.generation += 1
            g = job.course.generation
            job.course.phase = Phase.QUIESCE
            self.orders.direct(q.members, cmd.Quiesce(at_step=q.at_step))
        acks = Acks(reports.Quiesced, g, q.members, on_ack=self.flight.quiesced_inventory)
        self.flight.wait(acks, p.lost)
        return Quiesced(g, acks.got, round(time.time() - t, 4))

    def restore(self, r: Restore, lost: set[int], planning_since: float) -> Restored:
        """Order the restore and wait until every rank it names resumed."""
        with self.job.cv:
            plan_s = round(time.time() - planning_since, 4)
            if isinstance(r, FromMemory):
                expected = self._from_memory(r)
            elif isinstance(r, FromCheckpoint):
                expected = self._from_checkpoint(r)
            else:
                expected = self._reshard(r)
            g = self.job.course.generation
        t = time.time()
        acks = Acks(reports.Resumed, g, expected)
        self.flight.wait(acks, lost)
        return Restored(g, acks.got, {"plan_s": plan_s, "restore_s": round(time.time() - t, 4), **slowest(acks.got)})

    def resume(self, p: Plan[R], q: Quiesced | None, r: R, restored: Restored, attempt: int) -> None:
        job = self.job
        with job.cv:
            res = p.resume(q, r, restored, attempt)
            if res.count:
                job.course.recoveries += 1
            job.course.phase = Phase.RUNNING
            job.members.done_nodes.clear()
            done = self.events.emit(res.done, job.course.generation)
            if res.run:   # one directive for every node: each got its slot and world with the restore order
                self.orders.direct(job.members.slots.values(), cmd.Run(restart_count=job.course.restart_count, resume=True))
            for nid, why in res.stop:
                self.orders.direct([nid], cmd.Stop(exit_code=0, reason=why))
        if res.close:
            self.incidents.close(done)
        self.flight.drain_stale()

    # ---------------------------------------------------------------- the restore actions (job's lock held)
    def _from_memory(self, r: FromMemory) -> list[str]:
        job, plan = self.job, r.plan
        job.course.phase = Phase.RESTORE
        job.course.restored_step = plan.restore_step
        job.course.attempts = settle(job.course.attempts, plan.restore_step)
        self.order_restore(plan, r.cause)
        return list(plan.slots.values())

    def _from_checkpoint(self, r: FromCheckpoint) -> list[str]:
        job = self.job
        job.course.generation += 1
        job.course.fallbacks += r.counted
        job.course.restart_count += 1
        job.course.phase = Phase.RESTORE
        job.members.done_nodes.clear()
        job.course.restored_step = r.step
        persist_dir = self.cfg.persistence.persist_dir
        assert persist_dir is not None, "a fallback restart is planned only from a checkpoint in --persist-dir"
        self.events.emit(FallbackRestart(restore_step=r.step, reason=r.reason, fallbacks=job.course.fallbacks,
                                         checkpoint=str(persist.step_dir(persist_dir, r.step))),
                         job.course.generation)
        self.orders.direct_slots(cmd.Restart(restart_count=job.course.restart_count, restore_step=r.step))
        return list(job.members.slots.values())

    def _reshard(self, r: Reshard) -> list[str]:
        """Renumber the slots, relay the job out, restart every worker from memory with its `reshard` order
        (agents hand the old ranks' snapshots to the new workers, which re-partition them: runtime/reshard.py)."""
        job, plan = self.job, r.plan
        job.course.generation += 1
        renumbered = {plan.slot_map[s]: nid for s, nid in job.members.slots.items() if s in plan.slot_map}
        renumbered.update({s: n.node_id for s, n in r.joining.items()})
        job.members.slots.clear()
        job.members.slots.update(renumbered)
        for s, nid in renumbered.items():
            n = job.members.nodes[nid]
            n.role, n.slot = Role.ACTIVE, s
            n.snapshots, n.replicas = {}, {}     # keyed by the old ranks: the new ones report theirs
        job.relayout(plan.new)
        job.course.phase = Phase.RESTORE
        job.course.restored_step = plan.restore_step
        job.course.attempts = settle(job.course.attempts, plan.restore_step)
        job.members.done_nodes.clear()
        self.orders.direct_slots(cmd.Restart(restart_count=job.course.restart_count, restore_step=plan.restore_step),
                                 own={s: cmd.Assignment(reshard=plan.reshard_for(s), nnodes=plan.new.nnodes)
                                      for s in renumbered})
        return list(renumbered.values())

    def order_restore(self, plan: RecoveryPlan, cause: str | None = None) -> None:
        """Publish a plan (`recovery_plan`) and send the restore directive (under the job's lock). The ranks of
        replaced slots fetch their state from the plan's sources; everyone else restores locally."""
        job = self.job
        self.events.emit(RecoveryPlanned(restore_step=plan.restore_step, replaced_slots=dict(plan.replaced_slots),
                                         fetch={r: s.to_wire() for r, s in plan.fetch.items()}, cause=cause),
                         job.course.generation)
        fetch: dict[int, dict[int, RankSource]] = {}
        for r, src in plan.fetch.items():
            fetch.setdefault(job.course.layout.slot_of(r), {})[r] = src
        # a new world only where it changed: the slots filled in this recovery and the slots whose
        # replica holders they are (at 16K nodes: a few bodies to encode instead of 16K)
        self.orders.direct_slots(cmd.Restore(restart_count=job.course.restart_count, restore_step=plan.restore_step),
                                 own={s: cmd.Assignment(fetch=f) for s, f in fetch.items()},
                                 world_for={c for s in plan.replaced_slots for c in job.course.needed_by.get(s, ())})

    # ---------------------------------------------------------------- fetching spares
    def fill(self, lost: set[int], out: dict[int, str] | None = None, may_shrink: bool = False,
             since: dict[int, float] | None = None, whole: bool = True) -> dict[int, str]:
        """Promote a spare into every lost slot (waiting up to --spare-wait for one), each recorded in `out` at once
        (a cascade must not forget the spares promoted before it). may_shrink: a hot swap's, with --on-no-spare
        shrink - NoSpare for the slots left without one (the others keep their spare). since: slot ->
        when the wait for its spare began (kept by a hot swap across its cycles: a cascade does not restart the
        wait). whole: every worker restarts anyway (a torchrun-style restart, a fallback): a fault meanwhile only
        adds the slots of lost nodes (pump puts them in `lost`); else (a hot swap's cycle) it starts the cycle
        over at QUIESCE. Uncaught there, a survivor's worker dying during the wait crashed the master (issue 31)."""
        out = {} if out is None else out
        since = {} if since is None else since
        while pending := sorted(lost - out.keys()):
            slot = pending[0]
            deadline = since.setdefault(slot, time.time()) + self.cfg.recovery.spare_wait
            if self._promote(slot, out):
                since.pop(slot, None)
                continue
            if time.time() > deadline:
                if no_spare(may_shrink, self.cfg.recovery.on_no_spare, bool(out)) is Next.SHRINK:
                    raise NoSpare(set(lost))
                raise Stop(75, f"node in slot {slot} lost and no spare registered within "
                               f"--spare-wait {self.cfg.recovery.spare_wait:g}s")
            try:
                self.flight.pump(min(0.5, max(0.01, deadline - time.time())), lost)
            except (Cascade, PlanError) as c:
                if not whole:
                    raise
                log.warning("while waiting for a spare (every worker restarts anyway): %s", c)
        return out

    def _promote(self, slot: int, out: dict[int, str]) -> bool:
        """A spare into `slot` (state.pick_spare: outside the failed node's fault domain first), if there is one."""
        job = self.job
        with job.cv:
            failed_id = job.members.slots[slot]
            failed = job.members.nodes[failed_id]
            spare = pick_spare(job.members.nodes, avoid_domains=[failed.fault_domain])
            if spare is None:
                return False
            failed.role, failed.slot = Role.FAILED, None
            spare.role, spare.slot = Role.ACTIVE, slot
            job.members.slots[slot] = spare.node_id
            job.course.fault_history.pop(slot, None)   # escalation history belongs to the old node
            self.events.emit(SparePromoted(slot=slot, node=spare.node_id, replaces=failed_id), job.course.generation)
            out[slot] = spare.node_id
            return True

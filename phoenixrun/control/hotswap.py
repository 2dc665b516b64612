"""Hot swap as a plan for the recovery cycle (control/cycle.py): the survivors quiesce, spares fill the lost slots
(waiting up to --spare-wait), control/state.py's `plan_recovery` says who restores from whom, every rank restores
from memory and the job resumes. A fault meanwhile starts the cycle over at quiesce with a new generation;
decide.after_failure says when to give in-memory recovery up (the persistent fallback, else a restart) or to
shrink (no spare, --on-no-spare shrink)."""
from __future__ import annotations

import logging
import time

from phoenixrun.control.cycle import Cycle, FromMemory, NoSpare, Quiesce, Quiesced, Restored, Resume
from phoenixrun.control.decide import AfterFailure, Recovery
from phoenixrun.control.inflight import Cascade
from phoenixrun.control.state import plan_recovery
from phoenixrun.protocol.events import RecoveryDone

log = logging.getLogger("phoenixrun.master")


class HotSwap:
    """One hot swap: its lost slots, the spares it promoted and the waits for spares, across its cycles."""
    kind = Recovery.HOT_SWAP
    tries = 0        # decide.after_cascade bounds the cycles

    def __init__(self, cycle: Cycle, lost: set[int], started: float, detected: float,
                 fresh: dict[int, str] | None = None):
        self.cycle, self.job = cycle, cycle.job
        self.lost = lost                       # slots whose node is gone (emptied as spares are promoted)
        self.started, self.detected = started, detected
        self.fresh = dict(fresh or {})         # slot -> spare promoted during this recovery (holds no state yet)
        self.waiting: dict[int, float] = {}    # slot -> when its wait for a spare began, across cycles
        self.reached = 0

    def quiesce(self) -> Quiesce:
        """The survivors: every slot neither lost nor filled by a spare in this recovery."""
        job = self.job
        for slot in list(self.fresh):            # a promoted spare that died is lost again
            if job.members.slots.get(slot) != self.fresh[slot]:
                del self.fresh[slot]
        return Quiesce(tuple(nid for s, nid in job.members.slots.items() if s not in self.lost and s not in self.fresh))

    def plan(self, quiesced: Quiesced | None, attempt: int) -> FromMemory:
        """Spares into the lost slots, then the plan: the spares fetch their ranks' state from replica holders and
        data-parallel peers (every spare promoted in this recovery: `fresh`), everyone else restores locally."""
        assert quiesced is not None, "a hot swap's plan follows its quiesce"
        self.reached = quiesced.reached
        promoted: dict[int, str] = {}
        try:
            self.cycle.fill(self.lost, promoted, may_shrink=not self.fresh, since=self.waiting, whole=False)
        except NoSpare as e:
            raise NoSpare(e.slots, self.reached) from None
        finally:      # a cascade: the next cycle keeps the spares promoted so far (it replaced them again)
            self.fresh.update(promoted)
            self.lost.difference_update(promoted)
        self.lost.clear()
        job = self.job
        with job.cv:
            return FromMemory(plan_recovery(job.course.layout, dict(job.members.nodes), job.members.slots, set(self.fresh), job.course.placement,
                                            self.fresh, peers=job.course.peer_set))

    def resume(self, quiesced: Quiesced | None, restore: FromMemory, restored: Restored, attempt: int) -> Resume:
        plan, now = restore.plan, time.time()
        assert quiesced is not None, "a hot swap resumes after its quiesce"
        return Resume(RecoveryDone(
            restored_step=plan.restore_step, replayed_steps=max(0, self.reached - plan.restore_step),
            steps_completed_before=self.reached, duration_s=round(now - self.started, 4),
            detect_to_done_s=round(now - self.detected, 4), replaced_slots=plan.replaced_slots, attempts=attempt,
            phases={"quiesce_s": quiesced.seconds, **restored.phases}))

    def failed(self, error: Exception, after: AfterFailure) -> None:
        if isinstance(error, Cascade):
            log.warning("fault during recovery, restarting at quiesce: %s", error)

"""Which local workers still owe the agent an acknowledgement of the current recovery phase (quiesced,
resumed), so that the agent reports the phase to the master once, when the last of them did.

No I/O and no lock of its own: the agent calls it with its lock held. The -1 member is a marker: the phase
was reported already (a late or repeated ack reports nothing).
"""
from __future__ import annotations

# A worker normally acknowledges a quiesce within milliseconds (its sockets are shut down under it). One whose
# training thread is waiting on a gloo op that was enqueued as its connections went down stays blocked until the
# collective timeout; past this grace it is killed and restarts from this node's snapshot (a local reset).
QUIESCE_GRACE_S = 5.0
REPORTED = -1


class PhaseAcks:
    def __init__(self) -> None:
        self.pending_quiesce: set[int] = set()
        self.quiesce_deadline = 0.0
        self.quiesced_next_step = 0          # furthest step any local worker had completed when quiesced
        self.pending_resume: set[int] = set()
        self.resume_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ quiesce
    def expect_quiesce(self, live: set[int], deadline: float | None = None) -> None:
        """Wait for these local ranks to quiesce; `deadline` (None: keep the last one) is when the watch kills
        those that did not."""
        self.pending_quiesce = set(live)
        if deadline is not None:
            self.quiesce_deadline = deadline
            self.quiesced_next_step = 0

    def quiesced(self, local_rank: int | None, next_step: int) -> None:
        self.pending_quiesce.discard(local_rank)
        self.quiesced_next_step = max(self.quiesced_next_step, next_step)

    def gone(self, local_rank: int) -> None:
        """The worker exited: it owes nothing any more."""
        self.pending_quiesce.discard(local_rank)

    def unacked_quiesce(self) -> list[int]:
        """The local ranks that have not acknowledged the quiesce, lowest first."""
        return sorted(self.pending_quiesce - {REPORTED})

    def quiesce_overdue(self, now: float) -> bool:
        return bool(self.pending_quiesce) and REPORTED not in self.pending_quiesce and now > self.quiesce_deadline

    def quiesce_complete(self, frozen: bool) -> bool:
        """True once, when every worker quiesced while the slots are frozen: report it now."""
        if self.pending_quiesce or not frozen:
            return False
        self.pending_quiesce = {REPORTED}
        return True

    def drop_quiesce(self) -> None:
        self.pending_quiesce.clear()

    # ------------------------------------------------------------------ resume
    def expect_resume(self, local_ranks: range, timings: dict[str, float] | None = None) -> None:
        self.pending_resume = set(local_ranks)
        self.resume_timings = dict(timings or {})

    def resumed(self, local_rank: int | None, timings: dict[str, float]) -> dict[str, float] | None:
        """A worker resumed; the phase's timings (the slowest of each) when it was the last one, else None."""
        self.pending_resume.discard(local_rank)
        for k, v in timings.items():
            self.resume_timings[k] = max(v, self.resume_timings.get(k, 0.0))
        if self.pending_resume:
            return None
        self.pending_resume = {REPORTED}
        return dict(self.resume_timings)

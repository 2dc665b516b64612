"""Which local workers still owe the agent an acknowledgement of the current recovery phase (quiesced,
resumed), so that the agent reports the phase to the master once, when the last of them did.

No I/O and no lock of its own: the agent calls it with its lock held. The -1 member is a marker: the phase
was reported already (a late or repeated ack reports nothing).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable

from phoenixrun.protocol.timings import Timings

# A worker acknowledges a quiesce at its next boundary: at once when blocked in a collective (its sockets are shut
# down under it, and its generation's abort fails the collective's wait: runtime/abortable.py), else at its next
# collective (a DDP gradient bucket, a ZeRO broadcast), its next forward or its optimizer step (runtime/api.py).
# One that still does not answer (blocked where no abort reaches: a point-to-point op, the script's own I/O) is
# killed past the grace and restarts from this node's snapshot (a local reset). The grace follows the measured step
# time (`quiesce_grace`): a constant 5 s killed every survivor whose step was longer (the PHOENIX paper's take 5-6
# s), and the 7.7-8.5 s recovery tails in docs/benchmarks.md were survivors killed at that constant on a loaded
# machine.
QUIESCE_GRACE_FLOOR_S = 5.0      # no step measured yet, or short steps: the old constant, never less
QUIESCE_GRACE_STEPS = 2.0        # the grace covers this many of the longest recent steps (load varies step to step)
QUIESCE_GRACE_CAP_S = 45.0       # below --recovery-timeout (config.RULES refuses one not above it): the agent acts first
STEP_SAMPLES = 20                # recent steps per local rank the grace looks at
REPORTED = -1


def quiesce_grace(step_seconds: Iterable[float], floor: float = QUIESCE_GRACE_FLOOR_S,
                  steps: float = QUIESCE_GRACE_STEPS, cap: float = QUIESCE_GRACE_CAP_S) -> float:
    """How long a worker may take to acknowledge a quiesce, given the durations of this node's recent steps
    (seconds, any order; non-finite or negative ones ignored): `steps` x the longest, at least `floor`, at most
    `cap` (never below `floor`). Any boundary is at most one step away, so the longest step bounds the wait. Pure."""
    longest = max((s for s in step_seconds if math.isfinite(s) and s >= 0), default=0.0)
    return max(floor, min(cap, steps * longest))


class StepTimes:
    """The recent step durations each local worker reported (its `progress` messages), for `quiesce_grace`."""

    def __init__(self, per_rank: int = STEP_SAMPLES) -> None:
        self.per_rank = per_rank
        self.samples: dict[int, deque[float]] = {}

    def record(self, local_rank: int, seconds: float) -> None:
        self.samples.setdefault(local_rank, deque(maxlen=self.per_rank)).append(float(seconds))

    def grace(self) -> float:
        return quiesce_grace(s for q in self.samples.values() for s in q)


class PhaseAcks:
    def __init__(self) -> None:
        self.pending_quiesce: set[int] = set()
        self.quiesce_deadline = 0.0
        self.quiesce_grace_s = 0.0
        self.quiesced_next_step = 0          # furthest step any local worker had completed when quiesced
        self.pending_resume: set[int] = set()
        self.resume_timings = Timings()

    # ------------------------------------------------------------------ quiesce
    def expect_quiesce(self, live: set[int], deadline: float | None = None, grace: float = 0.0) -> None:
        """Wait for these local ranks to quiesce; `deadline` (None: keep the last one) is when the watch kills
        those that did not, `grace` the seconds it allowed (`quiesce_grace`, for the log)."""
        self.pending_quiesce = set(live)
        if deadline is not None:
            self.quiesce_deadline = deadline
            self.quiesce_grace_s = grace
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
    def expect_resume(self, local_ranks: range, timings: Timings | None = None) -> None:
        self.pending_resume = set(local_ranks)
        self.resume_timings = timings or Timings()

    def resumed(self, local_rank: int | None, timings: Timings) -> Timings | None:
        """A worker resumed; the phase's timings (the slowest of each) when it was the last one, else None."""
        self.pending_resume.discard(local_rank)
        self.resume_timings = self.resume_timings.slowest(timings)
        if self.pending_resume:
            return None
        self.pending_resume = {REPORTED}
        return self.resume_timings

"""The hang watchdog's decision: is a running worker hung? Pure; the supervisor (agents/supervisor.py) reads what it
needs (the worker's progress record, phoenixrun/protocol/progress_block.py, and the messages it sent) and carries
the verdict out.

The timeout is per step: a worker is suspected once the step it is in (from the step's start to the next step's
start, so the script's own work between steps counts too) is older than half of --hang-timeout (at most
PING_AFTER_S), and then asked, through its agent-link thread, whether its process is alive. A stopped or wedged
process never answers; one that is slow but alive, or blocked in a collective on another rank's hang, answers and is
left alone (the collective timeout is what ends a wait on a peer). It is called hung when its step is older than
--hang-timeout and a question is unanswered after the rest of the timeout (at least PING_GRACE_MIN_S): the question
is asked inside the timeout, not after it, so a stopped worker is found at --hang-timeout after its step began
instead of after two of them.

All times are CLOCK_MONOTONIC seconds (time.monotonic(): the workers' records are in it).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# A live worker's agent-link thread answers a ping within milliseconds on an idle machine, but not on a loaded one:
# at load average 15-19 on 2 cores a 1 s grace after the timeout declared live workers hung again and again after a
# recovery (tests/test_fault_matrix.py, job exit 75). The question is now asked at half the timeout (at most
# PING_AFTER_S into the step), so a worker has the rest of the timeout to answer, and never less than this floor.
PING_GRACE_MIN_S = 1.0
PING_AFTER_S = 1.0


class Hang(Enum):
    OK = "ok"          # within its step's time, or alive (it answered)
    PING = "ping"      # its step is late: ask its agent-link thread whether the process is alive
    WAIT = "wait"      # asked, no answer yet, still within the timeout and the grace
    HUNG = "hung"      # its step is past the timeout and it did not answer: kill it, report a hang


@dataclass(frozen=True)
class Watched:
    """What the watchdog knows of one worker (monotonic times; None: not known)."""
    armed: float | None        # the agent's last sign of progress from it (a message); None: not watched - still
                               # starting, or out of the protected loop (finished or exiting)
    step_start: float | None   # its progress record: when its current step began (None: no step yet)
    pinged: float | None       # the last question asked
    answered: float | None     # the last answer


def ping_after(hang_timeout: float) -> float:
    """How old a step is when its worker is first asked whether it is alive, and how often again. Pure."""
    return min(hang_timeout / 2, PING_AFTER_S)


def answer_grace(hang_timeout: float) -> float:
    """How long a question is given to be answered: what the timeout leaves after the first one is asked, at least
    PING_GRACE_MIN_S (a question asked again, to a worker blocked on a peer, gets as long). Pure."""
    return max(PING_GRACE_MIN_S, hang_timeout - ping_after(hang_timeout))


def hang_check(now: float, w: Watched, hang_timeout: float, recovering: bool = False) -> Hang:
    """The watchdog's verdict on one running worker. A worker is watched from the agent's first sign of its
    progress (its first step, a snapshot write, the end of a recovery it took part in) to its leaving the protected
    loop; not during a recovery (waiting is legitimate then); its step's clock starts at the later of its record and
    the agent's last sign (a record older than a recovery is its predecessor's, or the abandoned step's). Pure."""
    if recovering or w.armed is None:
        return Hang.OK
    started = w.armed if w.step_start is None else max(w.armed, w.step_start)
    age, early = now - started, ping_after(hang_timeout)
    if age <= early:
        return Hang.OK
    if w.pinged is None or w.pinged < started:
        return Hang.PING           # no question asked in this step yet
    if w.answered is not None and w.answered >= w.pinged:
        return Hang.PING if now - w.pinged >= early else Hang.OK    # alive: asked again a while later
    if age > hang_timeout and now - w.pinged >= answer_grace(hang_timeout):
        return Hang.HUNG
    return Hang.WAIT

"""No loop: a fault that keeps coming back without the job making progress climbs a ladder of remedies
(local reset -> node replace -> external fallback), then the job stops with the reason. Pure.

The master records one `Attempt` per fault it acted on (one recovery, however soon after the previous one),
keyed by the job's committed step when the fault was acted on. A later fault at the same committed step -
or one step either side: `SLACK` - means nothing was gained since: whatever was tried did not help, so the
next attempt must be a stronger remedy. The slack is the snapshot race: a rank that dies entering step N may
or may not have committed its snapshot of step N-1 first, so a fault that recurs at one point of the
script is seen at committed step N-1 one time and N-2 the next (CI saw local reset, node replace, node
replace for a crash at step 6, the repeats one step apart). The bound holds whatever the time between repeats (a deterministic fault replayed every 0.64 s looped
forever when repeats were counted as incidents separated in time: issue 20).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .taxonomy import Action, Classification

# attempts this many committed steps apart or fewer are at "the same step": one step is the replay window
SLACK = 1

# weakest to strongest; a fault's own action is never weakened, only raised
LADDER: tuple[Action, ...] = (Action.LOCAL_RESET, Action.NODE_REPLACE, Action.EXTERNAL_FALLBACK)


@dataclass(frozen=True)
class Limits:
    """How many attempts at one step each rung gets before the next one (defaults: 3 + 1 + 1, then stop)."""

    local_resets: int = 3
    node_replaces: int = 1
    fallbacks: int = 1

    def __post_init__(self) -> None:
        for name in ("local_resets", "node_replaces", "fallbacks"):
            if getattr(self, name) < 0:
                raise ValueError(f"escalation limit {name} must be >= 0, got {getattr(self, name)}")

    @property
    def attempts(self) -> int:
        """Attempts at one step before the job stops."""
        return self.local_resets + self.node_replaces + self.fallbacks


@dataclass(frozen=True)
class Attempt:
    """One fault acted on: the job's committed step then (None: none yet), and the action taken."""

    step: int | None
    action: Action


@dataclass(frozen=True)
class Escalation:
    action: Action | None  # None: stop the job
    repeats: int  # earlier attempts at this step
    reason: str  # the classification's reason, with why it was escalated (or why the job stops)

    @property
    def stop(self) -> bool:
        return self.action is None


def rung(repeats: int, limits: Limits) -> Action | None:
    """The weakest action allowed after `repeats` earlier attempts at the same step (None: stop)."""
    if repeats < limits.local_resets:
        return Action.LOCAL_RESET
    if repeats < limits.local_resets + limits.node_replaces:
        return Action.NODE_REPLACE
    if repeats < limits.attempts:
        return Action.EXTERNAL_FALLBACK
    return None


def _summary(attempts: list[Attempt]) -> str:
    counts: dict[Action, int] = {}
    for a in attempts:
        counts[a.action] = counts.get(a.action, 0) + 1
    return ", ".join(f"{a.value} x{counts[a]}" for a in LADDER if a in counts)


def committed_step(newest: Mapping[int, int], world_size: int, restored: int | None) -> int | None:
    """The job's committed step: the oldest of every rank's newest snapshot (`newest`: rank -> step, as the
    nodes last reported). A rank the master has no report from since the last recovery is at the step that
    recovery restored (`restored`): a replacement node that fails again before its first heartbeat must not
    make the step unknown - unknown matched no earlier attempt, so a fault repeating on a freshly promoted
    spare was replaced again instead of escalated (seen in tests/test_e2e_escalation.py on a loaded machine)."""
    steps = []
    for r in range(world_size):
        s = newest.get(r)
        if s is None or (restored is not None and s < restored):
            s = restored
        if s is None:
            return None
        steps.append(s)
    return min(steps) if steps else None


def settle(attempts: list[Attempt], restored: int) -> list[Attempt]:
    """The attempts once the recovery of the newest one restored step `restored`: that attempt was made at
    step `restored` at least. The master's view of the committed step (nodes' heartbeats) can lag the truth
    under load; the restore step is what the nodes held. CI on a loaded machine recorded a first attempt at a
    stale step 3 for a crash entering step 6, so the repeats at step 5 did not count it and the ladder
    stalled at node replace (local_reset, node_replace, node_replace instead of ... external_fallback)."""
    if not attempts:
        return attempts
    last = attempts[-1]
    if last.step is not None and last.step >= restored:
        return attempts
    return [*attempts[:-1], Attempt(restored, last.action)]


def escalate(c: Classification, step: int | None, history: Iterable[Attempt],
             limits: Limits = Limits()) -> Escalation:
    """The action for fault `c` acted on at committed step `step`, given the earlier attempts `history`.

    Attempts more than `SLACK` steps away do not count (the job progressed between them); nothing committed
    yet (None) counts as step -1. The action is the stronger of
    the fault's own and the ladder's rung for the number of repeats; past the last rung the job stops.
    """
    here = -1 if step is None else step
    same = [a for a in history if abs((-1 if a.step is None else a.step) - here) <= SLACK]
    n = len(same)
    floor = rung(n, limits)
    where = f"step {step}" if step is not None else "the start (nothing committed yet)"
    if floor is None:
        return Escalation(None, n, f"{c.reason}; the job stops: {n} attempts at {where} made no progress "
                                   f"({_summary(same)})")
    if LADDER.index(floor) <= LADDER.index(c.action):
        return Escalation(c.action, n, c.reason)
    return Escalation(floor, n, f"{c.reason}; escalated to {floor.value}: {n} earlier attempts at {where} made no "
                                f"progress ({_summary(same)})")

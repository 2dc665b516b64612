"""Silent-node detection by the agents' ring neighbours (pure decisions; the master's side: control/watch_desk.py,
an agent's: agents/neighbour_watch.py).

A hung host (or a cut link) closes nothing: the master would find it only by --node-timeout of heartbeat silence.
Instead each live member watches the next WATCHERS members after it in the ring (the job's slot order, spares after
the slots): it pings them every PING_S over the peer port and, when one has not answered for SUSPECT_AFTER_S,
reports it to the master as a suspect, with how long it has been silent. The master confirms before declaring the
loss: QUORUM distinct current watchers agree, and the master itself has not heard from the node since they last did
(a heartbeat or a poll that arrived later than CONTRADICT_S after a watcher's last answer means the node runs: the
watcher's view is wrong, e.g. its own link is cut). A single watcher left (the other is dead too, or a two-member
ring) is believed once the master's own silence reaches SOLO_SILENCE_S. The heartbeat timeout stays the backstop.

Each member pings WATCHERS others per PING_S whatever N is, and the master handles a report per suspicion: neither
the detection time nor the master's cost grows with N.

What is *not* declared lost: a node whose agent answers late (a loaded node: each ping has SUSPECT_AFTER_S); a node
stalled for less than SUSPECT_AFTER_S (a GC pause, a swapped-out page); a node one watcher cannot reach but the
master hears; and anything seen by a watcher that did not run itself for a while (its clocks start again, as the
master's do after its own stall: control/monitor.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence

WATCHERS = 2              # each member watches this many successors (and is watched by as many predecessors)
PING_S = 0.2              # a watcher pings each neighbour this often
SUSPECT_AFTER_S = 0.6     # no answer for this long: a suspect (a GC pause or a loaded agent answers well within)
QUORUM = 2                # distinct watchers that must agree
CONTRADICT_S = 0.3        # heard by the master this long after a watcher's last answer: alive (in-flight margin)
SOLO_SILENCE_S = 2.0      # one watcher alone is believed once the master has not heard the node for this long
REPORT_TTL_S = 5.0        # a suspicion not confirmed within this is dropped (the heartbeat timeout then judges)


@dataclass(frozen=True, order=True)
class RingMember:
    """A live member as the ring orders it: slot holders by slot, then spares (slot None) by id."""
    node_id: str
    slot: int | None


def ring(members: Iterable[RingMember]) -> list[str]:
    """The ring's order: slot holders by slot, then the slotless (spares) by id."""
    return [m.node_id for m in sorted(members, key=lambda m: (m.slot is None, m.slot or 0, m.node_id))]


def watched_by(order: Sequence[str], k: int = WATCHERS) -> dict[str, tuple[str, ...]]:
    """node -> the nodes it watches: its min(k, n - 1) successors in the ring (nobody watches itself)."""
    n = len(order)
    k = max(0, min(k, n - 1))
    return {order[i]: tuple(order[(i + j) % n] for j in range(1, k + 1)) for i in range(n)}


def watchers_of(order: Sequence[str], k: int = WATCHERS) -> dict[str, tuple[str, ...]]:
    """node -> the nodes that watch it: its min(k, n - 1) predecessors in the ring."""
    n = len(order)
    k = max(0, min(k, n - 1))
    return {order[i]: tuple(order[(i - j) % n] for j in range(1, k + 1)) for i in range(n)}


# ---------------------------------------------------------------------------------------------- a watcher's side
def silent_for(last_answer: float, watching_since: float, now: float) -> float:
    """How long a neighbour has not answered this watcher: since its last answer, or since the watch began (a new
    neighbour is not silent before it was asked)."""
    return max(0.0, now - max(last_answer, watching_since))


def is_suspect(last_answer: float, watching_since: float, now: float, own_lag: float,
               after: float = SUSPECT_AFTER_S) -> bool:
    """Should the watcher report this neighbour? Not if the watcher itself did not run for a good part of the
    window (`own_lag`: how late its own ping round came): its silence may be the watcher's own."""
    return own_lag < after / 2 and silent_for(last_answer, watching_since, now) >= after - 1e-9


# ---------------------------------------------------------------------------------------------- the master's side
class Verdict(str, Enum):
    LOST = "lost"          # declare the node lost now
    ALIVE = "alive"        # the master heard it after its watchers last did: drop the suspicions
    WAIT = "wait"          # not enough evidence yet


@dataclass(frozen=True)
class Suspicion:
    """A watcher's report, in the master's clock: the node has not answered it since `since`; received at `at`."""
    watcher: str
    since: float
    at: float


def confirm(suspicions: Iterable[Suspicion], watchers: Sequence[str], last_heard: float, now: float,
            quorum: int = QUORUM, solo_silence: float = SOLO_SILENCE_S, ttl: float = REPORT_TTL_S) -> Verdict:
    """Is the suspected node lost? `watchers`: its current watchers (a report from anyone else - the ring has moved
    since - does not count); `last_heard`: the master's latest heartbeat or poll from it."""
    current = {s.watcher: s for s in suspicions if s.watcher in watchers and now - s.at <= ttl}
    if not current:
        return Verdict.WAIT
    if any(last_heard > s.since + CONTRADICT_S for s in current.values()):
        return Verdict.ALIVE
    if len(current) >= max(1, min(quorum, len(watchers))):
        return Verdict.LOST
    return Verdict.LOST if now - last_heard >= solo_silence else Verdict.WAIT


def neighbours(order: Sequence[str], i: int, k: int = WATCHERS, step: int = 1) -> tuple[str, ...]:
    """The min(k, n - 1) members after (step 1: whom order[i] watches) or before (step -1: who watches it) position
    i - watched_by / watchers_of for one member, O(k)."""
    n = len(order)
    return tuple(order[(i + step * j) % n] for j in range(1, max(0, min(k, n - 1)) + 1))

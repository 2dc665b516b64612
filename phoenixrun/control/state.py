"""The master's view of the job, and its decisions as pure functions.

Nothing here touches a socket or a process: the master (control/coordinator.py, control/recovery.py) feeds
reports in and carries the decisions out, so every decision is table-tested.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Container, Iterable, Iterator, Mapping, TypeVar

from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.replies import TurnedAway
from phoenixrun.protocol.restore import RankSource
from phoenixrun.redundancy import PeerSet
from phoenixrun.topology import Layout

V = TypeVar("V")


class Role(str, Enum):
    ACTIVE = "active"
    SPARE = "spare"
    FAILED = "failed"
    DRAINED = "drained"        # moved to a spare by a drain: holds no slot, told to stop, never fenced


class Phase(str, Enum):
    WAITING = "waiting"        # not enough agents yet
    RUNNING = "running"
    QUIESCE = "quiesce"
    RESTORE = "restore"        # plan made: rebuild groups, restore state, resume
    FINISHED = "finished"
    FAILED = "failed"


class PhaseError(Exception):
    """An illegal move of the master's phase (PHASE_MOVES): a bug in the master, never a fault of the job."""


# Where the master's phase may go from each phase (the way NVRx's rank monitor writes its states down): the job
# starts (or a restarted master resumes it) from WAITING; a recovery goes RUNNING -> QUIESCE -> RESTORE -> RUNNING,
# starting over at QUIESCE on a cascade; a fallback (and a shrink, quiesced already) restores without quiescing,
# and its next checkpoint is RESTORE again; a torchrun-style restart is RUNNING again (from RUNNING, or from a
# recovery given up). FINISHED and FAILED are the end. `Course.phase` (control/course.py) refuses any other move.
PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.RUNNING, Phase.FINISHED, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.RUNNING, Phase.QUIESCE, Phase.RESTORE, Phase.FINISHED, Phase.FAILED}),
    Phase.QUIESCE: frozenset({Phase.QUIESCE, Phase.RESTORE, Phase.RUNNING, Phase.FINISHED, Phase.FAILED}),
    Phase.RESTORE: frozenset({Phase.QUIESCE, Phase.RESTORE, Phase.RUNNING, Phase.FINISHED, Phase.FAILED}),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
}


def phase_move(now: Phase, to: Phase) -> Phase:
    """`to`, if the master may move there from `now` (PHASE_MOVES); else PhaseError. Pure."""
    if to not in PHASE_MOVES[now]:
        raise PhaseError(f"illegal phase move {now.value} -> {to.value}: the master's phases go "
                         f"{now.value} -> {'/'.join(sorted(p.value for p in PHASE_MOVES[now])) or 'nowhere'}")
    return to


@dataclass
class NodeRecord:
    node_id: str
    host: str
    agent_pid: int
    peer_addr: str             # host:port of the agent's replica server
    fault_domain: str
    role: Role
    slot: int | None = None
    worker_pids: list[int] = field(default_factory=list)
    last_heartbeat: float = field(default_factory=time.time)
    last_fault: str | None = None
    # rank -> steps of intact snapshots in this agent's own slots / its replica store
    snapshots: dict[int, list[int]] = field(default_factory=dict)
    replicas: dict[int, list[int]] = field(default_factory=dict)
    protection: dict[int, Figures] = field(default_factory=dict)  # rank -> its figures, for status
    api: bool = False          # its workers use the phoenixrun API (hot-swap capable)
    warm_ready: bool = False   # a spare whose pre-started workers are all up (its agent says so)
    draining: str | None = None   # a drain of this node is under way (or done: role drained): its reason
    straggler: float | None = None   # how many times slower than its peers, while it is a straggler

    def to_json(self, now: float) -> dict[str, Any]:
        d = asdict(self)
        d["role"] = self.role.value
        d["protection"] = {r: f.to_wire() for r, f in self.protection.items()}
        d["heartbeat_age_s"] = round(now - self.last_heartbeat, 3)
        return d


class FreeSlots:
    """The slots of a layout no active node holds, lowest first, at O(log n) a registration (a pass over
    every slot per registration made 16K registrations quadratic: 0.3 ms each at 16K nodes). Slots are
    never given back before the start (replacements reuse the slot they fill); a slot taken by other means
    (a rejoining node keeps its own) is dropped when it reaches the front."""

    def __init__(self, nnodes: int):
        self._heap = list(range(nnodes))     # sorted: already a heap

    def lowest(self, taken: Container[int]) -> int | None:
        while self._heap and self._heap[0] in taken:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None


def admit(started: bool, free: FreeSlots, taken: Container[int], node_rank: int | None = None,
          nnodes: int | None = None) -> tuple[Role, int | None]:
    """Role and slot of a newly registered agent: fill free slots (lowest first) before the start,
    spares after (and once every slot is taken). A node that gives its node rank gets that slot, as
    under torchrun, whatever the order of registration; a rank >= nnodes is a spare; a rank another
    node holds already: (FAILED, None), the registration is refused."""
    if node_rank is not None and nnodes is not None:
        if node_rank >= nnodes or started:
            return Role.SPARE, None
        return (Role.FAILED, None) if node_rank in taken else (Role.ACTIVE, node_rank)
    slot = None if started else free.lowest(taken)
    return (Role.SPARE, None) if slot is None else (Role.ACTIVE, slot)


def by_rank(inventory: Mapping[str, V] | None) -> dict[int, V]:
    """An inventory as it comes over the wire (JSON object keys are strings) keyed by int rank."""
    return {int(k): v for k, v in (inventory or {}).items()}


def pick_spare(nodes: Mapping[str, NodeRecord], avoid_domains: Iterable[str] = ()) -> NodeRecord | None:
    """The spare to promote: prefer one outside the failed node's fault domain, then one whose warm workers
    are up (one promoted before they were made a 3-8 s recovery instead of ~1 s), then earliest joined."""
    spares = [n for n in nodes.values() if n.role == Role.SPARE]
    if not spares:
        return None
    avoid = set(avoid_domains)
    spares.sort(key=lambda n: (n.fault_domain in avoid, not n.warm_ready, n.node_id))
    return spares[0]


# How many surviving peers a replaced rank's plan names for its shared region, per rank: the agent tries the
# next when one's bytes fail the lost rank's checksum or it cannot be reached. Bounded so that the plan walks at
# most this many ring members per lost rank once every step has its options (16K-rank DP rings), and the
# directive stays small; every replica holder (--replicas of them) is named.
SHARED_OPTIONS = 3


@dataclass(frozen=True)
class RecoveryPlan:
    restore_step: int
    slots: dict[int, str]                   # slot -> node id in the new generation
    fetch: dict[int, RankSource]            # ranks whose node lost its snapshots
    replaced_slots: dict[int, str]          # slot -> node id promoted from the spare pool


class PlanError(Exception):
    """In-memory recovery is impossible; the message says why."""


def restore_step(available: Iterable[Iterable[int]]) -> int | None:
    """The last step whose snapshot every rank can get (one collection of steps per rank, or per
    distinct inventory): max of the intersection."""
    common: set[int] | None = None
    for steps in available:
        common = set(steps) if common is None else common.intersection(steps)
    return max(common) if common else None


def shared_peers(layout: Layout, peers: PeerSet | None, rank: int) -> Iterator[int]:
    """The ranks whose shared region holds `rank`'s bytes, in the order to ask them, lazily. Without a peer set:
    the DP ring of the --tp/--pp layout (DDP keeps plain state identical there; protect() made plain state
    private where it could not prove so). With one (the job's DTensor state is in the shared region, the runtime
    said where its copies are: redundancy.PeerSet), its peers - also DP peers of the layout if plain state is
    shared too."""
    if peers is None:
        return layout.iter_dp_peers(rank)
    if not peers.plain:
        return peers.peers(rank)
    c = layout.coords(rank)

    def same_shard(p: int) -> bool:
        q = layout.coords(p)
        return (q.tp, q.pp) == (c.tp, c.pp)
    return filter(same_shard, peers.peers(rank))


def plan_recovery(layout: Layout, nodes: Mapping[str, NodeRecord], slots: Mapping[int, str],
                  lost_slots: Iterable[int], placement: Mapping[int, list[int]],
                  replacements: Mapping[int, str], peers: PeerSet | None = None) -> RecoveryPlan:
    """Plan a hot swap.

    lost_slots: slots whose agent (and so its host memory) is gone; each must have an
    entry in `replacements` (a spare's node id). Ranks on surviving slots restore from
    their own agent's slots (this covers a local reset: the agent outlives its workers).
    Ranks on lost slots take their private state from a replica holder and their
    parameters from a surviving DP peer, at the same step; the plan names every holder and up to
    SHARED_OPTIONS peers that have that step, in the order the agent tries them (`RankSource`);
    peers: where DTensor state has copies, when the job keeps it in the shared region (`shared_peers`).
    """
    lost = set(lost_slots)
    missing = lost - set(replacements)
    if missing:
        raise PlanError(f"no spare node for slot(s) {sorted(missing)}")
    by_slot = {s: nodes[nid] for s, nid in slots.items() if s not in lost}
    # Surviving ranks restore from their own agent: all that matters is which steps every one of them has.
    # Their inventories repeat (16K nodes' ranks with the same two steps): each distinct one counts once.
    npn = layout.nproc_per_node
    available: set[tuple[int, ...]] = {tuple(by_slot[slot].snapshots.get(rank, ()))
                                       for slot in range(layout.nnodes) if slot not in lost
                                       for rank in range(slot * npn, (slot + 1) * npn)}
    candidates: dict[int, dict[int, tuple[list[str], list[tuple[str, int]]]]] = {}
    for rank in (r for slot in sorted(lost) for r in layout.ranks_of_slot(slot)):
        holders = [by_slot[h] for h in placement.get(rank, []) if h in by_slot]
        if not holders:
            raise PlanError(f"rank {rank}: every replica holder of its optimizer shard is lost")
        # step -> (every holder that has it, in placement order; the first SHARED_OPTIONS peers that have it,
        # in ring order). The ring is walked lazily and left once every step has all its peer options.
        private: dict[int, list[str]] = {}
        for h in holders:
            for step in h.replicas.get(rank, []):
                private.setdefault(step, []).append(h.peer_addr)
        shared: dict[int, list[tuple[str, int]]] = {step: [] for step in private}
        full = 0
        any_peer = False
        for peer_rank in shared_peers(layout, peers, rank):
            peer = by_slot.get(layout.slot_of(peer_rank))
            if peer is None:
                continue
            any_peer = True
            for step in peer.snapshots.get(peer_rank, []):
                opts = shared.get(step)
                if opts is not None and len(opts) < SHARED_OPTIONS:
                    opts.append((peer.peer_addr, peer_rank))
                    full += len(opts) == SHARED_OPTIONS
            if full == len(shared):
                break
        if not any_peer:
            raise PlanError(f"rank {rank}: no surviving data-parallel peer holds its parameters")
        options = {step: (private[step], peers) for step, peers in shared.items() if peers}
        available.add(tuple(options))
        candidates[rank] = options
    chosen = restore_step(available)
    if chosen is None:
        raise PlanError("no snapshot step is available on every rank")
    fetch = {rank: RankSource(private=tuple(opts[chosen][0]), shared=tuple(opts[chosen][1]))
             for rank, opts in candidates.items()}
    new_slots = dict(slots)
    new_slots.update(replacements)
    return RecoveryPlan(restore_step=chosen, slots=new_slots, fetch=fetch, replaced_slots=dict(replacements))


def fence_reply(node: NodeRecord | None) -> TurnedAway | None:
    """What the master answers a node that is no longer part of the job, whatever it asked; None otherwise.

    A node that was declared lost and replaced (or a spare declared lost) may come back: a healed partition, a
    host that was only slow. It must never rejoin, since its slot now belongs to another node: its agent gets a
    stop order (it kills its workers and exits). The agent does not fence itself when the master is merely
    unreachable (the master may be restarting); fencing happens here, when it talks to the master again.
    """
    if node is None or node.role != Role.FAILED:
        return None
    return TurnedAway(f"fenced: node {node.node_id} was declared lost ({node.last_fault or 'no detail'}) "
                      "and is no longer part of the job", exit_code=0, fenced=True)

"""The master's data: what it knows of the job - membership, slots, generations, snapshot inventories,
the fault history and the attempts - and nothing that acts on it.

Lock discipline: one `threading.Condition`, `cv`, guards every field. The API handlers (transport threads),
the heartbeat monitor and the recovery coordinator (one controller thread) take it for each change and never
across a wait for the network. Two exceptions, both measured: a node's `snapshots`/`replicas` are replaced
whole, never changed in place, so the coordinator stores a quiesced ack's inventory without the lock (see
control/inflight.py's InFlight.quiesced_inventory) and a reader under the lock sees the old inventory or the new
one; and `stopped` is an Event of its own.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Callable

from phoenixrun.control.decide import STRAGGLER_WINDOWS, drain_refusal, stragglers
from phoenixrun.control.roster import Roster, TrackedSlots
from phoenixrun.control.state import PHASE_MOVES, FreeSlots, NodeRecord, Phase, Role, phase_move
from phoenixrun.faults import Signal
from phoenixrun.faults.escalate import Attempt
from phoenixrun.topology import Layout, place_replicas
from phoenixrun.protocol.events import ProtectionMode, RestoreRefused, SpareLost
from phoenixrun.protocol.names import ReportKind
from phoenixrun.redundancy import PeerSet


class JobState:
    def __init__(self, cfg):
        self.cfg = cfg
        self.cv = threading.Condition()
        self.stopped = threading.Event()          # set once the job is over
        self.relayout(Layout(cfg.nnodes, cfg.nproc_per_node, cfg.shape.tp, cfg.shape.pp))
        self.endpoint = ""
        self.store_port = 0
        self.master_epoch = 0       # the lease epoch this master holds (0: no lease); every order carries it
        # membership
        self.nodes: dict[str, NodeRecord] = {}
        self.slots: dict[int, str] = TrackedSlots()   # slot -> node id, current generation (changes: the roster)
        self.free_slots = FreeSlots(cfg.nnodes)  # what registrations before the start fill
        self.heard: OrderedDict[str, None] = OrderedDict()   # node ids, least recently heard from first
        self.api_nodes: set[str] = set()
        self.tokens: dict[str, str] = {}         # node id -> the token its registration was given
        self.nonces: dict[str, str] = {}         # node id -> digest of its agent's nonce (never served: roster.py)
        # what the run directory vouches for (control/roster.py): set by the Master; None: nothing (no rejoins)
        self.roster: Roster | None = None
        self.fenced: set[str] = set()            # replaced nodes already told to go (one event each)
        self.injections: dict[str, list[str]] = {}
        # the job's course
        self.generation = 0
        self._phase = Phase.WAITING      # moved only as state.PHASE_MOVES allows (the `phase` property)
        self.restart_count = 0
        self.recoveries = 0
        self.fallbacks = 0
        self.bad_checkpoints: set[int] = set()   # steps whose persistent checkpoint failed to load
        self.exit_code: int | None = None
        self.reason = ""
        self.api_mode = False
        self.protect_every = 1
        # where the job's DTensor state has copies, when it keeps it in the shared region (rank 0 says so at
        # protect()): the plan takes shared state from these peers instead of the --tp/--pp DP ring. Not rebuilt
        # by a restarted master: a plan then asks the DP ring, whose wrong bytes the checksum refuses (fallback)
        self.peer_set: PeerSet | None = None
        self.done_nodes: set[str] = set()
        self.fault_history: dict[int, list[Signal]] = {}   # slot -> signals acted on (escalation)
        self.attempts: list[Attempt] = []   # every fault acted on, with the committed step then (no loop)
        self.restored_step: int | None = None   # the step the last recovery put every rank at (None: a fresh start)
        # a restarted master: what the rejoining agents told it
        self.resumed_at: float | None = None      # set when agents of a running job rejoin (master restart)
        self.peer_hint: dict[int, str] = {}       # slot -> peer address, as the rejoining agents knew it
        self.rejoin_generation: dict[str, int] = {}   # node -> generation it reported when rejoining
        # progress, for status
        self.progress: list[tuple[float, int]] = []
        self.progress_at = 0.0
        self.node_step: dict[str, int | None] = {}   # node id -> its ranks' oldest newest snapshot
        # stragglers: node id -> its slowest rank's compute per step (one sample per committed step), newest last
        self.compute: dict[str, deque[float]] = {}
        self.compute_step: dict[str, int] = {}
        self.compute_generation = 0
        self.stragglers_at = 0.0

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, to: Phase) -> None:
        self._phase = phase_move(self._phase, to)     # an illegal move raises PhaseError

    @property
    def over(self) -> bool:
        """The job has ended (finished or failed): no phase follows (state.PHASE_MOVES)."""
        return not PHASE_MOVES[self._phase]

    # everything below: call with cv held
    def save_roster(self, nonces: dict[str, str] | None = None) -> None:
        """Append to the run directory's roster what changed since the last call: the slots, a newer generation,
        `nonces` of new registrations. Called before any directive or registration reply tells an agent of the
        change, so a restarted master never meets an agent that knows more than the roster. O(what changed)."""
        r = self.roster
        if r is None:
            return
        changed = getattr(self.slots, "changed", None) or ()
        generation = self.generation if self.generation > r.generation else None
        if not changed and generation is None and not nonces:
            return
        r.append(self.master_epoch, generation=generation, slots={s: self.slots.get(s) for s in changed},
                 nonces=nonces)
        if changed:
            changed.clear()

    def relayout(self, layout: Layout) -> None:
        """The job's layout and replica placement: --nnodes at the start, fewer nodes while shrunk
        (control/reshape.py). Per slot: its ranks' replica holders, and the slots whose addresses it needs."""
        cfg = self.cfg
        self.layout = layout
        self.placement = place_replicas(layout, cfg.shape.replicas_on(layout.nnodes), cfg.shape.fault_domains)
        self.slot_placement: dict[int, tuple[dict[int, list[int]], list[int]]] = {}
        self.needed_by: dict[int, list[int]] = {}   # slot -> the slots whose world holds its address
        for slot in range(layout.nnodes):
            placement = {r: self.placement.get(r, []) for r in layout.ranks_of_slot(slot)}
            need = sorted({h for hs in placement.values() for h in hs} | {slot})
            self.slot_placement[slot] = placement, need
            for s in need:
                self.needed_by.setdefault(s, []).append(slot)

    @property
    def shrunk(self) -> bool:
        """Running on fewer nodes than --nnodes (a shrink; a spare that registers grows the job back)."""
        return self.layout.nnodes < self.cfg.nnodes

    def add_node(self, node: NodeRecord) -> None:
        self.nodes[node.node_id] = node
        self.heard[node.node_id] = None
        self.heard.move_to_end(node.node_id)
        if node.api:
            self.api_nodes.add(node.node_id)
        if node.slot is not None:
            self.slots[node.slot] = node.node_id

    def actives(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.role == Role.ACTIVE]

    def hot_swap_capable(self) -> bool:
        """The job's workers use the phoenixrun API (hot swap possible). Decided once every initial
        node has reported it; spares run the same script, so a promotion does not change it."""
        if not self.api_mode and len(self.api_nodes) >= self.cfg.nnodes:   # O(nodes) only when it can be true
            active = self.actives()
            self.api_mode = len(active) == self.cfg.nnodes and all(n.api for n in active)
        return self.api_mode

    def newest_snapshots(self) -> dict[int, int]:
        """rank -> the newest step any active node holds a snapshot of it at (its own or a replica)."""
        newest: dict[int, int] = {}
        for n in self.nodes.values():
            if n.role == Role.ACTIVE:
                for r, steps in n.snapshots.items():
                    if steps:
                        newest[r] = max(newest.get(r, steps[0]), max(steps))
        return newest

    def committed_step(self) -> int | None:
        """The newest step every rank has a snapshot of (None until each has one)."""
        newest = self.newest_snapshots()
        return min(newest.values()) if len(newest) == self.layout.world_size else None

    def drain_refusal(self, slot: int) -> str | None:
        """Why a drain of node slot `slot` cannot start now (decide.drain_refusal on this state); None: it can."""
        node = self.nodes.get(self.slots.get(slot, ""))
        spares = [n for n in self.nodes.values() if n.role == Role.SPARE]
        return drain_refusal(slot, self.cfg.nnodes, node, len(spares), self.phase == Phase.RUNNING,
                             self.hot_swap_capable(), self.committed_step(),
                             warm_spares=sum(1 for n in spares if n.warm_ready))

    def note_compute(self, node: NodeRecord) -> None:
        """One straggler sample per committed step of a node: its slowest rank's compute (from its heartbeat)."""
        vals = [p["compute_s"] for p in node.protection.values() if p.get("compute_s") is not None]
        step = max((p["committed_step"] for p in node.protection.values() if p.get("committed_step") is not None),
                   default=None)
        if not vals or step is None or self.compute_step.get(node.node_id) == step:
            return
        if self.compute_generation != self.generation:
            # a recovery disturbed every node's steps, and a promoted spare's first ones are slow (measured: a
            # spare just drained to flagged at 2.55x its peers at load 31): every window starts again
            self.compute_generation = self.generation
            self.compute.clear()
            self.compute_step.clear()
        first = node.node_id not in self.compute_step
        self.compute_step[node.node_id] = step
        if first:
            return        # the first step seen: warming up, or measured across the recovery
        self.compute.setdefault(node.node_id, deque(maxlen=self.cfg.stragglers.straggler_window * STRAGGLER_WINDOWS)).append(
            max(vals))

    def new_stragglers(self) -> list[NodeRecord]:
        """The active nodes that just became stragglers (decide.stragglers; each node's `straggler` kept up to
        date). O(nodes): at most twice a second."""
        now = time.time()
        if now - self.stragglers_at < 0.5 or self.phase != Phase.RUNNING:
            return []
        self.stragglers_at = now
        actives = self.actives()
        found = stragglers({n.slot: list(self.compute.get(n.node_id, ())) for n in actives},
                           self.cfg.stragglers.straggler_ratio, self.cfg.stragglers.straggler_window)
        newly = []
        for n in actives:
            r = found.get(n.slot)
            if r is not None and n.straggler is None:
                newly.append(n)
            n.straggler = r
        return newly

    def note_progress(self) -> None:
        """Throughput samples for status: O(nodes), so at most twice a second, not per heartbeat."""
        now = time.time()
        if now - self.progress_at < 0.5:
            return
        self.progress_at = now
        steps = [s for s in map(self.node_step.get, self.slots.values()) if s is not None]
        if steps:
            self.progress.append((now, min(steps)))
            self.progress = self.progress[-50:]

    def steps_per_s(self) -> float | None:
        pts = [p for p in self.progress if p[0] > time.time() - 10]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return round(max(0, pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 3)

    def absorb(self, ev: dict, emit: Callable[..., None]) -> None:
        """What any report changes whatever the phase (a spare lost, the protection mode); faults are the
        coordinator's. `emit`: the event log's."""
        kind = ev.get("kind")
        with self.cv:
            node = self.nodes.get(ev.get("node_id", ""))
            if kind == ReportKind.NODE_LOST and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
                node.last_fault = "heartbeat lost"
                emit(SpareLost(node=node.node_id), self.generation)
            elif kind == ReportKind.LEFT and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
            elif kind == ReportKind.PROTECTION_MODE and ev.get("every") != self.protect_every:
                self.protect_every = ev.get("every")
                emit(ProtectionMode(every=self.protect_every, step=ev.get("step"),
                                    reason="replication does not hide behind compute" if self.protect_every > 1
                                    else "replication hides behind compute again"), self.generation)
            elif kind == ReportKind.LAYOUT:
                # rank 0 at protect(), once per job start: where DTensor state has copies (validated by the parser)
                self.peer_set = PeerSet.from_wire(ev["peers"]) if ev.get("peers") else None
            elif kind == ReportKind.RESTORE_REFUSED:
                # the agent goes on with the plan's next option; recorded so an operator sees which holder or
                # peer held bad bytes (or could not be reached)
                emit(RestoreRefused(node=ev.get("node_id"), rank=ev.get("rank"), part=ev.get("part"),
                                    addr=ev.get("addr"), source_rank=ev.get("source_rank"),
                                    integrity=ev.get("integrity"), reason=ev.get("reason")), self.generation)

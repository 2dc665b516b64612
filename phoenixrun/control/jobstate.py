"""The master's data: what it knows of the job - membership, slots, generations, snapshot inventories,
the fault history and the attempts - and nothing that acts on it. Three parts, composed in `JobState`: who is in
the job (`members`, control/membership.py), the job's course (`course`, control/course.py) and what is measured
of it (`telemetry`, control/telemetry.py).

Lock discipline: one `threading.Condition`, `cv`, guards every field. The API handlers (transport threads),
the heartbeat monitor and the recovery coordinator (one controller thread) take it for each change and never
across a wait for the network. Two exceptions, both measured: a node's `snapshots`/`replicas` are replaced
whole, never changed in place, so the coordinator stores a quiesced ack's inventory without the lock (see
control/inflight.py's InFlight.quiesced_inventory) and a reader under the lock sees the old inventory or the new
one; and `stopped` is an Event of its own.
"""
from __future__ import annotations

import threading
from typing import Callable

from phoenixrun.config import MasterConfig
from phoenixrun.control.course import Course
from phoenixrun.control.decide import drain_refusal
from phoenixrun.control.membership import Membership
from phoenixrun.control.state import NodeRecord, Phase, Role
from phoenixrun.control.telemetry import Telemetry
from phoenixrun.protocol.events import ProtectionMode, RestoreRefused, SpareLost
from phoenixrun.protocol import reports
from phoenixrun.topology import Layout


class JobState:
    """The master's data, composed: `members` (control/membership.py), the job's `course` (control/course.py)
    and its `telemetry` (control/telemetry.py), with the lock that guards them all and what the master itself
    is (its endpoint, store port and lease epoch). The methods here are the ones that read several parts."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.cv = threading.Condition()
        self.stopped = threading.Event()          # set once the job is over
        self.endpoint = ""
        self.store_port = 0
        self.master_epoch = 0       # the lease epoch this master holds (0: no lease); every order carries it
        self.members = Membership(cfg.nnodes)
        layout = Layout(cfg.nnodes, cfg.nproc_per_node, cfg.shape.tp, cfg.shape.pp)
        self.course = Course(layout, cfg.shape.replicas_on(layout.nnodes), cfg.shape.fault_domains)
        self.telemetry = Telemetry()

    # everything below: call with cv held
    def save_roster(self, nonces: dict[str, str] | None = None) -> None:
        """Append to the run directory's roster what changed since the last call: the slots, a newer generation,
        `nonces` of new registrations. Called before any directive or registration reply tells an agent of the
        change, so a restarted master never meets an agent that knows more than the roster. O(what changed)."""
        members = self.members
        r = members.roster
        if r is None:
            return
        changed = getattr(members.slots, "changed", None) or ()
        generation = self.course.generation if self.course.generation > r.generation else None
        if not changed and generation is None and not nonces:
            return
        r.append(self.master_epoch, generation=generation, slots={s: members.slots.get(s) for s in changed},
                 nonces=nonces)
        if changed:
            changed.clear()

    def relayout(self, layout: Layout) -> None:
        """The job's layout and replica placement: --nnodes at the start, fewer nodes while shrunk
        (control/reshape.py), with as many copies as the nodes allow (MasterConfig.shape.replicas_on)."""
        self.course.relayout(layout, self.cfg.shape.replicas_on(layout.nnodes))

    @property
    def shrunk(self) -> bool:
        """Running on fewer nodes than --nnodes (a shrink; a spare that registers grows the job back)."""
        return self.course.layout.nnodes < self.cfg.nnodes

    def hot_swap_capable(self) -> bool:
        """The job's workers use the phoenixrun API (hot swap possible). Decided once every initial
        node has reported it; spares run the same script, so a promotion does not change it."""
        course, members = self.course, self.members
        if not course.api_mode and len(members.api_nodes) >= self.cfg.nnodes:   # O(nodes) only when it can be true
            active = members.actives()
            course.api_mode = len(active) == self.cfg.nnodes and all(n.api for n in active)
        return course.api_mode

    def committed_step(self) -> int | None:
        """The newest step every rank has a snapshot of (None until each has one)."""
        newest = self.members.newest_snapshots()
        return min(newest.values()) if len(newest) == self.course.layout.world_size else None

    def drain_refusal(self, slot: int) -> str | None:
        """Why a drain of node slot `slot` cannot start now (decide.drain_refusal on this state); None: it can."""
        members = self.members
        node = members.nodes.get(members.slots.get(slot, ""))
        spares = [n for n in members.nodes.values() if n.role == Role.SPARE]
        return drain_refusal(slot, self.cfg.nnodes, node, len(spares), self.course.phase == Phase.RUNNING,
                             self.hot_swap_capable(), self.committed_step(),
                             warm_spares=sum(1 for n in spares if n.warm_ready))

    def note_compute(self, node: NodeRecord) -> None:
        """One straggler sample per committed step of a node (Telemetry.note_compute)."""
        self.telemetry.note_compute(node, self.course.generation, self.cfg.stragglers.straggler_window)

    def new_stragglers(self) -> list[NodeRecord]:
        """The active nodes that just became stragglers (Telemetry.new_stragglers), while the job runs."""
        policy = self.cfg.stragglers
        return self.telemetry.new_stragglers(self.members.actives, self.course.phase == Phase.RUNNING,
                                             policy.straggler_ratio, policy.straggler_window)

    def note_progress(self) -> None:
        """Throughput samples for status (Telemetry.note_progress), from the nodes holding slots."""
        self.telemetry.note_progress(self.members.slots.values())   # a view: walked only when due

    def absorb(self, ev: reports.Report, emit: Callable[..., object]) -> None:
        """What any report changes whatever the phase (a spare lost, the protection mode); faults are the
        coordinator's. `emit`: the event log's."""
        with self.cv:
            node = self.members.nodes.get(ev.node_id)
            if isinstance(ev, reports.NodeLost) and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
                node.last_fault = "heartbeat lost"
                emit(SpareLost(node=node.node_id), self.course.generation)
            elif isinstance(ev, reports.Left) and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
            elif isinstance(ev, reports.ProtectionMode) and ev.every != self.course.protect_every:
                self.course.protect_every = ev.every
                emit(ProtectionMode(every=self.course.protect_every, step=ev.step,
                                    reason="replication does not hide behind compute" if self.course.protect_every > 1
                                    else "replication hides behind compute again"), self.course.generation)
            elif isinstance(ev, reports.Layout):
                # rank 0 at protect(), once per job start: where DTensor state has copies (validated by the parser)
                self.course.peer_set = ev.peers
            elif isinstance(ev, reports.RestoreRefused):
                # the agent goes on with the plan's next option; recorded so an operator sees which holder or
                # peer held bad bytes (or could not be reached)
                emit(RestoreRefused(node=ev.node_id, rank=ev.rank, part=ev.part, addr=ev.addr,
                                    source_rank=ev.source_rank, integrity=ev.integrity, reason=ev.reason),
                     self.course.generation)

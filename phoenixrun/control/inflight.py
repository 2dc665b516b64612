"""A recovery in flight: the reports it consumes while it waits for the acks of one phase.

`InFlight.wait` takes reports from the inbox until every expected ack came (past the phase's deadline: Cascade);
`pump` handles one report. What a report means to a recovery in flight is decided by `decide.midway` (pure); here
it is carried out: a new fault on a node in play starts the cycle over (Cascade), a restore that cannot succeed
fails the plan (PlanError), a restored state of another model stops the job (Stop). Runs on the controller thread.
"""
from __future__ import annotations

import logging
import queue
import random
import time
from typing import Callable, Generic, Iterable, TypeVar

from phoenixrun.control import layout_file
from phoenixrun.control.decide import (NODE_LOSSES, Midway, fault_detected, fault_text, loss_verdict, midway,
                                       midway_worker_verdict, mismatch_reason, signal_of)
from phoenixrun.control.events import EventLog
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox
from phoenixrun.control.state import NodeRecord, PlanError, Role
from phoenixrun.protocol import reports as r

log = logging.getLogger("phoenixrun.master")

PROBE_AFTER_S = 0.3   # a recovery phase without a new ack this long: probe the nodes it waits for
PROBE_MAX = 512       # ... this many at a time
EXIT_MISMATCH = 2     # a checkpoint of another model or optimizer: the user's mistake, as a usage error

Probe = Callable[[list[str], float, bool], set[str]]   # control/probe.py's unreachable(addrs, timeout, silent_is_dead)


class Cascade(Exception):
    """A new fault arrived while a recovery was in flight: start over at QUIESCE."""

    def __init__(self, reason: str, event: r.Report | None = None):
        super().__init__(reason)
        self.event = event


class Stop(Exception):
    """The job fails: exit_code and the reason the master gives (raised where a recovery cannot go on)."""

    def __init__(self, exit_code: int, reason: str):
        super().__init__(reason)
        self.exit_code, self.reason = exit_code, reason


A = TypeVar("A", r.Quiesced, r.Resumed)


class Acks(Generic[A]):
    """Acknowledgements of one recovery phase (`quiesced` or `resumed` of generation g): O(1) per
    ack, so waiting for 16K of them is not quadratic."""

    def __init__(self, kind: type[A], generation: int, expected: Iterable[str],
                 on_ack: Callable[[A], None] | None = None):
        self.kind: type[A] = kind
        self.generation = generation
        self.on_ack: Callable[[A], None] | None = on_ack
        self.pending = set(expected)
        self.got: dict[str, A] = {}

    def take(self, ev: r.Report) -> bool:
        """Record ev if it is one of these acks."""
        if not isinstance(ev, self.kind) or ev.generation != self.generation:
            return False
        self.add(ev)
        return True

    def add(self, ev: A) -> None:
        self.got[ev.node_id] = ev
        self.pending.discard(ev.node_id)
        if self.on_ack is not None:
            self.on_ack(ev)

    @property
    def done(self) -> bool:
        return not self.pending


def unreachable_nodes(probe: Probe, nodes: list[NodeRecord], timeout: float = 0.5,
                      silent_is_dead: bool = True) -> list[NodeRecord]:
    """Agents whose peer server does not accept a connection: a fast root-cause check. All
    probed at once (a killed node refuses in microseconds, a hung host costs one timeout)."""
    dead = probe([n.peer_addr for n in nodes], timeout, silent_is_dead)
    return [n for n in nodes if n.peer_addr in dead]


class InFlight:
    """The inbox as a recovery reads it (see the module docstring)."""

    def __init__(self, job: JobState, events: EventLog, inbox: Inbox, probe: Probe):
        self.cfg, self.job, self.events, self.inbox, self.probe = job.cfg, job, events, inbox, probe

    def absorb(self, ev: r.Report) -> None:
        self.job.absorb(ev, self.events.emit)
        if isinstance(ev, r.Layout):    # kept for a restarted master (control/layout_file.py)
            layout_file.save(self.cfg.run_dir, self.cfg.run_id, self.job.course.peer_set)

    def drain_stale(self) -> None:
        """Drop reports about the generation that was just torn down."""
        g = self.job.course.generation
        self.inbox.take(lambda ev: not isinstance(ev, r.NodeLost) and ev.generation is not None and ev.generation < g)

    def quiesced_inventory(self, ack: r.Quiesced) -> None:
        """A survivor's snapshot inventory as it quiesced (fresher than its last heartbeat's), taken as each
        ack arrives: 16K of them in one go after the last ack were 60 ms of the plan at 16K nodes. Without
        the lock: the fields are replaced whole (as heartbeats replace them), never changed in place, so a
        reader under the lock sees the old inventory or the new one."""
        node = self.job.members.nodes.get(ack.node_id)
        if node is not None:
            node.snapshots, node.replicas = ack.snapshots, ack.replicas

    def wait(self, acks: Acks[A], lost: set[int], timeout: float | None = None) -> None:
        """Consume reports until every expected ack came; past the deadline (--recovery-timeout) -> Cascade.

        A node dying mid-recovery must not cost a heartbeat timeout: when acks stop coming for
        PROBE_AFTER_S, up to PROBE_MAX of the nodes still awaited are probed (a random few each time, so
        all get probed if the stall lasts). Not while acks flow: at 16K nodes, probing every pending node
        every 0.3 s was most of the master's work in a recovery."""
        deadline = time.time() + (self.cfg.recovery.recovery_timeout if timeout is None else timeout)
        progress_at, acked = time.time(), 0
        while not acks.done:
            left = deadline - time.time()
            if left <= 0:
                raise Cascade("phase deadline passed")
            self.pump(min(left, 0.1), lost, acks)
            if len(acks.got) != acked:
                acked, progress_at = len(acks.got), time.time()
            elif time.time() - progress_at >= PROBE_AFTER_S:
                progress_at = time.time()
                # only the nodes this phase still waits for: one that acked and then died is
                # caught by the next phase's probe (or its heartbeat timeout)
                with self.job.cv:
                    pending = random.sample(list(acks.pending), min(PROBE_MAX, len(acks.pending)))
                    waiting = [self.job.members.nodes[nid] for nid in pending if nid in self.job.members.nodes]
                    waiting = [n for n in waiting if n.role == Role.ACTIVE and n.slot not in lost]
                # refusals only: mid-recovery, with the master and the agents at full load, a probe answered
                # late is no evidence (at 16K nodes, late answers declared live nodes lost); silence is the
                # heartbeat monitor's to judge
                for n in unreachable_nodes(self.probe, waiting, timeout=0.2, silent_is_dead=False):
                    self.inbox.put(r.NodeLost(node_id=n.node_id, t=time.time(),
                                              detail="agent unreachable during recovery"))

    def settle(self, seconds: float, lost: set[int]) -> None:
        """Handle reports for `seconds` before a recovery's next cycle: a node lost meanwhile joins `lost` (the
        next cycle's quiesce finds every other fault itself)."""
        deadline = time.time() + seconds
        while (left := deadline - time.time()) > 0:
            try:
                self.pump(left, lost)
            except (Cascade, PlanError) as c:
                log.info("while settling before the next recovery cycle: %s", c)

    def pump(self, timeout: float, lost: set[int], acks: Acks[r.Quiesced] | Acks[r.Resumed] | None = None) -> None:
        """Handle one report (or none within timeout), as decide.midway files it."""
        try:
            ev = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        if acks is not None and acks.take(ev):
            return   # the common case, 16K times a phase: no lock (absorb has nothing to do for acks)
        self.absorb(ev)
        with self.job.cv:
            node = self.job.members.nodes.get(ev.node_id)
            in_play = node is not None and node.role == Role.ACTIVE and node.slot not in lost
        verdict = midway(ev, in_play, self.job.course.generation)
        why = f"{ev.node_id}: {ev.reason}"
        if verdict is Midway.MISMATCH:
            raise Stop(EXIT_MISMATCH, mismatch_reason(ev, self.job.course.restored_step, self.cfg.persistence.persist_dir))
        if verdict is Midway.PLAN_FAILED:
            raise PlanError(why)
        if verdict is Midway.RETRY:
            raise Cascade(why, ev)
        if verdict is Midway.NODE_LOST and node is not None:
            self._node_lost(ev, node, lost)
        if verdict is Midway.WORKER_LOST and node is not None and node.slot is not None:
            # its node will never ack this phase: a new cycle quiesces the live workers and the restore respawns
            # the dead one from the node's snapshot (dropped as expected, it cost the whole --recovery-timeout)
            with self.job.cv:
                self.job.course.fault_history.setdefault(node.slot, []).append(signal_of(ev, node.slot))
                c = midway_worker_verdict(ev, node.slot, self.cfg.recovery.max_local_resets)
                self.events.emit(fault_detected(ev, node.node_id, node.slot, c, during_recovery=True),
                                 self.job.course.generation)
            raise Cascade(f"rank {ev.rank} on slot {node.slot} died during recovery: "
                          f"{ev.detail or ev.kind.value}", ev)

    def _node_lost(self, ev: r.Report, node: NodeRecord, lost: set[int]) -> None:
        """A node in play is gone: its slot, and those of the losses queued behind it (a rack, a switch: one cycle
        per lost node would spend the cascade budget on a single correlated failure), go to spares -> Cascade."""
        queued = self.inbox.take(lambda e: e.kind in NODE_LOSSES)
        for loss in queued:
            self.absorb(loss)             # a lost spare is marked failed, as pump would have
        newly = 0
        with self.job.cv:
            for loss in [ev, *queued]:
                n = self.job.members.nodes.get(loss.node_id)
                if n is None or n.role != Role.ACTIVE or n.slot is None or n.slot in lost:
                    continue
                lost.add(n.slot)     # whatever the classifier says: a lost node's slot goes to a spare
                newly += 1
                c = loss_verdict(loss, n.slot, self.cfg.recovery.max_local_resets)
                n.last_fault = fault_text(c, loss)
                self.events.emit(fault_detected(loss, n.node_id, n.slot, c, detail=loss.detail,
                                                during_recovery=True), self.job.course.generation)
        raise Cascade(f"node {node.node_id} (slot {node.slot}) lost during recovery: "
                      f"{ev.detail or ev.kind.value}"
                      + (f" (and {newly - 1} more queued node losses)" if newly > 1 else ""))

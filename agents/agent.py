"""The per-node agent: supervises this node's workers, owns their snapshot memory, replicates
it to peer agents, and carries out the master's directives (run, quiesce, restore, restart, stop).

A composition of parts with one job each, given their collaborators when built:
- `master_link.MasterLink`: registration, the directive long-poll and the heartbeat (a thread each);
- `executor.DirectiveExecutor`: carries out each directive (`plan_directive` decides what it means here);
- `supervisor.WorkerSupervisor`: spawns, reaps and watches the workers (exits, hangs, late quiesces);
- `worker_ops.WorkerOps`: the table of handlers for what workers send on the channel (one reader per worker);
- `replicator.Replicator`: commits snapshots after replicating them to peers, serves and fetches replicas;
- `reporter.Reporter`: the outbox of reports to the master; `drills.FaultDrills`: `phoenixrun inject`.
They share `node.NodeState` (what this node is in the job) and its one lock: all state changes happen under it.
The main loop applies directives and watches the worker processes.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from types import FrameType

from phoenixrun import netaddr
from phoenixrun.config import AgentConfig
from phoenixrun.protocol.client import ControlError
from phoenixrun.faults import InjectedHealthSource, NvmlHealthSource, poll_all
from phoenixrun.protocol import messages, reports
from phoenixrun.protocol.names import Endpoint
from phoenixrun.protocol.relay import (ACK_TIMEOUT_S, BEAT_CALL_S, BEAT_OP, RELAY_OP, RELAY_POLL_S, REPORT_OP,
                                       batch_replies)
from phoenixrun.protocol.replies import Admitted, TurnedAway
from phoenixrun.agents.beats import BeatDesk, BeatLink
from phoenixrun.agents.drills import FaultDrills
from phoenixrun.agents.executor import DirectiveExecutor
from phoenixrun.agents.ipc import WorkerChannelServer
from phoenixrun.agents.master_link import MasterLink
from phoenixrun.agents.node import Lifecycle, NodeState
from phoenixrun.agents.partition import GatedControlClient, GatedPeerClient, NetworkCut
from phoenixrun.agents.peer import PeerServer
from phoenixrun.agents.neighbour_watch import PING_IO_TIMEOUT_S, PING_OP, NeighbourWatch, answer_ping
from phoenixrun.agents.relay import AckBatcher, ParentLink, RelayCache, UpLink
from phoenixrun.agents.persister import PersistConfig, Persister
from phoenixrun.agents.phases import PhaseAcks
from phoenixrun.agents.replicator import Replicator
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.roles import AgentRole, DrainStep, drain_move
from phoenixrun.agents.slots import LocalSlots, ReplicaStore, remove_orphans
from phoenixrun.agents.supervisor import WorkerSupervisor
from phoenixrun.agents.worker_ops import WorkerOps

__all__ = ["Agent", "AgentConfig", "watch_interval"]

log = logging.getLogger("phoenixrun.agent")
# The main loop's wake-up: directives wake it at once (a blocking queue get); the timeout paces the worker
# watch (exits, hangs, health). A spare whose workers are only warm has no rank to watch for hangs, so it
# wakes 4x less often (benchmarks/idle_spare.py, docs/benchmarks.md: the idle spare agent's CPU).
WATCH_INTERVAL_S = 0.05
IDLE_SPARE_WATCH_INTERVAL_S = 0.2
HEALTH_POLL_S = 0.2     # how often the health sources (NVML, injected) are sampled
# SIGTERM on an active node of an API job asks the master to drain it; the node leaves as before (LEFT, persist,
# exit) if it is not told to stop within this: below Slurm's default KillWait (30 s) before its SIGKILL
DRAIN_WAIT_S = 20.0


def watch_interval(role: AgentRole | None, warm_only: bool) -> float:
    """How long the agent's main loop waits for a directive before it looks at its workers again. Pure."""
    return IDLE_SPARE_WATCH_INTERVAL_S if role == AgentRole.SPARE and warm_only else WATCH_INTERVAL_S


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.node = NodeState(node_id=node_id, nproc_per_node=cfg.nproc_per_node)
        self.life = Lifecycle()
        self.drain = DrainStep.NONE                # a drain this agent asked for on SIGTERM (roles.DRAIN_MOVES)
        self.drain_deadline: float | None = None   # ... leave by then at the latest
        self.cut = NetworkCut()            # partition drill: while active, this node's traffic is dropped
        self.client = GatedControlClient(cfg.endpoint, cfg.secret, self.cut)
        orphans = remove_orphans(socket.gethostname())
        if orphans:
            log.info("removed %d snapshot files left by dead agents on this host", len(orphans))
        self.slots = LocalSlots(prefix=f"phoenixrun-{node_id}")
        self.replicas = ReplicaStore()
        self.peers = GatedPeerClient(cfg.secret, self.cut)
        self.injected = InjectedHealthSource()
        self.health = [self.injected, NvmlHealthSource()]
        self._next_health_poll = 0.0
        self.sock_path = str(Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp")) / f"phoenixrun-{node_id}.sock")
        # gloo binds the workers' sockets to this node's address (left to itself, it resolves the hostname, which
        # /etc/hosts often maps to 127.0.0.1: cross-node connects then fail)
        gloo_ifname = netaddr.interface_for(cfg.host, netaddr.interfaces())
        self.reporter = Reporter(self.node, self.client, self.life)
        self.phases = PhaseAcks()
        self.supervisor = WorkerSupervisor(cfg, self.node, self.slots, self.phases, self.reporter, self.sock_path,
                                           gloo_ifname)
        self.replicator = Replicator(self.node, self.slots, self.replicas, self.peers, self.reporter)
        self.executor = DirectiveExecutor(self.node, self.life, self.slots, self.replicas, self.supervisor,
                                          self.phases, self.replicator, self.reporter)
        self.worker_ops = WorkerOps(self.node, self.slots, self.supervisor, self.phases, self.replicator,
                                    self.reporter, on_quiesce_ack=self.executor.maybe_quiesced)

    # ------------------------------------------------------------------ startup
    def run(self) -> int:
        self.channel = WorkerChannelServer(self.sock_path, self.worker_ops.on_message, self.worker_ops.on_close)
        relay = RelayCache()       # its directive fan-out part (agents/relay.py), and its children's acks
        acks = AckBatcher(relay, lambda batch: batch_replies(self.client.post(Endpoint.REPORTS, batch.to_wire(),
                                                                               timeout=ACK_TIMEOUT_S)),
                          lambda: (self.node.node_id, self.node.token or ""))
        beat_desk = BeatDesk(relay, lambda batch: batch_replies(self.client.post(
            Endpoint.HEARTBEATS, batch.to_wire(), timeout=max(2.0, self.cfg.heartbeat_interval * 4))),
            lambda: (self.node.node_id, self.node.token or ""))     # ... and its children's heartbeats
        self.peer_server = PeerServer(self.cfg.host, self.cfg.secret,
                                      {**self.replicator.peer_handlers(), RELAY_OP: relay.serve,
                                       REPORT_OP: acks.serve, BEAT_OP: beat_desk.serve, PING_OP: answer_ping},
                                      sinks=self.replicator.peer_sinks())
        self.drills = FaultDrills(self.node, self.life, self.supervisor, self.injected, self.cut, self.peer_server,
                                  self.peers)
        self.link = MasterLink(
            self.node, self.life, self.client,
            registration=messages.Register(
                node_id=self.node.node_id, host=self.cfg.host, agent_pid=os.getpid(), peer_addr=self.peer_server.addr,
                fault_domain=self.cfg.fault_domain, nproc_per_node=self.cfg.nproc_per_node,
                # only this process holds it: proves a retried registration or a rejoin is ours
                nonce=secrets.token_hex(16)),
            heartbeat_interval=self.cfg.heartbeat_interval, node_state=self._heartbeat_state,
            rejoin_state=self._rejoin_state, on_inject=self.drills.inject,
            parent=ParentLink(GatedPeerClient(self.cfg.secret, self.cut, io_timeout=RELAY_POLL_S + 3)), relay=relay,
            beats=BeatLink(GatedPeerClient(self.cfg.secret, self.cut, connect_timeout=BEAT_CALL_S,
                                           io_timeout=BEAT_CALL_S)), beat_desk=beat_desk)
        # its ring neighbours, pinged with a short timeout of their own (agents/neighbour_watch.py)
        pings = GatedPeerClient(self.cfg.secret, self.cut, connect_timeout=PING_IO_TIMEOUT_S,
                                io_timeout=PING_IO_TIMEOUT_S)
        self.watch = NeighbourWatch(pings.call, self.reporter.send_now, self.life.stopped)
        self.link.on_watch = self.watch.follow
        self.reporter.uplink = UpLink(GatedPeerClient(self.cfg.secret, self.cut, io_timeout=ACK_TIMEOUT_S + 2),
                                      self.link.relay_addr)
        try:
            reg = self.link.register(node_rank=self.cfg.node_rank)
        except ControlError as e:
            log.error("%s", e)
            self._cleanup()
            return 2
        if isinstance(reg, TurnedAway):     # the job has no place for this node: the master says why
            print(f"phoenixrun agent: {reg.reason}", file=sys.stderr, flush=True)
            self._cleanup()
            return 2 if reg.exit_code is None else reg.exit_code
        self._registered(reg)
        for target in (self.link.poll_directives, self.link.heartbeat, self.watch.run):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        self.reporter.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.drills.heal())   # ends a partition drill by hand
        try:
            while not self.life.stopping:
                try:
                    d = self.link.directives.get(timeout=watch_interval(self.node.role,
                                                                        self.supervisor.warm_workers()))
                    self.executor.apply(d)
                except queue.Empty:
                    pass
                if self.drain is DrainStep.REQUESTED:
                    self.drain = drain_move(self.drain, DrainStep.ASKED)
                    self._ask_drain()
                if self.drain is DrainStep.ASKED and self.executor.drain_at is not None:
                    # the master took it on: the spare fetches from us from now on
                    self.drain = drain_move(self.drain, DrainStep.STARTED)
                    self.drain_deadline = time.time() + DRAIN_WAIT_S
                if self.drain_deadline is not None and time.time() > self.drain_deadline:
                    log.warning("no drain within %.0fs of SIGTERM: leaving", DRAIN_WAIT_S)
                    self._leave(signal.SIGTERM)
                self._poll_health()
                self.supervisor.watch()
                self.executor.maybe_quiesced()
        finally:
            self._cleanup()
        return self.life.exit_code or 0

    def _registered(self, reg: Admitted) -> None:
        node = self.node
        node.become(AgentRole(reg.role))
        node.slot = reg.slot
        node.token = reg.token
        persist_cfg = PersistConfig.from_terms(reg.terms.persist)
        if persist_cfg is not None:
            node.persister = Persister(persist_cfg, self.slots.copy_snapshot, prefix=f"phoenixrun-{node.node_id}",
                                       backlog=2 * self.cfg.nproc_per_node)
        log.info("agent %s registered as %s%s", node.node_id, node.role.value,
                 f" (slot {node.slot})" if node.slot is not None else "")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if (signum == signal.SIGTERM and self.drain is DrainStep.NONE and self.node.role == AgentRole.ACTIVE
                and self.node.api):
            # preemption or maintenance of this node: its ranks move to a spare at a step boundary, and the master
            # tells this agent to stop once they did (no spare: it is told to stop at once, and leaves as below).
            # Asked from the main loop (_ask_drain), not in the handler.
            self.drain = drain_move(self.drain, DrainStep.REQUESTED)
            self.drain_deadline = time.time() + DRAIN_WAIT_S
            return
        self._leave(signum)

    def _ask_drain(self) -> None:
        """Ask the master, now, to drain this node; if it cannot be asked (it is down, or stopping with the whole
        job), leave at once as on SIGTERM: waiting DRAIN_WAIT_S for nobody would outlast the launcher's grace."""
        log.warning("agent got SIGTERM: asking the master to drain this node")
        why = self.reporter.send_now(reports.Drain(reason="agent got SIGTERM (preemption or maintenance)"))
        if why is not None:
            log.warning("cannot ask the master for a drain (%s): leaving", why)
            self._leave(signal.SIGTERM)

    def _leave(self, signum: int) -> None:
        log.warning("agent got signal %d: stopping workers", signum)
        self.reporter.report(reports.Left(detail=f"agent got signal {signum}"))
        self.life.stop(128 + signum)

    def _cleanup(self) -> None:
        self.supervisor.kill_all()     # the workers and the standby
        self.reporter.close(flush_s=1.0)     # last reports (why we left) get a moment to go out
        persister, exit_code = self.node.persister, self.life.exit_code
        if persister is not None:
            if exit_code == 128 + signal.SIGTERM and self.node.role == AgentRole.ACTIVE:
                # preemption: what is committed goes to disk before the memory does
                persister.write_now([(r, s) for r, steps in self.slots.available().items() for s in steps])
            elif exit_code == 0:
                persister.drain(timeout=30)    # a finished job keeps its last checkpoints
            persister.close()
        self.slots.clear()
        self.channel.close()
        self.peer_server.close()

    # ------------------------------------------------------------------ what the master learns from us
    def _heartbeat_state(self) -> messages.Heartbeat:
        node = self.node
        with node.lock:
            return messages.Heartbeat(
                node_id=node.node_id, token=node.token, worker_pids=self.supervisor.live_pids(),
                snapshots=self.slots.available(), replicas=self.replicas.available(), protection=dict(node.protection),
                api=node.api, warm_ready=node.role == AgentRole.SPARE and self.warm_ready())

    def _rejoin_state(self) -> messages.Rejoin:
        node = self.node
        with node.lock:
            return messages.Rejoin(role=node.role.value, slot=node.slot, generation=node.generation,
                                   restart_count=node.restart_count, api=node.api, frozen=self.slots.frozen,
                                   snapshots=self.slots.available(), replicas=self.replicas.available(),
                                   world_slots=dict(node.world.slots))

    def warm_ready(self) -> bool:
        """A spare whose pre-started workers have all connected (torch imported) and whose checkpoint I/O process
        is up: promoting it costs no start-up. The master prefers such spares (a spare promoted before its workers
        were up made every 3-8 s recovery of a soak; one whose I/O process was still importing made its fallback
        restart wait for it)."""
        if self.node.persister is not None and not self.node.persister.ready.is_set():
            return False
        return self.supervisor.warm_connected()

    def _poll_health(self) -> None:
        if time.time() < self._next_health_poll:
            return
        self._next_health_poll = time.time() + HEALTH_POLL_S
        for sig in poll_all(self.health):
            self.reporter.report(reports.Health(signal=sig, detail=sig.detail, t=time.time()))

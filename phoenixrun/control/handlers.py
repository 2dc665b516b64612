"""The master's API handlers: each message from an agent or an operator (register, heartbeat, report,
directive poll, inject, status) parsed, checked against the job's state and applied to it - wire -> state.
They run on the transport's threads and hold the job's lock for each message; what a report means for the
job is the coordinator's, which gets the report through the inbox.
"""
from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import time
from typing import Any, TypeVar

from phoenixrun.control import wire
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol.events import (FaultInjected, NodeFenced, NodeJoined, NodeRefused, NodeRejoined,
                                       Straggler)
from phoenixrun.protocol import messages, reports
from phoenixrun.control.decide import RUNS_WORKERS
from phoenixrun.control.directives import Ask, Directive
from phoenixrun.control.events import EventLog
from phoenixrun.control.job_view import job_view
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.orders import Inbox, Orders
from phoenixrun.control.rejections import Rejections
from phoenixrun.control.roster import digest
from phoenixrun.control.state import NodeRecord, Phase, Role, admit, fence_reply
from phoenixrun.protocol.names import REPORT_KINDS, Command, ReportKind
from phoenixrun.protocol.replies import (Admitted, Draining, Heard, HeartbeatReply, Injected, JobTerms, PersistTerms,
                                         TurnedAway)

log = logging.getLogger("phoenixrun.master")
R = TypeVar("R", bound=Admitted | TurnedAway | HeartbeatReply)


class Handlers:
    def __init__(self, job: JobState, orders: Orders, events: EventLog, inbox: Inbox, rejections: Rejections):
        self.cfg, self.job, self.orders, self.events, self.inbox = job.cfg, job, orders, events, inbox
        self.rejections = rejections
        self._msg_job = messages.Job(self.cfg.nnodes, self.cfg.nproc_per_node, job.course.layout.world_size)

    # ---------------------------------------------------------------- API handlers (transport thread)
    # Every message is parsed by protocol/messages.py before anything of it is applied; a MessageError
    # (a ValueError) is answered with its 4xx code by the transport. Then the rules that need the master's
    # state: the node's registration token, the generation, the directive version (docs/architecture.md).
    def register(self, p: dict[str, Any]) -> Admitted | TurnedAway:
        return self._epoch(self._register(p))

    def _epoch(self, reply: R) -> R:
        """Every answer an agent acts on names this master's lease epoch (agents ignore a deposed master's)."""
        return dataclasses.replace(reply, master_epoch=self.job.master_epoch)

    def _register(self, p: dict[str, Any]) -> Admitted | TurnedAway:
        msg = messages.parse_register(p, self._msg_job)
        with self.job.cv:
            fenced = self._fence(msg.node_id, "register")
            if fenced:
                return fenced
            known = self.job.members.nodes.get(msg.node_id)
            if known is not None:
                return self._reregister(known, msg)
            if msg.rejoin is not None:
                return self._readmit(msg, msg.rejoin)
            role, slot = admit(self.job.course.phase != Phase.WAITING or bool(self.job.course.resumed_at), self.job.members.free_slots, self.job.members.slots,
                               msg.node_rank, self.cfg.nnodes)
            refused = self._refusal(role, msg.node_rank)
            if refused is not None:
                self.events.emit(NodeRefused(node=msg.node_id, host=msg.host, node_rank=msg.node_rank,
                                             reason=refused.reason), self.job.course.generation)
                return refused
            node = NodeRecord(node_id=msg.node_id, host=msg.host, agent_pid=msg.agent_pid,
                              peer_addr=msg.peer_addr, fault_domain=msg.fault_domain, role=role, slot=slot)
            self.job.members.nodes[node.node_id] = node
            self.job.members.heard[node.node_id] = None
            self.job.members.heard.move_to_end(node.node_id)
            if slot is not None:
                self.job.members.slots[slot] = node.node_id
            nonce = None
            if msg.nonce is not None:
                nonce = self.job.members.nonces[node.node_id] = digest(msg.nonce)
            # in the run directory before the reply names the slot: a restarted master vouches for its rejoin
            self.job.save_roster({node.node_id: nonce} if nonce else None)
            self.events.emit(NodeJoined(node=node.node_id, host=node.host, role=role.value, slot=slot,
                                        agent_pid=node.agent_pid, fault_domain=node.fault_domain), self.job.course.generation)
            if role == Role.SPARE:
                self.orders.direct([node.node_id], cmd.Wait(warm=self.job.hot_swap_capable()))
            self.inbox.put(reports.Joined(node_id=node.node_id))
            return self._admitted(role, slot, self._new_token(node.node_id))

    def _reregister(self, node: NodeRecord, msg: messages.Register) -> Admitted:
        """A live node id registering again. Node ids are bound to the registration that created them: the same
        agent process retrying (its reply was lost) gets the same answer, and it proves it is that process with
        the nonce it sent the first time - never with what /v1/state shows of the node (host, pid, address: anyone
        holding the job secret reads them). Anyone else is refused and the record stays as it was."""
        expected = self.job.members.nonces.get(node.node_id)
        if expected is not None and msg.nonce is not None and hmac.compare_digest(expected, digest(msg.nonce)):
            return self._admitted(node.role, node.slot,
                                  self.job.members.tokens.get(node.node_id) or self._new_token(node.node_id))
        if (node.agent_pid, node.peer_addr, node.host) == (msg.agent_pid, msg.peer_addr, msg.host):
            raise messages.MessageError(
                f"node id {node.node_id!r} is registered, and this registration does not carry the nonce its agent "
                "sent first: a retry must come from the same agent process (what /v1/state shows of a node proves "
                "nothing)", code=403, reason="wrong_nonce")
        raise messages.MessageError(
            f"node id {node.node_id!r} is already registered (agent pid {node.agent_pid} at {node.peer_addr}): "
            "give each agent a unique --node-id", code=409, reason="node_id_in_use")

    def _refusal(self, role: Role, node_rank: int | None) -> TurnedAway | None:
        """The answer to a registration the job has no place for (call with the lock held), else None."""
        if role == Role.FAILED:
            return TurnedAway(f"node rank {node_rank} is already taken by node {None if node_rank is None else self.job.members.slots.get(node_rank)}: "
                              "give every node its own --node-rank", exit_code=2)
        if role == Role.SPARE and self.cfg.spares is not None and \
                sum(1 for n in self.job.members.nodes.values() if n.role == Role.SPARE) >= self.cfg.spares:
            return TurnedAway(f"the job has its {self.cfg.nnodes} nodes and {self.cfg.spares} spare(s) "
                              "(--nnodes, --spares): this node is not needed", exit_code=0)
        return None

    def _readmit(self, msg: messages.Register, r: messages.Rejoin) -> Admitted | TurnedAway:
        """An agent of a job already running when this master started (it restarted): rebuild the
        job's state from what the agents report - membership, slots, generation, snapshots."""
        nid, gen, slot = msg.node_id, r.generation, r.slot
        roster = self.job.members.roster
        # only what the run directory vouches for (control/roster.py): a master that took over a running job, the
        # agent process that registered (its nonce), a generation some master issued, the slot it was given
        if roster is None or not roster.restarted:
            raise messages.MessageError(
                f"rejoin from {nid!r} refused: this master did not take over a running job (its run directory holds "
                f"no roster of run {self.cfg.run_id!r}); a new agent registers without `rejoin`",
                code=409, reason="not_restarted")
        if not roster.vouches_nonce(nid, msg.nonce):
            raise messages.MessageError(
                f"rejoin from {nid!r} refused: " + ("it does not carry the nonce of its agent's registration"
                                                    if nid in roster.nonces else
                                                    "the run directory's roster has no such node"),
                code=403, reason="wrong_nonce")
        if gen > roster.generation:
            raise messages.MessageError(f"rejoin generation {gen} was never issued (the run directory records "
                                        f"generation {roster.generation})", code=409, reason="generation_not_issued")
        if slot is not None and roster.slots.get(slot) != nid:
            # replaced while the master was away (a healed partition, a node declared lost): fenced
            owner = roster.slots.get(slot)
            reason = (f"slot {slot} was given to {owner}" if owner is not None
                      else f"the run directory gives slot {slot} to no node")
            self.events.emit(NodeFenced(node=nid, slot=slot, reason=reason), self.job.course.generation)
            return TurnedAway(reason)
        if gen > self.job.course.generation and self.job.course.phase != Phase.WAITING:
            # once running, this master issued every generation since: a newer one was never issued
            raise messages.MessageError(f"rejoin generation {gen} was never issued (the job is at generation "
                                        f"{self.job.course.generation})", code=409, reason="generation_not_issued")
        holder = self.job.members.slots.get(slot) if slot is not None else None
        if slot is not None and holder not in (None, nid) and gen > self.job.members.rejoin_generation.get(holder, gen):
            # two agents claim one slot: the one with the older generation missed a recovery while it
            # was away (a healed partition that got here first) - it is the one to fence
            stale = self.job.members.nodes[holder]
            stale.role, stale.slot = Role.FAILED, None      # fenced at its next call (_fence)
            stale.last_fault = f"slot {slot} was given to {nid} in generation {gen}"
            del self.job.members.slots[slot]
            holder = None
        if holder not in (None, nid):
            reason = f"slot {slot} belongs to {holder}"
            self.events.emit(NodeFenced(node=nid, slot=slot, reason=reason), self.job.course.generation)
            return TurnedAway(reason)
        self.job.members.rejoin_generation[nid] = gen
        self.job.members.nonces[nid] = roster.nonces[nid]
        role = Role.ACTIVE if slot is not None else Role.SPARE
        node = NodeRecord(node_id=nid, host=msg.host, agent_pid=msg.agent_pid, peer_addr=msg.peer_addr,
                          fault_domain=msg.fault_domain, role=role, slot=slot, api=r.api)
        node.snapshots = dict(r.snapshots)
        node.replicas = dict(r.replicas)
        self.job.members.nodes[nid] = node
        self.job.members.heard[nid] = None
        self.job.members.heard.move_to_end(nid)
        if node.api:
            self.job.members.api_nodes.add(nid)
        if slot is not None:
            self.job.members.slots[slot] = nid
        self.job.course.generation = max(self.job.course.generation, gen)
        self.job.course.restart_count = max(self.job.course.restart_count, r.restart_count)
        self.job.members.peer_hint.update(r.world_slots)
        self.job.course.resumed_at = self.job.course.resumed_at or time.time()
        self.job.save_roster()
        self.events.emit(NodeRejoined(node=nid, role=role.value, slot=slot, agent_generation=gen,
                                      interrupted=r.frozen), self.job.course.generation)
        if role == Role.SPARE:
            self.orders.direct([nid], cmd.Wait(warm=node.api))
        self.inbox.put(reports.Joined(node_id=nid, interrupted=r.frozen))
        return self._admitted(role, slot, self._new_token(nid))

    def _admitted(self, role: Role, slot: int | None, token: str) -> Admitted:
        return Admitted(role.value, slot, token, JobTerms(
            run_id=self.cfg.run_id, store_port=self.job.store_port, nnodes=self.cfg.nnodes,
            nproc_per_node=self.cfg.nproc_per_node, tp=self.cfg.shape.tp, pp=self.cfg.shape.pp,
            max_restarts=self.cfg.recovery.max_restarts, persist=self._persist_terms()))

    def _new_token(self, node_id: str) -> str:
        """The registration's token: the node's later calls carry it (messages are bound to their sender)."""
        token = self.job.members.tokens[node_id] = secrets.token_hex(8)
        return token

    def check_token(self, node_id: str, token: str | None, via: str) -> None:
        """Call with the lock held, for a node this master knows."""
        expected = self.job.members.tokens.get(node_id)
        if expected is None or token is None or not hmac.compare_digest(expected, token):
            raise messages.MessageError(
                f"{via} for node {node_id!r} does not carry the token of its registration"
                + ("" if token else " (an agent older than this master? upgrade it)"), code=403, reason="wrong_token")

    def heartbeat(self, p: dict[str, Any]) -> HeartbeatReply | TurnedAway:
        msg = messages.parse_heartbeat(p, self._msg_job)
        with self.job.cv:
            node = self.job.members.nodes.get(msg.node_id)
            if node is None:
                raise messages.UnknownNode()     # a restarted master: the agent rejoins (Status.UNKNOWN_NODE)
            fenced = self._fence(node.node_id, "heartbeat")
            if fenced:
                return self._epoch(fenced)
            self.check_token(node.node_id, msg.token, "heartbeat")
            node.last_heartbeat = time.time()
            self.job.members.heard.move_to_end(node.node_id)
            node.worker_pids = msg.worker_pids
            node.snapshots = msg.snapshots
            node.replicas = msg.replicas
            node.protection = msg.protection
            node.warm_ready = msg.warm_ready
            self.job.telemetry.node_step[node.node_id] = min((max(s) for s in node.snapshots.values() if s), default=None)
            if msg.api and not node.api:
                node.api = True
                self.job.members.api_nodes.add(node.node_id)
                if self.job.hot_swap_capable():  # spares can now pre-start their workers (torch imported, waiting)
                    cold = [n.node_id for n in self.job.members.nodes.values() if n.role == Role.SPARE
                            and not getattr(self.orders.board.get(n.node_id), "fields", {}).get("warm")]
                    if cold:
                        self.orders.direct(cold, cmd.Wait(warm=True))
            self.job.note_progress()
            self.job.note_compute(node)
            for n in self.job.new_stragglers():
                self._straggler(n)
            return HeartbeatReply(node.role.value, tuple(self.job.members.injections.pop(node.node_id, [])),
                                  master_epoch=self.job.master_epoch)

    def _straggler(self, node: NodeRecord) -> None:
        """A node became a straggler (call with the lock held): reported; with --replace-stragglers, drained."""
        samples = list(self.job.telemetry.compute.get(node.node_id, ()))
        replace = self.cfg.stragglers.replace_stragglers and node.slot is not None \
            and self.job.drain_refusal(node.slot) is None
        self.events.emit(Straggler(node=node.node_id, slot=node.slot, ratio=node.straggler,
                                   compute_s=round(sorted(samples)[len(samples) // 2], 5) if samples else None,
                                   window=self.cfg.stragglers.straggler_window, threshold=self.cfg.stragglers.straggler_ratio,
                                   replace=replace), self.job.course.generation)
        if replace:
            self.inbox.put(reports.Drain(node_id=node.node_id, by="straggler", t=time.time(),
                                        reason=f"straggler: {node.straggler}x slower than its peers"))

    def inject(self, p: dict[str, Any]) -> Injected:
        """Queue a fault for a node's agent; it gets it with its next heartbeat reply."""
        msg = messages.parse_inject(p, self._msg_job)
        with self.job.cv:
            nid = self.job.members.slots.get(msg.slot)
            if nid is None or self.job.members.nodes[nid].role != Role.ACTIVE:
                raise messages.MessageError(f"no active node in slot {msg.slot}", code=409, reason="no_such_node")
            self.job.members.injections.setdefault(nid, []).append(msg.fault)
            self.events.emit(FaultInjected(node=nid, slot=msg.slot, fault=msg.fault), self.job.course.generation)
            return Injected(nid)

    def drain(self, p: dict[str, Any]) -> Draining:
        """`phoenixrun drain`: move a healthy node's ranks to a spare at a step boundary (the coordinator carries
        it out, control/recovery.py's Recoveries.drain). Refused (409) with what is wrong and what to do."""
        msg = messages.parse_drain(p, self._msg_job)
        with self.job.cv:
            refusal = self.job.drain_refusal(msg.slot)
            if refusal is not None:
                raise messages.MessageError(f"cannot drain slot {msg.slot}: {refusal}", code=409, reason="drain_refused")
            nid = self.job.members.slots[msg.slot]
        self.inbox.put(reports.Drain(node_id=nid, reason=msg.reason, by="operator", t=time.time()))
        return Draining(nid, msg.slot)

    def report(self, p: dict[str, Any]) -> Heard | TurnedAway:
        sent = reports.parse_report(p, self._msg_job, time.time())
        msg = sent.report
        with self.job.cv:
            node = self.job.members.nodes.get(msg.node_id)
            if node is None:
                raise messages.UnknownNode()
            fenced = self._fence(msg.node_id, "report")
            if fenced:
                return fenced
            self.check_token(msg.node_id, sent.token, "report")
            gen = msg.generation
            if gen is not None and gen > self.job.course.generation:
                raise messages.MessageError(f"report generation {gen} was never issued (the job is at generation "
                                            f"{self.job.course.generation})", code=409, reason="generation_not_issued")
            if REPORT_KINDS[msg.kind] and gen is not None and gen < self.job.course.generation:
                # about workers of a generation already replaced: moot (a late or replayed report)
                self.rejections.note(time.time(), node.host, "stale_generation", "/v1/report",
                                     f"{msg.kind} of generation {gen} from {msg.node_id} (now {self.job.course.generation})")
                return Heard(ignored=f"stale generation {gen} (now {self.job.course.generation})")
            if msg.kind == ReportKind.WORKERS_DONE and not self._may_be_done(node, gen):
                raise messages.MessageError(
                    f"workers_done from {msg.node_id}: it was not told to run workers in generation {self.job.course.generation}",
                    code=409, reason="not_running")
        self.inbox.put(msg)
        return Heard()

    def _may_be_done(self, node: NodeRecord, generation: int | None) -> bool:
        """A node's workers can have finished only if it holds a slot and, in this generation, was sent an
        order that runs workers (or rejoined this restarted master as an active node of it)."""
        if node.role != Role.ACTIVE or node.slot is None or generation != self.job.course.generation:
            return False
        d = self.orders.board.get(node.node_id)
        if d is not None and d.sent and d.generation == generation and d.command in RUNS_WORKERS:
            return True
        return self.job.members.rejoin_generation.get(node.node_id) == generation

    def poll_intake(self, p: dict[str, Any]) -> messages.Poll:
        """A directive long-poll as it arrives (the transport then answers or parks it): refused if it is
        malformed, holds a version this master never issued, or carries another registration's token."""
        with self.job.cv:
            msg = messages.parse_poll(p, self.orders.board.version)
            if msg.node_id in self.job.members.nodes and self._fence(msg.node_id, "directive") is None:
                self.check_token(msg.node_id, msg.token, "directive poll")
        return msg

    def answer_polls(self, asks: list[Ask]) -> list[Directive | None]:
        """Directive long-polls (many under one hold of the lock: a broadcast wakes thousands): ack the
        version each agent holds, return its newer directive if there is one, else None (the transport
        parks the poll until `_direct` wakes it or it times out). The transport calls `directives_sent`
        once it has written the answers."""
        answers: list[Directive | None] = []
        parked = False
        with self.job.cv:
            for ask in asks:
                fenced = self._fence(ask.node_id, "directive")
                if fenced:
                    fields = {**fenced.to_wire(), "version": ask.version + 1, "generation": self.job.course.generation,
                              "master_epoch": self.job.master_epoch}
                    answers.append(Directive(ask.version + 1, Command.STOP, self.job.course.generation,
                                             wire.dumps(fields)))   # not on the board
                    continue
                d = self.orders.board.answer(ask.node_id, ask.version)
                parked = parked or d is None
                answers.append(d)
            if parked:
                self.job.cv.notify_all()    # wait() watches for the stop order being acked
        return answers

    def directives_sent(self, sent: list[Directive]) -> None:
        with self.job.cv:
            for d in sent:
                self.orders.board.mark_sent(d)

    def state(self) -> dict[str, Any]:
        with self.job.cv:
            return job_view(self.job, self.events, self.rejections)

    def _fence(self, node_id: str, via: str) -> TurnedAway | None:
        """Fencing on rejoin: a node that was replaced gets only a stop order, whatever it asked."""
        reply = fence_reply(self.job.members.nodes.get(node_id))
        if reply is not None and node_id not in self.job.members.fenced:
            self.job.members.fenced.add(node_id)
            log.warning("node %s contacted the master (%s) after it was replaced: fenced", node_id, via)
            self.events.emit(NodeFenced(node=node_id, via=via, reason=reply.reason), self.job.course.generation)
        return reply

    def _persist_terms(self) -> PersistTerms | None:
        c = self.cfg.persistence
        if c.persist_dir is None:
            return None
        return PersistTerms(str(c.persist_dir), c.persist_every, c.persist_keep, self.job.course.layout.world_size)


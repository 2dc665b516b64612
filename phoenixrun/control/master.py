"""The rendezvous master: membership, spare pool, generations, fault handling, event log, status API
(the recovery procedures it runs are control/recovery.py's).

Agents talk to it over authenticated JSON/HTTP: register, heartbeat, report (faults and phase
acknowledgements) and a long-polled `directive` that tells each agent what to do now. The
master also hosts the TCPStore the workers' process groups rendezvous on (one key prefix
per generation). Decisions are the pure functions of control/state.py; this module is the
side-effecting shell around them: one controller thread handles faults one at a time, so
recovery cycles are serialized and a second fault arriving mid-recovery restarts the cycle
with a new generation instead of being dropped.
"""
from __future__ import annotations

import gc
import hashlib
import hmac
import json
import logging
import os
import secrets
import queue
import resource
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Mapping

from phoenixrun.config import MasterConfig
from phoenixrun.control import wire
from phoenixrun.protocol import messages
from phoenixrun.control.directives import Directive, DirectiveBoard, Rollout
from phoenixrun.control.events import EventLog
from phoenixrun.control.probe import unreachable
from phoenixrun.control.recovery import Recoveries, Stop
from phoenixrun.control.rejections import Rejections
from phoenixrun.control.server import ControlServer
from phoenixrun.control.state import FreeSlots, NodeRecord, Phase, Role, admit, fence_reply
from phoenixrun.faults import Action, Classification, Signal, classify, correlate
from phoenixrun.faults.escalate import Attempt, Limits, committed_step, escalate
from phoenixrun.topology import Layout, place_replicas

log = logging.getLogger("phoenixrun.master")


# reports that name a faulty node by themselves; a collective error only says "some peer failed"
ROOT_CAUSES = ("node_lost", "worker_exit", "left", "worker_hang", "health", "worker_error", "nan_loss")
# which decision of an incident is carried out first
SEVERITY = {Action.EXTERNAL_FALLBACK: 0, Action.NODE_REPLACE: 1, Action.LOCAL_RESET: 2}


class Master(Recoveries):
    def __init__(self, cfg: MasterConfig, secret: str):
        self.cfg = cfg
        self.secret = secret
        self.layout = Layout(cfg.nnodes, cfg.nproc_per_node, cfg.tp, cfg.pp)
        self.placement = place_replicas(self.layout, min(cfg.replicas, cfg.nnodes - 1), cfg.fault_domains)
        # per slot (fixed for the job): its ranks' replica holders, and the slots whose addresses it needs
        self._slot_placement: dict[int, tuple[dict[int, list[int]], list[int]]] = {}
        self._needed_by: dict[int, list[int]] = {}   # slot -> the slots whose world holds its address
        for slot in range(cfg.nnodes):
            placement = {r: self.placement.get(r, []) for r in self.layout.ranks_of_slot(slot)}
            need = sorted({h for hs in placement.values() for h in hs} | {slot})
            self._slot_placement[slot] = placement, need
            for s in need:
                self._needed_by.setdefault(s, []).append(slot)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.cv = threading.Condition()
        self.nodes: dict[str, NodeRecord] = {}
        self.slots: dict[int, str] = {}          # slot -> node id, current generation
        self._free_slots = FreeSlots(cfg.nnodes)   # what registrations before the start fill
        self.generation = 0
        self.phase = Phase.WAITING
        self.restart_count = 0
        self.recoveries = 0
        self.fallbacks = 0
        self.bad_checkpoints: set[int] = set()   # steps whose persistent checkpoint failed to load
        self.exit_code: int | None = None
        self.reason = ""
        self.api_mode = False
        self.protect_every = 1
        self.done_nodes: set[str] = set()
        self.fault_history: dict[int, list[Signal]] = {}   # slot -> signals acted on (escalation)
        self.attempts: list[Attempt] = []   # every fault acted on, with the committed step then (no loop)
        self.restored_step: int | None = None   # the step the last recovery put every rank at (None: a fresh start)
        # directive versions only grow, across master restarts too: agents ignore what is not newer
        self.directives = DirectiveBoard(on_sent=self._directive_sent)
        self._injections: dict[str, list[str]] = {}
        self.resumed_at: float | None = None      # set when agents of a running job rejoin (master restart)
        self._peer_hint: dict[int, str] = {}      # slot -> peer address, as the rejoining agents knew it
        self._rejoin_generation: dict[str, int] = {}   # node -> generation it reported when rejoining
        self._inbox: queue.Queue[dict] = queue.Queue()
        self._progress: list[tuple[float, int]] = []
        self._progress_at = 0.0
        self._node_step: dict[str, int | None] = {}          # node id -> its ranks' oldest newest snapshot
        self._heard: OrderedDict[str, None] = OrderedDict()   # node ids, least recently heard from first
        self._api_nodes: set[str] = set()
        self._wake: Callable[[list[str]], None] = lambda node_ids: None   # the transport's: directives are ready
        self._prefixes: dict[int, str] = {}      # generation -> store prefix (an HMAC: computed once)
        self._stopped = threading.Event()
        self._fenced: set[str] = set()           # replaced nodes already told to go (one event each)
        self._prefix_key = secrets.token_bytes(16)   # never leaves the master: see store_prefix()
        self._msg_job = messages.Job(cfg.nnodes, cfg.nproc_per_node, self.layout.world_size)
        self._tokens: dict[str, str] = {}        # node id -> the token its registration was given
        self.rejections = Rejections(lambda **f: self.events.emit("rejected_request", self.generation, **f))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        from torch.distributed import TCPStore  # the workers' rendezvous store lives here
        self.store = TCPStore(self.cfg.host, self.cfg.store_port, is_master=True, wait_for_workers=False,
                              use_libuv=True)
        self.store_port = self.store.port
        _raise_fd_limit()   # two connections per agent (heartbeat, directive poll)
        self.http = ControlServer(self, self.cfg.host, self.cfg.port)
        self._wake = self.http.wake
        self.http.start()
        self.endpoint = f"{self.cfg.host}:{self.http.server_address[1]}"
        for target in (self._monitor, self._controller):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        info = {"endpoint": self.endpoint, "pid": os.getpid(), "store_port": self.store_port,
                "run_id": self.cfg.run_id}
        tmp = self.run_dir / "master.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.run_dir / "master.json")
        self.events.emit("master_started", self.generation, endpoint=self.endpoint, pid=os.getpid(),
                         nnodes=self.cfg.nnodes, nproc_per_node=self.cfg.nproc_per_node)
        log.info("master listening on %s (store port %d)", self.endpoint, self.store_port)

    def wait(self) -> int:
        self._stopped.wait()
        # give agents a moment to collect their stop directive before the server goes away
        deadline = time.time() + 3.0
        with self.cv:
            while time.time() < deadline and any(
                    n.role != Role.FAILED and not getattr(self.directives.get(n.node_id), "acked", False)
                    for n in self.nodes.values()):
                self.cv.wait(0.1)
        self.http.shutdown()
        self.events.close()
        return self.exit_code or 0

    # ---------------------------------------------------------------- API handlers (transport thread)
    # Every message is parsed by control/messages.py before anything of it is applied; a MessageError
    # (a ValueError) is answered with its 4xx code by the transport. Then the rules that need the master's
    # state: the node's registration token, the generation, the directive version (docs/architecture.md).
    def register(self, p: dict) -> dict:
        msg = messages.parse_register(p, self._msg_job)
        with self.cv:
            fenced = self._fence(msg.node_id, "register")
            if fenced:
                return fenced
            known = self.nodes.get(msg.node_id)
            if known is not None:
                return self._reregister(known, msg)
            if msg.rejoin is not None:
                return self._readmit(msg, msg.rejoin)
            role, slot = admit(self.phase != Phase.WAITING or bool(self.resumed_at), self._free_slots, self.slots,
                               msg.node_rank, self.cfg.nnodes)
            refused = self._refusal(role, msg.node_rank)
            if refused is not None:
                self.events.emit("node_refused", self.generation, node=msg.node_id, host=msg.host,
                                 node_rank=msg.node_rank, reason=refused["reason"])
                return refused
            node = NodeRecord(node_id=msg.node_id, host=msg.host, agent_pid=msg.agent_pid,
                              peer_addr=msg.peer_addr, fault_domain=msg.fault_domain, role=role, slot=slot)
            self.nodes[node.node_id] = node
            self._heard[node.node_id] = None
            self._heard.move_to_end(node.node_id)
            if slot is not None:
                self.slots[slot] = node.node_id
            self.events.emit("node_joined", self.generation, node=node.node_id, host=node.host,
                             role=role.value, slot=slot, agent_pid=node.agent_pid, fault_domain=node.fault_domain)
            if role == Role.SPARE:
                self._direct([node.node_id], command="wait", warm=self._api_mode())
            self._inbox.put({"kind": "joined", "node_id": node.node_id})
            return self._job_json(role, slot, self._new_token(node.node_id))

    def _reregister(self, node: NodeRecord, msg: messages.Register) -> dict:
        """A live node id registering again. Node ids are bound to the registration that created them: the
        same agent retrying (its reply was lost: same pid and peer address) gets the same answer; anyone
        else is refused (a second agent with the same --node-id, a buggy one) and the record stays as it was."""
        if (node.agent_pid, node.peer_addr, node.host) == (msg.agent_pid, msg.peer_addr, msg.host):
            return self._job_json(node.role, node.slot, self._tokens.get(node.node_id) or self._new_token(node.node_id))
        raise messages.MessageError(
            f"node id {node.node_id!r} is already registered (agent pid {node.agent_pid} at {node.peer_addr}): "
            "give each agent a unique --node-id", code=409, reason="node_id_in_use")

    def _refusal(self, role: Role, node_rank: int | None) -> dict | None:
        """The answer to a registration the job has no place for (call with the lock held), else None."""
        if role == Role.FAILED:
            return {"role": Role.FAILED.value, "slot": None, "exit_code": 2,
                    "reason": f"node rank {node_rank} is already taken by node {self.slots.get(node_rank)}: "
                              "give every node its own --node-rank"}
        if role == Role.SPARE and self.cfg.spares is not None and \
                sum(1 for n in self.nodes.values() if n.role == Role.SPARE) >= self.cfg.spares:
            return {"role": Role.FAILED.value, "slot": None, "exit_code": 0,
                    "reason": f"the job has its {self.cfg.nnodes} nodes and {self.cfg.spares} spare(s) "
                              "(--nnodes, --spares): this node is not needed"}
        return None

    def _readmit(self, msg: messages.Register, r: messages.Rejoin) -> dict:
        """An agent of a job already running when this master started (it restarted): rebuild the
        job's state from what the agents report - membership, slots, generation, snapshots."""
        nid, gen, slot = msg.node_id, r.generation, r.slot
        if gen > self.generation and self.phase != Phase.WAITING:
            # once running, this master issued every generation since: a newer one was never issued
            raise messages.MessageError(f"rejoin generation {gen} was never issued (the job is at generation "
                                        f"{self.generation})", code=409, reason="generation_not_issued")
        holder = self.slots.get(slot) if slot is not None else None
        if holder not in (None, nid) and gen > self._rejoin_generation.get(holder, gen):
            # two agents claim one slot: the one with the older generation missed a recovery while it
            # was away (a healed partition that got here first) - it is the one to fence
            stale = self.nodes[holder]
            stale.role, stale.slot = Role.FAILED, None      # fenced at its next call (_fence)
            stale.last_fault = f"slot {slot} was given to {nid} in generation {gen}"
            del self.slots[slot]
            holder = None
        if holder not in (None, nid):
            reason = f"slot {slot} belongs to {holder}"
            self.events.emit("node_fenced", self.generation, node=nid, slot=slot, reason=reason)
            return {"role": Role.FAILED.value, "slot": None, "reason": reason}
        self._rejoin_generation[nid] = gen
        role = Role.ACTIVE if slot is not None else Role.SPARE
        node = NodeRecord(node_id=nid, host=msg.host, agent_pid=msg.agent_pid, peer_addr=msg.peer_addr,
                          fault_domain=msg.fault_domain, role=role, slot=slot, api=r.api)
        node.snapshots = dict(r.snapshots)
        node.replicas = dict(r.replicas)
        self.nodes[nid] = node
        self._heard[nid] = None
        self._heard.move_to_end(nid)
        if node.api:
            self._api_nodes.add(nid)
        if slot is not None:
            self.slots[slot] = nid
        self.generation = max(self.generation, gen)
        self.restart_count = max(self.restart_count, r.restart_count)
        self._peer_hint.update(r.world_slots)
        self.resumed_at = self.resumed_at or time.time()
        self.events.emit("node_rejoined", self.generation, node=nid, role=role.value, slot=slot,
                         agent_generation=gen, interrupted=r.frozen)
        if role == Role.SPARE:
            self._direct([nid], command="wait", warm=node.api)
        self._inbox.put({"kind": "joined", "node_id": nid, "interrupted": r.frozen})
        return self._job_json(role, slot, self._new_token(nid))

    def _job_json(self, role: Role, slot: int | None, token: str) -> dict:
        return {"role": role.value, "slot": slot, "run_id": self.cfg.run_id, "token": token,
                "store_port": self.store_port, "nnodes": self.cfg.nnodes,
                "nproc_per_node": self.cfg.nproc_per_node, "tp": self.cfg.tp, "pp": self.cfg.pp,
                "max_restarts": self.cfg.max_restarts, "persist": self._persist_json()}

    def _new_token(self, node_id: str) -> str:
        """The registration's token: the node's later calls carry it (messages are bound to their sender)."""
        token = self._tokens[node_id] = secrets.token_hex(8)
        return token

    def _check_token(self, node_id: str, token: str | None, via: str) -> None:
        """Call with the lock held, for a node this master knows."""
        expected = self._tokens.get(node_id)
        if expected is None or token is None or not hmac.compare_digest(expected, token):
            raise messages.MessageError(
                f"{via} for node {node_id!r} does not carry the token of its registration"
                + ("" if token else " (an agent older than this master? upgrade it)"), code=403, reason="wrong_token")

    def heartbeat(self, p: dict) -> dict:
        msg = messages.parse_heartbeat(p, self._msg_job)
        with self.cv:
            node = self.nodes.get(msg.node_id)
            if node is None:
                return {"error": "unknown node: register first"}
            fenced = self._fence(node.node_id, "heartbeat")
            if fenced:
                return fenced
            self._check_token(node.node_id, msg.token, "heartbeat")
            node.last_heartbeat = time.time()
            self._heard.move_to_end(node.node_id)
            node.worker_pids = msg.worker_pids
            node.snapshots = msg.snapshots
            node.replicas = msg.replicas
            node.protection = msg.protection
            node.warm_ready = msg.warm_ready
            self._node_step[node.node_id] = min((max(s) for s in node.snapshots.values() if s), default=None)
            if msg.api and not node.api:
                node.api = True
                self._api_nodes.add(node.node_id)
                if self._api_mode():  # spares can now pre-start their workers (torch imported, waiting)
                    cold = [n.node_id for n in self.nodes.values() if n.role == Role.SPARE
                            and not getattr(self.directives.get(n.node_id), "fields", {}).get("warm")]
                    if cold:
                        self._direct(cold, command="wait", warm=True)
            self._note_progress()
            return {"ok": True, "role": node.role.value, "inject": self._injections.pop(node.node_id, [])}

    def inject(self, p: dict) -> dict:
        """Queue a fault for a node's agent; it gets it with its next heartbeat reply."""
        msg = messages.parse_inject(p, self._msg_job)
        with self.cv:
            nid = self.slots.get(msg.slot)
            if nid is None or self.nodes[nid].role != Role.ACTIVE:
                raise messages.MessageError(f"no active node in slot {msg.slot}", code=409, reason="no_such_node")
            self._injections.setdefault(nid, []).append(msg.fault)
            self.events.emit("fault_injected", self.generation, node=nid, slot=msg.slot, fault=msg.fault)
            return {"ok": True, "node": nid}

    def report(self, p: dict) -> dict:
        msg = messages.parse_report(p, self._msg_job, time.time())
        with self.cv:
            node = self.nodes.get(msg.node_id)
            if node is None:
                return {"error": "unknown node"}
            fenced = self._fence(msg.node_id, "report")
            if fenced:
                return fenced
            self._check_token(msg.node_id, msg.token, "report")
            gen = msg.generation
            if gen is not None and gen > self.generation:
                raise messages.MessageError(f"report generation {gen} was never issued (the job is at generation "
                                            f"{self.generation})", code=409, reason="generation_not_issued")
            if messages.REPORT_KINDS[msg.kind] and gen is not None and gen < self.generation:
                # about workers of a generation already replaced: moot (a late or replayed report)
                self.rejections.note(time.time(), node.host, "stale_generation", "/v1/report",
                                     f"{msg.kind} of generation {gen} from {msg.node_id} (now {self.generation})")
                return {"ok": True, "ignored": f"stale generation {gen} (now {self.generation})"}
            if msg.kind == "workers_done" and not self._may_be_done(node, gen):
                raise messages.MessageError(
                    f"workers_done from {msg.node_id}: it was not told to run workers in generation {self.generation}",
                    code=409, reason="not_running")
        self._inbox.put(msg.event)
        return {"ok": True}

    def _may_be_done(self, node: NodeRecord, generation: int | None) -> bool:
        """A node's workers can have finished only if it holds a slot and, in this generation, was sent an
        order that runs workers (or rejoined this restarted master as an active node of it)."""
        if node.role != Role.ACTIVE or node.slot is None or generation != self.generation:
            return False
        d = self.directives.get(node.node_id)
        if d is not None and d.sent and d.fields.get("generation") == generation \
                and d.fields.get("command") in ("run", "restart", "restore"):
            return True
        return self._rejoin_generation.get(node.node_id) == generation

    def poll_intake(self, p: dict) -> messages.Poll:
        """A directive long-poll as it arrives (the transport then answers or parks it): refused if it is
        malformed, holds a version this master never issued, or carries another registration's token."""
        with self.cv:
            msg = messages.parse_poll(p, self.directives.version)
            if msg.node_id in self.nodes and self._fence(msg.node_id, "directive") is None:
                self._check_token(msg.node_id, msg.token, "directive poll")
        return msg

    def answer_polls(self, polls: list[dict]) -> list[Directive | None]:
        """Directive long-polls (many under one hold of the lock: a broadcast wakes thousands): ack the
        version each agent holds, return its newer directive if there is one, else None (the transport
        parks the poll until `_direct` wakes it or it times out). The transport calls `directives_sent`
        once it has written the answers."""
        for p in polls:   # malformed -> 400 now, not when the poll expires
            int(p.get("version", -1)), float(p.get("timeout", 10.0))
        answers: list[Directive | None] = []
        parked = False
        with self.cv:
            for p in polls:
                node_id, known = p.get("node_id", ""), int(p.get("version", -1))
                fenced = self._fence(node_id, "directive")
                if fenced:
                    fields = {**fenced, "version": known + 1, "generation": self.generation}
                    answers.append(Directive(known + 1, fields, wire.dumps(fields)))   # not on the board
                    continue
                d = self.directives.answer(node_id, known)
                parked = parked or d is None
                answers.append(d)
            if parked:
                self.cv.notify_all()    # wait() watches for the stop order being acked
        return answers

    def directives_sent(self, sent: list[Directive]) -> None:
        with self.cv:
            for d in sent:
                self.directives.mark_sent(d)

    def state(self) -> dict:
        with self.cv:
            now = time.time()
            steps = [max(s) for n in self.nodes.values() if n.role == Role.ACTIVE for s in n.snapshots.values() if s]
            return {
                "run_id": self.cfg.run_id, "endpoint": self.endpoint, "master_pid": os.getpid(),
                "phase": self.phase.value, "generation": self.generation,
                "step": min(steps) if len(steps) == self.layout.world_size else None,
                "steps_per_s": self._steps_per_s(), "restart_count": self.restart_count,
                "recoveries": self.recoveries, "exit_code": self.exit_code, "reason": self.reason,
                "protect_every": self.protect_every,
                "nnodes": self.cfg.nnodes, "nproc_per_node": self.cfg.nproc_per_node,
                "world_size": self.layout.world_size, "replicas": self.cfg.replicas,
                "nodes": sorted(({**n.to_json(now), "ranks": self._ranks_json(n.slot)} for n in self.nodes.values()),
                                key=lambda d: (d["slot"] is None, d["slot"] or 0, d["node_id"])),
                "events": list(self.events.recent)[-15:],
                "rejected_requests": self.rejections.snapshot(),
            }

    def _ranks_json(self, slot: int | None) -> list[int]:
        """The global ranks a node's workers hold (none for a spare): where rank 0 runs, for status."""
        return [] if slot is None else list(self.layout.ranks_of_slot(slot))

    # ---------------------------------------------------------------- helpers (call with self.cv held)
    def _fence(self, node_id: str, via: str) -> dict | None:
        """Fencing on rejoin: a node that was replaced gets only a stop order, whatever it asked."""
        reply = fence_reply(self.nodes.get(node_id))
        if reply is not None and node_id not in self._fenced:
            self._fenced.add(node_id)
            log.warning("node %s contacted the master (%s) after it was replaced: fenced", node_id, via)
            self.events.emit("node_fenced", self.generation, node=node_id, via=via, reason=reply["reason"])
        return reply

    def store_prefix(self, generation: int) -> str:
        """Generation fencing: the store key prefix a generation's process groups rendezvous on.

        It carries a token only the master can compute and only current members receive (in their directives),
        so a worker of an older generation - a fenced node's, say - cannot join a newer generation's
        rendezvous even if it guesses the generation number.
        """
        prefix = self._prefixes.get(generation)
        if prefix is None:
            token = hmac.new(self._prefix_key, f"gen{generation}".encode(), hashlib.sha256).hexdigest()[:16]
            prefix = self._prefixes[generation] = f"/phoenixrun/gen{generation}-{token}/"
        return prefix

    def _direct(self, node_ids: Iterable[str], **fields) -> None:
        """Order node_ids to do `fields` (one version, one encoding for all of them) and wake their polls."""
        self._wake(self.directives.set(node_ids, **fields, **self._generation_fields()))

    def _generation_fields(self) -> dict:
        """What every directive carries: the generation and its rendezvous prefix."""
        return {"generation": self.generation, "store_prefix": self.store_prefix(self.generation)}

    def _directive_sent(self, r: Rollout, t: float) -> None:
        """Every node a directive was set for has been sent it (called with the lock held)."""
        # a broadcast: how long the order took to reach the last node's connection (not the final stop: the
        # job's last event stays job_finished)
        if r.targets > 1 and r.command != "stop":
            self.events.emit("directive_sent", r.generation, command=r.command, version=r.version, nodes=r.targets,
                             seconds=round(t - r.set_at, 4))

    def _direct_slots(self, command: str, own: Mapping[int, dict] | None = None,
                      world_for: Iterable[int] | None = None, **fields) -> None:
        """Order every slot's node to do `command` (one version for all), with its slot and world: every
        slot's, or only those in world_for (the others keep theirs); own: more fields for some slots.
        Nodes given nothing of their own share one encoding."""
        own = own or {}
        world_for = self.slots.keys() if world_for is None else set(world_for)
        orders = {nid: {"slot": slot, "world": self._world(slot), **own.get(slot, {})} if slot in world_for
                  else own.get(slot, {}) for slot, nid in self.slots.items()}
        self._wake(self.directives.set_each(orders, command=command, **fields, **self._generation_fields()))

    def _persist_json(self) -> dict | None:
        if self.cfg.persist_dir is None:
            return None
        return {"dir": str(self.cfg.persist_dir), "every": self.cfg.persist_every, "keep": self.cfg.persist_keep,
                "world_size": self.layout.world_size}

    def _api_mode(self) -> bool:
        """The job's workers use the phoenixrun API (hot swap possible). Decided once every initial
        node has reported it; spares run the same script, so a promotion does not change it."""
        if not self.api_mode and len(self._api_nodes) >= self.cfg.nnodes:   # O(nodes) only when it can be true
            active = [n for n in self.nodes.values() if n.role == Role.ACTIVE]
            self.api_mode = len(active) == self.cfg.nnodes and all(n.api for n in active)
        return self.api_mode

    def _world(self, slot: int) -> dict:
        """What the node in `slot` needs of the world: where its ranks' replicas go and those holders'
        addresses. (The whole map in every node's directive would be O(nodes^2) bytes per broadcast.)"""
        placement, need = self._slot_placement[slot]
        return {"slots": {s: self.nodes[self.slots[s]].peer_addr for s in need if s in self.slots},
                "placement": placement, "store_port": self.store_port}

    def _note_progress(self) -> None:
        """Throughput samples for status: O(nodes), so at most twice a second, not per heartbeat."""
        now = time.time()
        if now - self._progress_at < 0.5:
            return
        self._progress_at = now
        steps = [s for s in map(self._node_step.get, self.slots.values()) if s is not None]
        if steps:
            self._progress.append((now, min(steps)))
            self._progress = self._progress[-50:]

    def _steps_per_s(self) -> float | None:
        pts = [p for p in self._progress if p[0] > time.time() - 10]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return round(max(0, pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 3)

    # ---------------------------------------------------------------- failure detection
    def _monitor(self) -> None:
        tick = min(0.25, self.cfg.node_timeout / 4)
        woke = time.monotonic()
        while not self._stopped.is_set():
            time.sleep(tick)
            now = time.time()
            t = time.monotonic()
            slept, woke = t - woke, t
            with self.cv:
                if slept > 4 * tick:
                    self._forgive_stall(slept - tick)
                stale = []
                for nid in self._heard:   # least recently heard first: stop at the first fresh one
                    if now - self.nodes[nid].last_heartbeat <= self.cfg.node_timeout:
                        break
                    stale.append(nid)
                for nid in stale:
                    n = self.nodes[nid]
                    if n.role != Role.FAILED:
                        self._inbox.put({"kind": "node_lost", "node_id": n.node_id, "t": now,
                                         "detail": f"no heartbeat for {now - n.last_heartbeat:.1f}s"})
                    n.last_heartbeat = now  # report once per timeout period
                    self._heard.move_to_end(nid)

    def _forgive_stall(self, seconds: float) -> None:
        """The master itself did not run for `seconds` (stopped, swapped out, starved): the heartbeats it
        did not read meanwhile are its own silence, not the nodes'. Without this, a master paused for longer
        than --node-timeout declared every node lost at once when it ran again (seen when a profiler
        paused it at 16K nodes: the job failed, "recovery kept failing")."""
        log.warning("the master did not run for %.1fs: heartbeat clocks moved on by as much", seconds)
        self.events.emit("master_stalled", self.generation, seconds=round(seconds, 3))
        now = time.time()
        for n in self.nodes.values():   # capped: one heard since it ran again is no fresher than now
            n.last_heartbeat = min(n.last_heartbeat + seconds, now)

    def _unreachable(self, nodes: list[NodeRecord], timeout: float = 0.5,
                     silent_is_dead: bool = True) -> list[NodeRecord]:
        """Agents whose peer server does not accept a connection: a fast root-cause check. All
        probed at once (a killed node refuses in microseconds, a hung host costs one timeout)."""
        dead = unreachable([n.peer_addr for n in nodes], timeout, silent_is_dead)
        return [n for n in nodes if n.peer_addr in dead]

    # ---------------------------------------------------------------- controller
    def _controller(self) -> None:
        try:
            self._wait_for_start()
            while True:
                ev = self._inbox.get()
                generation = self.generation
                # No cyclic collection while an event is handled, a recovery included: what a recovery
                # allocates (16K acks, directives, polls) made the collector run full collections of the
                # 16K-node heap, 0.2 s each, eight of them in one recovery (measured with gc.callbacks).
                # The master's garbage is freed by reference counting; cycles wait for the next collection.
                gc.disable()
                try:
                    self._dispatch(ev)
                finally:
                    if self.generation != generation:
                        gc.freeze()   # the new membership lives on (see _wait_for_start)
                    gc.enable()
        except Stop as s:
            self._finish(s.exit_code, s.reason)
        except Exception as e:  # a bug in the master must still end the job visibly
            log.exception("master controller crashed")
            self._finish(70, f"master error: {e}")

    def _wait_for_start(self) -> None:
        held: list[dict] = []     # reports a restarted master gets before it runs: handled once it does
        while True:
            try:
                ev = self._inbox.get(timeout=0.2)
                self._absorb(ev)
                resumed_fault = self.resumed_at is not None and ev.get("kind") != "joined"
                if resumed_fault or ev.get("interrupted"):
                    held.append(ev)
            except queue.Empty:
                pass
            with self.cv:
                if len(self.slots) == self.cfg.nnodes:
                    break
                if self.resumed_at is not None and time.time() > self.resumed_at + self.cfg.node_timeout:
                    break             # whoever has not rejoined by now is lost
        # The membership is complete: what exists now (a record per node, a connection per agent) lives as
        # long as the job. Out of the collector's sight: a full collection walked all of it, 0.3 s at 16K
        # nodes with the heartbeats stalled meanwhile, about once a second under 1 Hz heartbeats.
        gc.freeze()
        if self.resumed_at is not None:
            self._resume(held)
            return
        with self.cv:
            self.phase = Phase.RUNNING
            self.events.emit("job_started", self.generation, world_size=self.layout.world_size,
                             slots={s: n for s, n in self.slots.items()})
            resume = self._newest_checkpoint()
            if resume is None:
                self._direct_slots("run", restart_count=0, restore_step=None)
                return
        # a run directory with checkpoints: resume the job from the newest complete one
        if not self._fallback(set(), f"resuming from checkpoint step {resume}", counted=False):
            raise Stop(1, f"cannot resume from the checkpoints in {self.cfg.persist_dir}")

    def _resume(self, held: list[dict]) -> None:
        """Carry on a running job after a master restart. A slot nobody rejoined for lost its node
        while the master was down: it gets a stand-in record and the usual node-lost handling."""
        with self.cv:
            self.phase = Phase.RUNNING
            missing = [s for s in range(self.cfg.nnodes) if s not in self.slots]
            api = any(n.api for n in self.nodes.values())
            for s in missing:
                nid = f"lost-slot{s}"
                self.nodes[nid] = NodeRecord(node_id=nid, host="?", agent_pid=0, peer_addr=self._peer_hint.get(s, ""),
                                             fault_domain=nid, role=Role.ACTIVE, slot=s, api=api)
                if api:
                    self._api_nodes.add(nid)
                self.slots[s] = nid
            self.events.emit("master_recovered", self.generation, nodes=len(self.nodes) - len(missing),
                             missing_slots=missing, restart_count=self.restart_count)
        for s in missing:
            self._inbox.put({"kind": "node_lost", "node_id": f"lost-slot{s}", "t": time.time(),
                             "detail": "did not rejoin the restarted master"})
        for ev in held:
            if ev.get("interrupted"):   # it was mid-recovery when the master died: recover again
                ev = {"kind": "comm_error", "node_id": ev["node_id"], "t": time.time(),
                      "text": "recovery interrupted by a master restart"}
            self._inbox.put(ev)

    def _absorb(self, ev: dict) -> None:
        """Bookkeeping any event needs whatever the phase; faults are left to the caller."""
        kind = ev.get("kind")
        with self.cv:
            node = self.nodes.get(ev.get("node_id", ""))
            if kind == "node_lost" and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
                node.last_fault = "heartbeat lost"
                self.events.emit("spare_lost", self.generation, node=node.node_id)
            elif kind == "left" and node is not None and node.role == Role.SPARE:
                node.role = Role.FAILED
            elif kind == "protection_mode" and ev.get("every") != self.protect_every:
                self.protect_every = ev.get("every")
                self.events.emit("protection_mode", self.generation, every=self.protect_every, step=ev.get("step"),
                                 reason="replication does not hide behind compute" if self.protect_every > 1
                                 else "replication hides behind compute again")

    def _dispatch(self, ev: dict) -> None:
        self._absorb(ev)
        kind = ev.get("kind")
        with self.cv:
            node = self.nodes.get(ev.get("node_id", ""))
            active = node is not None and node.role == Role.ACTIVE and node.slot is not None
        if kind == "workers_done" and active and ev.get("generation") == self.generation:
            self.done_nodes.add(node.node_id)
            if all(nid in self.done_nodes for nid in self.slots.values()):
                raise Stop(0, "all workers finished")
            return
        if kind == "attempt_check":
            self._check_attempt(ev)
            return
        if not active or kind not in ROOT_CAUSES + ("comm_error",):
            return
        if not self._api_mode() and ev.get("generation", self.generation) < self.generation:
            return   # a worker of an attempt already restarted (reported after the restart's drain)
        incident = self._incident(ev)
        if incident is not None:
            node, ev, verdict, context = incident
            self._handle_fault(node, ev, verdict, context)

    def _signal_of(self, ev: dict, slot: int | None) -> Signal:
        kind = ev.get("kind")
        if kind == "node_lost":
            return Signal(kind="node_heartbeat_lost", node=slot, detail=ev.get("detail", ""), timestamp=ev["t"])
        if kind == "left":
            return Signal(kind="node_unreachable", node=slot, detail=ev.get("detail", ""), timestamp=ev["t"])
        if kind == "health":
            return Signal.from_dict({**ev["signal"], "node": slot})
        if kind == "nan_loss":
            return Signal(kind="nan_loss", node=slot, rank=ev.get("rank"), detail=ev.get("text", ""),
                          timestamp=ev["t"])
        if kind == "worker_error":
            return Signal(kind="user_exception", node=slot, rank=ev.get("rank"), detail=ev.get("text", ""),
                          timestamp=ev["t"])
        if kind == "worker_hang":
            return Signal(kind="worker_hang", node=slot, rank=ev.get("rank"), detail=ev.get("detail", ""),
                          timestamp=ev["t"])
        if kind == "worker_exit":
            return Signal(kind="worker_exit", node=slot, rank=ev.get("rank"), code=ev.get("returncode"),
                          detail=ev.get("text") or ev.get("detail", ""), timestamp=ev["t"])
        return Signal(kind="collective_error", node=slot, rank=ev.get("rank"), detail=ev.get("text", ""),
                      timestamp=ev["t"])

    def _incident(self, ev: dict) -> tuple[NodeRecord, dict, Classification, dict] | None:
        """Root cause vs symptom: gather the reports of one incident and let `faults.correlate` decide.

        A definite root cause (a killed worker, a lost node, an Xid...) is acted on at once, with whatever
        else is already queued. A collective error or an ambiguous report only says "something failed":
        the master probes every agent (a dead one refuses at once) and waits up to the correlation
        window for a root cause; if none comes, the reporters get a local reset (transient).
        """
        events = [ev]
        with self.cv:
            actives = [n for n in self.nodes.values() if n.role == Role.ACTIVE]
        definite = self._definite(ev)
        if not definite:
            for n in self._unreachable(actives):
                events.append({"kind": "node_lost", "node_id": n.node_id, "t": time.time(),
                               "detail": "agent unreachable"})
                definite = True
        deadline = time.time() + (0.0 if definite else self.cfg.correlation_window)
        unrelated = []
        while True:
            try:
                other = self._inbox.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            if other.get("kind") in ROOT_CAUSES + ("comm_error",):
                self._absorb(other)
                events.append(other)
                if self._definite(other):
                    deadline = time.time()   # drain what is queued, wait no longer
            else:
                unrelated.append(other)
        for other in unrelated:              # not part of the incident: handled in turn afterwards
            self._inbox.put(other)
        with self.cv:
            slot_of = {e["node_id"]: self.nodes[e["node_id"]].slot for e in events if e.get("node_id") in self.nodes}
            history = {s: list(h) for s, h in self.fault_history.items()}
        pairs = [(self._signal_of(e, slot_of[e["node_id"]]), e) for e in events
                 if slot_of.get(e["node_id"]) is not None]
        # fault_history holds one signal per incident handled (this window gathers an incident's reports), so
        # entries are never merged by time: merged, local resets 0.5 s apart never escalated (issue 20)
        corr = correlate([sig for sig, _ in pairs], history, max_local_resets=self.cfg.max_local_resets,
                         incident_gap_s=0.0)
        acted = sorted(corr.acted_on, key=lambda d: SEVERITY[d.action])
        if not acted:
            return None
        d = acted[0]
        ev = next(e for sig, e in pairs if sig is d.signal)
        verdict = self._escalated(d.classification, ev)
        with self.cv:
            node = self.nodes[ev["node_id"]]
            # recorded with the fault: how the window was decided and who reported what (nodes by id)
            ids = {self.nodes[e["node_id"]].slot: e["node_id"] for _, e in pairs}
        context = {"verdict": d.verdict.value,
                   "reporters": sorted({ids[x.node] for x in corr.decisions}),
                   "symptoms": sorted({ids[x.node] for x in corr.symptoms})}
        return node, ev, verdict, context

    def _escalated(self, c: Classification, ev: dict) -> Classification:
        """No loop: a fault acted on at the committed step of earlier attempts (no progress since) gets a
        stronger remedy, and past the last one the job stops (faults/escalate.py). Hot swap only: a
        torchrun-style job's restarts are bounded by --max-restarts."""
        with self.cv:
            if not self._api_mode():
                return c
            newest = self._newest_snapshots()
            step = committed_step(newest, self.layout.world_size, self.restored_step)
            e = escalate(c, step, self.attempts, Limits(local_resets=self.cfg.max_local_resets))
            self.attempts = [*self.attempts[-63:], Attempt(step, e.action or c.action)]
            if e.stop:
                self.events.emit("fault_detected", self.generation, node=ev.get("node_id"), signal=ev.get("kind"),
                                 rank=ev.get("rank"), detail=(ev.get("detail") or ev.get("text") or "")[:300],
                                 **{"class": c.fault_class.value}, action="stop", step=step, repeats=e.repeats)
        if e.stop:
            raise Stop(_exit_code(ev) or 1, e.reason)
        if e.action is c.action:
            return c
        return Classification(c.fault_class, e.action, c.root_cause, e.reason, c.ambiguous)

    def _newest_snapshots(self) -> dict[int, int]:
        """rank -> the newest step any active node holds a snapshot of it at (its own or a replica). Caller
        holds cv."""
        newest: dict[int, int] = {}
        for n in self.nodes.values():
            if n.role == Role.ACTIVE:
                for r, steps in n.snapshots.items():
                    if steps:
                        newest[r] = max(newest.get(r, steps[0]), max(steps))
        return newest

    def _definite(self, ev: dict) -> bool:
        with self.cv:
            node = self.nodes.get(ev.get("node_id", ""))
        if node is None or node.slot is None:
            return False
        c = classify(self._signal_of(ev, node.slot), max_local_resets=self.cfg.max_local_resets)
        return c.root_cause and not c.ambiguous

    def _handle_fault(self, node: NodeRecord, ev: dict, verdict: Classification, context: dict | None = None) -> None:
        with self.cv:
            self.fault_history.setdefault(node.slot, []).append(self._signal_of(ev, node.slot))
            node.last_fault = f"{verdict.fault_class.value}: {ev.get('detail') or ev.get('text', '')}"[:200]
            self.events.emit("fault_detected", self.generation, node=node.node_id, slot=node.slot,
                             signal=ev.get("kind"), rank=ev.get("rank"), returncode=ev.get("returncode"),
                             detail=(ev.get("detail") or ev.get("text") or "")[:300],
                             **{"class": verdict.fault_class.value}, action=verdict.action.value,
                             kind=verdict.fault_class.value, step=ev.get("step"), **(context or {}))
            api = self._api_mode()
        failing_code = _exit_code(ev)
        if not api:
            self._restart_plain(node, ev, verdict, failing_code)
            return
        if verdict.action == Action.EXTERNAL_FALLBACK:
            what = f"{verdict.reason}: {ev['text']}" if ev.get("kind") == "nan_loss" and ev.get("text") \
                else verdict.reason
            why = f"{what} (rank {ev.get('rank')} on slot {node.slot})"
            if api and self._fallback(set(), why):
                return
            raise Stop(failing_code or 1, why)
        lost = {node.slot} if verdict.action == Action.NODE_REPLACE else set()
        if lost and ev.get("kind") in ("health", "worker_hang", "worker_exit", "comm_error"):
            # the node is still up but must go: fence it (its agent kills its workers and exits)
            with self.cv:
                self._direct([node.node_id], command="stop", exit_code=0, reason=f"fenced: {verdict.reason}")
        self._hot_swap(lost, node, ev, verdict.action, failing_code)

    def _restart_plain(self, node: NodeRecord, ev: dict, verdict: Classification, failing_code: int | None) -> None:
        """A script without the API: torchrun's semantics, a full restart on any failure while --max-restarts
        allows. A worker's failure may be the symptom of a node loss not yet detected (a survivor's gloo
        error came 1.4 s before the lost node's heartbeat timeout): the agents are probed, and node losses
        reported within the correlation window are taken too, so the lost nodes' slots get spares in the
        same restart (one restart, not two)."""
        lost = {node.slot} if verdict.action == Action.NODE_REPLACE else set()
        if lost and ev.get("kind") in ("health", "worker_hang", "worker_exit", "comm_error"):
            with self.cv:   # the node is still up but must go: fence it (its agent kills its workers and exits)
                self._direct([node.node_id], command="stop", exit_code=0, reason=f"fenced: {verdict.reason}")
        time.sleep(self.cfg.correlation_window)
        losses = self._take_queued(lambda e: e.get("kind") in ("node_lost", "left"))
        with self.cv:
            actives = [n for n in self.nodes.values() if n.role == Role.ACTIVE and n.slot not in lost]
            reported = {e.get("node_id") for e in losses}
        gone = [n for n in actives if n.node_id in reported]
        # refusals only: a killed node's agent refuses at once, and on a loaded machine a live agent answering
        # late must not be taken for lost (with no spare that would end the job); silence is the heartbeats'
        gone += self._unreachable([n for n in actives if n.node_id not in reported], timeout=1.0,
                                  silent_is_dead=False)
        why = f"rank {ev.get('rank')} on slot {node.slot}: {ev.get('kind')} ({verdict.reason})"
        if gone:
            with self.cv:
                for n in gone:
                    lost.add(n.slot)
                    self.events.emit("fault_detected", self.generation, node=n.node_id, slot=n.slot, signal="node_lost",
                                     detail="node lost with the failure", action="node_replace",
                                     **{"class": "host_pcie"}, kind="host_pcie", symptom_of_loss=True)
            why = (f"node(s) in slot(s) {sorted(n.slot for n in gone)} lost (rank {ev.get('rank')}'s "
                   f"{ev.get('kind')} was its symptom)")
        for e in losses:   # losses of spares and of nodes already handled: the usual bookkeeping
            if e.get("node_id") not in {n.node_id for n in gone}:
                self._absorb(e)
        self._restart(lost, failing_code, why)

    def _finish(self, exit_code: int, reason: str) -> None:
        with self.cv:
            self.exit_code = exit_code
            self.reason = reason
            self.phase = Phase.FINISHED if exit_code == 0 else Phase.FAILED
            # what an external restart could resume from: the newest step every rank has committed, and the
            # newest any rank has (a non-finite step must never appear here)
            newest = self._newest_snapshots()
            complete = len(newest) == self.layout.world_size
            self.events.emit("job_finished", self.generation, exit_code=exit_code, reason=reason,
                             restarts=self.restart_count, recoveries=self.recoveries,
                             committed_step=min(newest.values()) if complete else None,
                             newest_snapshot=max(newest.values(), default=None))
            self._direct([n.node_id for n in self.nodes.values() if n.role != Role.FAILED], command="stop",
                         exit_code=exit_code, reason=reason)
        if exit_code:
            log.error("job failed (exit %d): %s", exit_code, reason)
        self._stopped.set()


def _exit_code(ev: dict) -> int | None:
    rc = ev.get("returncode")
    if rc is None:
        return None
    return 128 - rc if rc < 0 else rc


def _raise_fd_limit() -> None:
    """Soft open-files limit up to the hard one: a 16K-node job holds over 32K connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

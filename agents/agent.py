"""The per-node agent: supervises this node's workers, owns their snapshot memory, replicates
it to peer agents, and carries out the master's directives (run, quiesce, restore, restart, stop).

Threads: a directive long-poll, a heartbeat, the worker channel (one reader per worker), the
peer server; the main loop applies directives and watches worker processes. All state changes
happen under one lock.
"""
from __future__ import annotations

import logging
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from phoenixrun import netaddr
from phoenixrun.config import AgentConfig
from phoenixrun.protocol.client import ControlError
from phoenixrun.protocol.messages import valid_fault
from phoenixrun.faults import InjectedHealthSource, NvmlHealthSource, Signal, poll_all
from phoenixrun.slot_format import SlotHeader, crc_shared
from phoenixrun.testing import pause_point
from phoenixrun.agents.ipc import WorkerChannelServer, WorkerConn
from phoenixrun.agents.partition import GatedControlClient, GatedPeerClient, NetworkCut
from phoenixrun.agents.peer import PeerError, PeerServer
from phoenixrun.agents.persister import PersistConfig, PersistError, Persister
from phoenixrun.agents.slots import IntegrityError, LocalSlots, ReplicaStore, SlotError, SlotSpaceError, remove_orphans
from phoenixrun.agents.workers import Placement, Worker, WorkerSpec, worker_env

log = logging.getLogger("phoenixrun.agent")
# A live worker's agent-link thread answers a ping within milliseconds on an idle machine, but not on a loaded
# one: at load average 15-19 on 2 cores a fixed 1 s grace declared live workers hung again and again after a
# recovery (tests/test_fault_matrix.py, job exit 75). The grace is the hang timeout itself, at least this floor:
# a stopped process never answers, a starved one answers late.
PING_GRACE_MIN_S = 1.0
# A worker normally acknowledges a quiesce within milliseconds (its sockets are shut down under it). One whose
# training thread is waiting on a gloo op that was enqueued as its connections went down stays blocked until the
# collective timeout; past this grace it is killed and restarts from this node's snapshot (a local reset).
QUIESCE_GRACE_S = 5.0
# The directive long-poll: the master answers it at once when it has an order, else when this passes (it
# answers after 50-100% of it). Long, because each expiry is a re-poll, and an agent between two polls gets a
# broadcast only once its re-poll is read: at 16K agents, 10 s meant ~2,200 re-polls a second and a tail of
# late agents on every broadcast. A dead master connection fails the poll at once; a silent one at +5 s.
DIRECTIVE_POLL_S = 30.0
# The main loop's wake-up: directives wake it at once (a blocking queue get); the timeout paces the worker
# watch (exits, hangs, health). A spare whose workers are only warm has no rank to watch for hangs, so it
# wakes 4x less often (benchmarks/idle_spare.py, docs/benchmarks.md: the idle spare agent's CPU).
WATCH_INTERVAL_S = 0.05
IDLE_SPARE_WATCH_INTERVAL_S = 0.2


def watch_interval(role: str | None, warm_only: bool) -> float:
    """How long the agent's main loop waits for a directive before it looks at its workers again. Pure."""
    return IDLE_SPARE_WATCH_INTERVAL_S if role == "spare" and warm_only else WATCH_INTERVAL_S


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.cut = NetworkCut()            # partition drill: while active, this node's traffic is dropped
        self.client = GatedControlClient(cfg.endpoint, cfg.secret, self.cut)
        self.lock = threading.RLock()
        self.directives: queue.Queue[dict] = queue.Queue()
        self.outbox: queue.Queue[dict | None] = queue.Queue()   # reports, delivered in order, retried
        orphans = remove_orphans(socket.gethostname())
        if orphans:
            log.info("removed %d snapshot files left by dead agents on this host", len(orphans))
        self.slots = LocalSlots(prefix=f"phoenixrun-{self.node_id}")
        self.replicas = ReplicaStore()
        self.peers = GatedPeerClient(cfg.secret, self.cut)
        self.workers: dict[int, Worker] = {}
        self.conns: dict[int, WorkerConn] = {}
        self.waiting_hello: dict[int, WorkerConn] = {}
        self.done: set[int] = set()
        self.reported_exit: set[int] = set()
        self.api = False
        self.role = "unknown"
        self.slot: int | None = None
        self.generation = 0
        self.store_prefix: str | None = None   # the generation's rendezvous prefix, from the master's directives
        self.store_port: int | None = None     # a restart attempt's own TCPStore (None: the job's)
        self.restart_count = 0
        self.world: dict = {}
        self.job: dict = {}
        self.restore_step: int | None = None
        self.pending_quiesce: set[int] = set()
        self.quiesce_deadline = 0.0
        self.quiesced_next_step = 0          # furthest step any local worker had completed when quiesced
        self.pending_resume: set[int] = set()
        self.resume_timings: dict[str, float] = {}
        self.protection: dict[int, dict] = {}
        self.exit_code: int | None = None
        self.last_progress: dict[int, float] = {}
        self.pinged: dict[int, float] = {}
        self.error_text: dict[int, str] = {}     # a worker's own exception, sent before it exits
        self.persister: Persister | None = None
        self.injected = InjectedHealthSource()
        self.health = [self.injected, NvmlHealthSource()]
        self._next_health_poll = 0.0
        self._version = -1
        self.token: str | None = None      # from the master's reply to our registration: our later calls carry it
        self._stop = threading.Event()
        self._flush_deadline = float("inf")
        # gloo binds the workers' sockets to this node's address (left to itself, it resolves the hostname, which
        # /etc/hosts often maps to 127.0.0.1: cross-node connects then fail)
        self.gloo_ifname = netaddr.interface_for(cfg.host, netaddr.interfaces())

    # ------------------------------------------------------------------ startup
    def run(self) -> int:
        sock_dir = Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
        self.sock_path = str(sock_dir / f"phoenixrun-{self.node_id}.sock")
        self.channel = WorkerChannelServer(self.sock_path, self._on_worker_message, self._on_worker_close)
        self.peer_server = PeerServer(self.cfg.host, self.cfg.secret, {
            "put": self._peer_put, "get_private": self._peer_get_private,
            "get_shared": self._peer_get_shared, "ping": lambda h, p: ({}, b"")})
        try:
            reg = self._register()
        except ControlError as e:
            log.error("%s", e)
            self._cleanup()
            return 2
        if reg.get("role") == "failed":     # the job has no place for this node: the master says why
            print(f"phoenixrun agent: {reg.get('reason', 'refused by the master')}", file=sys.stderr, flush=True)
            self._cleanup()
            return int(reg.get("exit_code", 2))
        self.job = reg
        self.role, self.slot = reg["role"], reg["slot"]
        self.token = reg.get("token")
        persist_cfg = PersistConfig.from_json(reg.get("persist"))
        if persist_cfg is not None:
            self.persister = Persister(persist_cfg, self.slots.copy_snapshot, prefix=f"phoenixrun-{self.node_id}",
                                       backlog=2 * self.cfg.nproc_per_node)
        log.info("agent %s registered as %s%s", self.node_id, self.role,
                 f" (slot {self.slot})" if self.slot is not None else "")
        for target in (self._poll_directives, self._heartbeat):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        self._sender = threading.Thread(target=self._send_reports, daemon=True, name="reports")
        self._sender.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGUSR1, lambda signum, frame: self._heal())   # ends a partition drill by hand
        try:
            while not self._stop.is_set():
                try:
                    d = self.directives.get(timeout=watch_interval(self.role, self._warm_workers()))
                    self._apply(d)
                except queue.Empty:
                    pass
                self._watch_workers()
        finally:
            self._cleanup()
        return self.exit_code or 0

    def _register(self, rejoin: dict | None = None) -> dict:
        deadline = time.time() + 60
        payload = {"node_id": self.node_id, "host": self.cfg.host, "agent_pid": os.getpid(),
                   "peer_addr": self.peer_server.addr, "fault_domain": self.cfg.fault_domain,
                   "nproc_per_node": self.cfg.nproc_per_node, "rejoin": rejoin}
        if self.cfg.node_rank is not None and rejoin is None:
            payload["node_rank"] = self.cfg.node_rank
        while True:
            try:
                return self.client.post("/v1/register", payload)
            except ControlError as e:
                if e.refused or time.time() > deadline:   # refused (4xx): asking again gets the same answer
                    raise
                time.sleep(0.2)

    def _rejoin(self) -> None:
        """The master restarted and does not know us: tell it what we are, so it can rebuild the job's
        state from the agents (membership, slots, generation, snapshots)."""
        with self.lock:
            state = {"role": self.role, "slot": self.slot, "generation": self.generation,
                     "restart_count": self.restart_count, "api": self.api, "world": self.world,
                     "frozen": self.slots.frozen,
                     "snapshots": self.slots.available(), "replicas": self.replicas.available()}
        try:
            reply = self._register(rejoin=state)
        except ControlError as e:
            log.warning("rejoin failed: %s", e)
            return
        if reply.get("role") == "failed":
            log.error("the master fenced this node on rejoin: %s", reply.get("reason", "replaced"))
            self.exit_code = 0
            self._stop.set()
            return
        self.token = reply.get("token")
        log.warning("rejoined a restarted master as %s%s", reply["role"],
                    f" (slot {reply['slot']})" if reply.get("slot") is not None else "")

    def _on_signal(self, signum, frame) -> None:
        log.warning("agent got signal %d: stopping workers", signum)
        self.exit_code = 128 + signum
        self._report({"kind": "left", "detail": f"agent got signal {signum}"})
        self._stop.set()

    def _cleanup(self) -> None:
        for w in list(self.workers.values()):
            w.kill_tree(grace=self.cfg.shutdown_timeout)
        self._flush_deadline = time.time() + 1.0     # last reports (why we left) get a moment to go out
        self.outbox.put(None)
        if getattr(self, "_sender", None) is not None:
            self._sender.join(timeout=1.5)
        if self.persister is not None:
            if self.exit_code == 128 + signal.SIGTERM and self.role == "active":
                # preemption: what is committed goes to disk before the memory does
                self.persister.write_now([(r, s) for r, steps in self.slots.available().items() for s in steps])
            elif self.exit_code == 0:
                self.persister.drain(timeout=30)    # a finished job keeps its last checkpoints
            self.persister.close()
        self.slots.clear()
        self.channel.close()
        self.peer_server.close()

    # ------------------------------------------------------------------ master link
    def _poll_directives(self) -> None:
        while not self._stop.is_set():
            try:
                d = self.client.post("/v1/directive", {"node_id": self.node_id, "token": self.token,
                                                       "version": self._version, "timeout": DIRECTIVE_POLL_S},
                                     timeout=DIRECTIVE_POLL_S + 5)
            except ControlError as e:
                log.debug("directive poll failed: %s", e)
                time.sleep(0.2)
                continue
            if isinstance(d.get("version"), int) and d["version"] > self._version and isinstance(d.get("command"), str):
                self._version = d["version"]
                self.directives.put(d)

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                payload = {"node_id": self.node_id, "token": self.token,
                           "worker_pids": [w.pid for w in self.workers.values() if w.poll() is None],
                           "snapshots": self.slots.available(), "replicas": self.replicas.available(),
                           "protection": self.protection, "api": self.api}
                if self.role == "spare":
                    payload["warm_ready"] = self.warm_ready()
            try:
                reply = self.client.post("/v1/heartbeat", payload, timeout=max(2.0, self.cfg.heartbeat_interval * 4))
                if reply.get("fenced"):    # replaced while it was away: never rejoin
                    self._fenced(reply)
                    return
                if reply.get("error"):       # an unknown node: a restarted master, it learns the job from us
                    self._rejoin()
                for fault in reply.get("inject", []) if isinstance(reply.get("inject"), list) else ():
                    self._inject(fault)
            except ControlError as e:
                # the master may be restarting: keep going (training does not need it), keep trying
                (log.warning if e.refused else log.debug)("heartbeat failed: %s", e)
            # jittered: agents that got their replies together (after a master stall, say) must not keep
            # heartbeating in step, which would load the master in bursts
            self._stop.wait(self.cfg.heartbeat_interval * random.uniform(0.9, 1.1))

    def _report(self, ev: dict) -> None:
        """Queue a report for the master; delivered in order, retried until it gets through."""
        self.outbox.put({"node_id": self.node_id, "generation": self.generation, "slot": self.slot,
                         "t": time.time(), **ev})

    def _report_payload(self, ev: dict) -> dict:
        return {**ev, "token": self.token}     # the current token: a rejoin since it was queued changes it

    def _send_reports(self) -> None:
        while True:
            ev = self.outbox.get()
            if ev is None:
                return
            delay = 0.1
            while True:
                try:
                    reply = self.client.post("/v1/report", self._report_payload(ev))
                    if reply.get("fenced"):      # replaced while it was away: never rejoin
                        self._fenced(reply)
                        break
                    if not reply.get("error"):
                        break
                except ControlError as e:    # master down or restarting: a fault seen now is handled later
                    if e.refused:            # the report itself was refused: sending it again will not help
                        log.warning("report %s refused by the master: %s", ev.get("kind"), e)
                        break
                    log.debug("report %s not delivered yet: %s", ev.get("kind"), e)
                if self._stop.is_set() and time.time() > self._flush_deadline:
                    log.warning("report %s not delivered: the master is unreachable", ev.get("kind"))
                    break
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _fenced(self, reply: dict) -> None:
        """The master says this node was replaced: it must never rejoin. Kill the workers and exit."""
        log.error("%s; killing this node's workers and exiting", reply.get("reason", "fenced by the master"))
        self.exit_code = reply.get("exit_code", 0)
        self._stop.set()

    # ------------------------------------------------------------------ directives
    def _apply(self, d: dict) -> None:
        cmd = d["command"]
        if cmd == "noop":
            return
        log.debug("directive %s gen %s", cmd, d.get("generation"))
        with self.lock:
            self.generation = d.get("generation", self.generation)
            self.store_prefix = d.get("store_prefix", self.store_prefix)
            if "slot" in d:
                self.slot = d["slot"]
            if "world" in d:
                self.world = d["world"]
            self.restart_count = d.get("restart_count", self.restart_count)
        if (cmd == "run" or (cmd == "restart" and d.get("restore_step") is None)) and self.persister is not None:
            # before workers start (not under the lock: heartbeats go on): the first checkpoints
            # must not be skipped because the I/O process is still importing. (A restart from a checkpoint
            # needs the process to read it anyway: it waits for it there, with its workers starting meanwhile.)
            self.persister.ready.wait(timeout=60)
        if cmd == "wait":
            if d.get("warm") and not self.workers:
                self._spawn_all(rank_known=False)
        elif cmd == "run":
            with self.lock:
                self.role = "active"
                self.slots.frozen = self.replicas.frozen = False
                if not d.get("resume"):
                    self.restore_step = None
                    self._kill_all()   # a spare's warm workers carry no rank: start real ones
                    self._spawn_all(rank_known=True)
        elif cmd == "restart" and d.get("restore_step") is not None and (self.api or self._warm_workers()):
            self._restart_from_disk(d["restore_step"])
        elif cmd == "restart":
            with self.lock:
                self.role = "active"
                self.store_port = d.get("store_port", self.store_port)
                self._kill_all()
                self.slots.clear()
            step = d.get("restore_step")
            if step is not None and not self._stage_from_disk(step):
                return
            with self.lock:
                self.restore_step = step
                self.slots.frozen = self.replicas.frozen = False
                if step is not None:
                    self.replicas.restore_point(step)
                    self.pending_resume = set(range(self.cfg.nproc_per_node))
                    self.resume_timings = {}
                self._spawn_all(rank_known=True)
        elif cmd == "quiesce":
            self._quiesce()
        elif cmd == "restore":
            threading.Thread(target=self._restore, args=(d,), daemon=True, name="restore").start()
        elif cmd == "stop":
            if d.get("fenced"):
                self._fenced(d)
            else:
                self.exit_code = d.get("exit_code", 0)
                self._stop.set()

    def _warm_workers(self) -> bool:
        """Pre-started workers with no rank yet (a warm spare's) are all alive."""
        with self.lock:
            return bool(self.workers) and all(w.rank is None and w.poll() is None for w in self.workers.values())

    def _restart_from_disk(self, step: int) -> None:
        """Fallback restart of a node whose workers use the phoenixrun API, without starting processes where it
        can: live workers are quiesced and rebuilt from the staged checkpoint (a local reset from disk); a warm
        spare's workers get their rank once it is staged; only dead ones are spawned, while it is read. Done
        one after the other - I/O process ready, read, then kill, spawn and import torch - a restart took over
        13 s on a loaded 2-core machine, and under a kill every 8-15 s no fallback finished."""
        with self.lock:
            self.role = "active"
            live = {lr for lr, w in self.workers.items()
                    if w.rank is not None and w.poll() is None and lr in self.conns}
            if not live and not self._warm_workers():
                self._kill_all()
                self.slots.clear()
                self._spawn_all(rank_known=False)     # they import torch and wait for their assignment
            self.restore_step = None
            if live:
                self.slots.frozen = self.replicas.frozen = True
                self.pending_quiesce = set(live)
                for lr in live:
                    self.conns[lr].send({"op": "quiesce", "generation": self.generation})
        if live:
            self._await_quiesced(live)
        if not self._stage_from_disk(step):
            return
        with self.lock:
            self.restore_step = step
            self.slots.frozen = self.replicas.frozen = False
            self.replicas.restore_point(step)
            self.pending_resume = set(range(self.cfg.nproc_per_node))
            self.resume_timings = {}
            self.last_progress.clear()
            self._resume_workers(step)

    def _resume_workers(self, step: int) -> None:
        """Every local rank carries on from `step`, whose snapshot is in its slot (call with the lock held): a
        dead worker is respawned (it restores from the slot as it starts), a warm spare's worker gets its
        assignment (now, or with its hello), a live one rebuilds its groups in place."""
        for lr in range(self.cfg.nproc_per_node):
            w = self.workers.get(lr)
            if w is None or w.poll() is not None:
                self._spawn(lr, rank_known=True)
            elif w.rank is None:
                w.rank = self._rank(lr)
                conn = self.waiting_hello.pop(lr, None)
                if conn is not None:
                    self.conns[lr] = conn
                    conn.send(self._assignment(lr))
            elif lr in self.conns:
                self.conns[lr].send({"op": "rebuild", "generation": self.generation, "restore_step": step,
                                     "store_prefix": self.store_prefix})

    def _await_quiesced(self, live: set[int]) -> None:
        """Wait until the live workers stopped touching their slots (the checkpoint is staged into them); one
        that does not answer within QUIESCE_GRACE_S (blocked in a collective) is killed and respawned."""
        deadline = time.time() + QUIESCE_GRACE_S
        while time.time() < deadline:
            with self.lock:
                if not (self.pending_quiesce - {-1}):
                    return
            time.sleep(0.01)
        with self.lock:
            for lr in sorted(self.pending_quiesce - {-1}):
                w = self.workers.get(lr)
                self.reported_exit.add(lr)      # our doing, not a fault to report
                self.conns.pop(lr, None)
                if w is not None:
                    w.kill_tree(grace=0.1)
            self.pending_quiesce.clear()

    def warm_ready(self) -> bool:
        """A spare whose pre-started workers have all connected (torch imported) and whose checkpoint I/O process
        is up: promoting it costs no start-up. The master prefers such spares (a spare promoted before its workers
        were up made every 3-8 s recovery of a soak; one whose I/O process was still importing made its fallback
        restart wait for it)."""
        if self.persister is not None and not self.persister.ready.is_set():
            return False
        with self.lock:
            return self._warm_workers() and len(self.waiting_hello) == self.cfg.nproc_per_node
    def _store_port(self) -> int:
        return self.store_port or self.job["store_port"]

    def _rank(self, local_rank: int) -> int:
        return self.slot * self.cfg.nproc_per_node + local_rank

    def _placement(self, local_rank: int, rank_known: bool) -> Placement:
        return Placement(
            local_rank=local_rank, nproc_per_node=self.cfg.nproc_per_node, nnodes=self.job["nnodes"],
            slot=self.slot if rank_known else None, rank=self._rank(local_rank) if rank_known else None,
            master_addr=self.cfg.endpoint.rsplit(":", 1)[0], master_port=self._store_port(),
            run_id=self.job["run_id"], restart_count=self.restart_count, max_restarts=self.job["max_restarts"],
            generation=self.generation, agent_sock=self.sock_path, gloo_ifname=self.gloo_ifname,
            error_file=str(Path(self.cfg.log_dir or "/tmp") / f"error-{self.node_id}-{local_rank}.json"))

    def _spawn(self, local_rank: int, rank_known: bool) -> None:
        p = self._placement(local_rank, rank_known)
        env = worker_env(dict(os.environ), p)
        env["PHOENIXRUN_TP"], env["PHOENIXRUN_PP"] = str(self.job["tp"]), str(self.job["pp"])
        show = self.cfg.local_ranks_filter is None or local_rank in self.cfg.local_ranks_filter
        self.workers[local_rank] = Worker(self.cfg.spec, p, env, sys.stdout, self.cfg.log_dir, self.cfg.tee, show=show,
                                          err=sys.stderr)
        self.done.discard(local_rank)
        self.reported_exit.discard(local_rank)

    def _spawn_all(self, rank_known: bool) -> None:
        with self.lock:
            for lr in range(self.cfg.nproc_per_node):
                self._spawn(lr, rank_known)

    def _kill_all(self) -> None:
        for w in list(self.workers.values()):
            w.kill_tree(grace=self.cfg.shutdown_timeout)
        self.workers.clear()
        self.conns.clear()
        self.waiting_hello.clear()

    def _assignment(self, local_rank: int) -> dict:
        return {"op": "assign", "rank": self._rank(local_rank), "local_rank": local_rank,
                "slot": self.slot, "nnodes": self.job["nnodes"], "nproc_per_node": self.cfg.nproc_per_node,
                "world_size": self.job["nnodes"] * self.cfg.nproc_per_node, "generation": self.generation,
                "store_prefix": self.store_prefix,
                "restart_count": self.restart_count, "restore_step": self.restore_step,
                "master_addr": self.cfg.endpoint.rsplit(":", 1)[0], "master_port": self._store_port(),
                "tp": self.job["tp"], "pp": self.job["pp"], "run_id": self.job["run_id"]}

    def _quiesce(self) -> None:
        with self.lock:
            self.slots.frozen = self.replicas.frozen = True
            live = {lr for lr, w in self.workers.items() if w.poll() is None and lr in self.conns}
            self.pending_quiesce = set(live)
            self.quiesce_deadline = time.time() + QUIESCE_GRACE_S
            self.quiesced_next_step = 0
            g = self.generation
            for lr in live:
                self.conns[lr].send({"op": "quiesce", "generation": g})
        self._maybe_quiesced()

    def _maybe_quiesced(self) -> None:
        with self.lock:
            if self.pending_quiesce or not self.slots.frozen:
                return
            self.pending_quiesce = {-1}  # report once
            ev = {"kind": "quiesced", "snapshots": self.slots.available(), "replicas": self.replicas.available(),
                  "next_step": self.quiesced_next_step}
        self._report(ev)

    def _restore(self, d: dict) -> None:
        t0 = time.time()
        step = d["restore_step"]
        timings: dict[str, float] = {}
        try:
            pause_point("restore", step)     # tests: a worker that dies while the others rebuild
            if d.get("fetch"):
                pause_point("fetch", step)   # tests: a spare that dies while restoring
            for rank, src in d.get("fetch", {}).items():
                rank = int(rank)
                _, private = self.peers.call(src["private_addr"], {"op": "get_private", "rank": rank, "step": step})
                t1 = time.time()
                _, shared = self.peers.call(src["shared_addr"], {"op": "get_shared", "rank": src["shared_rank"],
                                                                "step": step})
                timings["params_fetch_s"] = round(time.time() - t1, 4)
                self.slots.forget(rank)   # fetched whole: a copy from an earlier attempt may be laid out smaller
                self.slots.install(rank, bytes(private), bytes(shared), step)
            if d.get("fetch"):
                timings["fetch_s"] = round(time.time() - t0, 4)
            with self.lock:
                self.role = "active"
                self.restore_step = step
                for lr in range(self.cfg.nproc_per_node):
                    self.slots.restore_point(self._rank(lr), step)
                self.replicas.restore_point(step)
                if self.persister is not None:
                    self.persister.reset(step)
                self.pending_resume = set(range(self.cfg.nproc_per_node))
                self.last_progress.clear()
                self.resume_timings = timings
                self._resume_workers(step)
        except (PeerError, SlotError, OSError) as e:
            log.error("restore failed: %s", e)
            # integrity: the fetched state is not this rank's; retrying the same plan cannot help
            self._report({"kind": "restore_failed", "reason": str(e), "integrity": isinstance(e, IntegrityError)})

    def _stage_from_disk(self, step: int) -> bool:
        """Fallback restart: load this node's ranks of persistent checkpoint `step` into their slots."""
        t0 = time.time()
        try:
            if self.persister is None:
                raise PersistError("this job writes no persistent checkpoints")
            self.persister.reset(step)     # queued writes of the abandoned timeline do not go before the read
            for lr in range(self.cfg.nproc_per_node):
                self.slots.install_image(self._rank(lr), self.persister.read(step, self._rank(lr)))
        except (PersistError, SlotError, OSError) as e:
            log.error("cannot restore checkpoint step %d: %s", step, e)
            self._report({"kind": "restore_failed", "reason": str(e), "persist_step": step})
            return False
        self.persister.reset(step)
        log.info("staged checkpoint step %d from %s in %.2fs", step, self.persister.cfg.dir, time.time() - t0)
        return True

    def _inject(self, fault: str) -> None:
        """`phoenixrun inject`: real effects where this machine allows, the injected source for hardware.
        Never raises: it runs on the heartbeat thread, and a bad fault spec must not stop the heartbeats
        (a master that did not check it once got a healthy node replaced that way)."""
        if not valid_fault(fault):
            log.error("cannot inject %r: not a fault spec (see phoenixrun inject --help)", fault)
            return
        try:
            self._inject_checked(fault)
        except Exception:
            log.exception("injecting %r failed", fault)

    def _inject_checked(self, fault: str) -> None:
        log.warning("injecting fault %r", fault)
        with self.lock:
            workers = [w for w in self.workers.values() if w.poll() is None]
            conns = [self.conns[lr] for lr in sorted(self.conns) if self.workers.get(lr) in workers]
        if fault == "comm-timeout" and conns:
            conns[0].send({"op": "abort_comm"})     # its collectives fail for real; the node stays healthy
        elif fault == "nan" and conns:
            conns[0].send({"op": "poison_loss"})    # its next job.observe_loss() sees NaN
        elif fault == "partition" or fault.startswith("partition:"):
            self._partition(float(fault.partition(":")[2] or 0) or None, conns)
        elif fault == "crash-worker" and workers:
            os.kill(workers[0].pid, signal.SIGKILL)
        elif fault == "hang" and workers:
            os.kill(workers[0].pid, signal.SIGSTOP)
        elif fault == "kill-node":
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.startswith("xid:"):
            self.injected.inject(Signal(kind="xid", code=int(fault[4:]), node=self.slot, detail="injected"))
        elif fault == "ecc":
            self.injected.inject(Signal(kind="ecc_uncorrectable", node=self.slot, detail="injected"))
        else:
            log.error("cannot inject %r here", fault)

    def _partition(self, seconds: float | None, conns: list[WorkerConn]) -> None:
        """Drop this node's traffic (agents/partition.py); it comes back after `seconds` (None: never)."""
        log.warning("partition drill: dropping this node's traffic%s",
                    f" for {seconds:g}s" if seconds else f" until kill -USR1 {os.getpid()}")
        self.cut.start()
        self.peer_server.suspend()
        self.peers.drop_all()
        for conn in conns:                         # the node-local channel still works
            conn.send({"op": "abort_comm"})
        if seconds:
            t = threading.Timer(seconds, self._heal)
            t.daemon = True
            t.start()

    def _heal(self) -> None:
        if self._stop.is_set() or not self.cut.active:
            return
        try:
            self.peer_server.resume()
        except OSError as e:                       # the port was taken meanwhile: peers cannot reach us
            log.warning("partition healed but the peer server cannot listen again: %s", e)
        self.cut.heal()
        log.warning("partition drill over: this node's traffic flows again")

    def _poll_health(self) -> None:
        if time.time() < self._next_health_poll:
            return
        self._next_health_poll = time.time() + 0.2
        for sig in poll_all(self.health):
            self._report({"kind": "health", "signal": sig.to_dict(), "detail": sig.detail, "t": time.time()})

    # ------------------------------------------------------------------ workers
    def _watch_workers(self) -> None:
        self._poll_health()
        now = time.time()
        with self.lock:
            if self.slots.frozen and self.pending_quiesce and -1 not in self.pending_quiesce \
                    and now > self.quiesce_deadline:
                for lr in sorted(self.pending_quiesce):
                    w = self.workers.get(lr)
                    log.warning("rank %s did not quiesce within %.0fs (blocked in a collective): killing it; it "
                                "restarts from this node's snapshot", w.rank if w else lr, QUIESCE_GRACE_S)
                    self.reported_exit.add(lr)      # our doing, not a fault to report
                    self.conns.pop(lr, None)
                    if w is not None:
                        w.kill_tree(grace=0.1)
                self.pending_quiesce.clear()
            if not self.slots.frozen:   # waiting is legitimate during a recovery
                for lr, w in list(self.workers.items()):
                    last, conn = self.last_progress.get(lr), self.conns.get(lr)
                    if w.rank is None or w.poll() is not None or last is None or conn is None:
                        continue
                    if now - last <= self.cfg.hang_timeout:
                        continue
                    # No progress: blocked in a collective on someone else's hang, or hung itself?
                    # Its agent-link thread answers a ping unless the whole process is stuck.
                    pinged = self.pinged.get(lr)
                    if pinged is None:
                        self.pinged[lr] = now
                        conn.send({"op": "ping"})
                    elif now - pinged > max(PING_GRACE_MIN_S, self.cfg.hang_timeout):
                        detail = f"rank {w.rank} made no progress for {now - last:.1f}s and does not answer"
                        log.warning("%s: killing it", detail)
                        self.reported_exit.add(lr)      # reported as a hang, not as the exit we cause
                        self.last_progress.pop(lr, None)
                        self.pinged.pop(lr, None)
                        w.kill_tree(grace=0.1)
                        threading.Thread(target=self._report, args=({"kind": "worker_hang", "rank": w.rank,
                                                                    "detail": detail, "t": now},), daemon=True).start()
        with self.lock:
            for lr, w in list(self.workers.items()):
                rc = w.poll()
                if rc is None or lr in self.reported_exit:
                    continue
                self.reported_exit.add(lr)
                self.conns.pop(lr, None)
                self.pending_quiesce.discard(lr)
                if w.rank is None:
                    log.warning("warm spare worker %d exited with %s", lr, rc)
                    continue
                if rc == 0:
                    self.done.add(lr)
                    if self.done >= set(range(self.cfg.nproc_per_node)):
                        threading.Thread(target=self._report, args=({"kind": "workers_done"},), daemon=True).start()
                    continue
                detail = f"rank {w.rank} exited with {'signal ' + str(-rc) if rc < 0 else 'code ' + str(rc)}"
                log.warning("%s", detail)
                threading.Thread(target=self._report, args=({"kind": "worker_exit", "rank": w.rank,
                                                            "returncode": rc, "detail": detail,
                                                            "text": self.error_text.pop(lr, ""),
                                                            "t": time.time()},), daemon=True).start()
        self._maybe_quiesced()

    def _on_worker_close(self, conn: WorkerConn) -> None:
        """A worker closed its link: it crashed (its exit is what counts: _watch_workers sees it) or it left
        the protected loop and is exiting. Either way the hang watchdog stops watching it: a worker past its
        last step still writes its results and tears down its groups, seconds on a loaded machine, and
        pinging its closed link took it for hung (fault-matrix runs killed every rank at the final step)."""
        lr = conn.local_rank
        if lr is None:
            return
        with self.lock:
            if self.conns.get(lr) is conn:   # (the conn stays: a quiesce still counts a live one that never acks)
                self.last_progress.pop(lr, None)
                self.pinged.pop(lr, None)

    def _on_worker_message(self, conn: WorkerConn, msg: dict) -> None:
        op = msg.get("op")
        if conn.local_rank is not None and op in ("progress", "write", "written", "resumed", "pong"):
            self.last_progress[conn.local_rank] = time.time()    # a pong: alive, just waiting on a peer
            self.pinged.pop(conn.local_rank, None)
        if op == "hello":
            lr = int(msg["local_rank"])
            with self.lock:
                conn.local_rank, conn.pid = lr, msg.get("pid")
                self.api = self.api or bool(msg.get("api"))
                w = self.workers.get(lr)
                if w is not None and w.rank is None:
                    self.waiting_hello[lr] = conn   # warm spare: its assignment comes with a restore
                else:
                    self.conns[lr] = conn
                    conn.send(self._assignment(lr))
        elif op in ("alloc", "slots", "write"):   # requests: answered with a reply carrying their id
            rank = self._rank(conn.local_rank)
            try:
                if op == "alloc":
                    reply = {"paths": self.slots.allocate(rank, int(msg["nbytes"]))}
                elif op == "slots":
                    reply = {"paths": self.slots.paths(rank)}
                else:   # the slot to write, grown first if the snapshot needs more (then at a new path)
                    idx = self.slots.begin_write(rank, int(msg.get("nbytes", 0)))
                    path, size = self.slots.path(rank, idx)
                    reply = {"slot": idx, "path": path, "nbytes": size}
            except SlotSpaceError as e:
                # not transient: the snapshot cannot grow on this host. A fault of its own (classified as
                # snapshot_space), so that it is not mistaken for the comm error the worker reports next
                reply = {"error": str(e)}
                self._report({"kind": "health", "rank": rank, "detail": str(e), "t": time.time(), "signal": Signal(
                    kind="snapshot_space", node=self.slot, rank=rank, detail=str(e)).to_dict()})
            except SlotError as e:
                reply = {"error": str(e)}
            conn.send({"op": "reply", "id": msg["id"], **reply})
        elif op == "written":
            self._commit(conn, int(msg["slot"]), int(msg["step"]), msg.get("stats", {}))
        elif op == "quiesced":
            with self.lock:
                self.pending_quiesce.discard(conn.local_rank)
                self.quiesced_next_step = max(self.quiesced_next_step, int(msg.get("next_step", 0)))
            self._maybe_quiesced()
        elif op == "resumed":
            with self.lock:
                self.pending_resume.discard(conn.local_rank)
                for k, v in msg.get("timings", {}).items():
                    self.resume_timings[k] = max(v, self.resume_timings.get(k, 0.0))
                done = not self.pending_resume
                self.pending_resume = self.pending_resume if not done else {-1}
                timings = dict(self.resume_timings)
            if done:
                self._report({"kind": "resumed", "timings": timings})
        elif op == "comm_error":
            self._report({"kind": "comm_error", "rank": self._rank(conn.local_rank), "text": msg.get("text", ""),
                          "step": msg.get("step"), "t": time.time()})
        elif op in ("progress", "pong"):
            pass
        elif op == "nan_loss":   # the script handed a non-finite loss to job.observe_loss()
            self.error_text[conn.local_rank] = msg.get("text", "")
            self._report({"kind": "nan_loss", "rank": self._rank(conn.local_rank), "text": msg.get("text", ""),
                          "step": msg.get("step"), "t": time.time()})
        elif op == "error":   # the script's own exception, before the worker exits: report it now
            self.error_text[conn.local_rank] = msg.get("text", "")
            self._report({"kind": "worker_error", "rank": self._rank(conn.local_rank), "text": msg.get("text", ""),
                          "step": msg.get("step"), "t": time.time()})
        elif op == "protection_mode":
            self._report({"kind": "protection_mode", "rank": self._rank(conn.local_rank), "every": msg.get("every"),
                          "step": msg.get("step")})
        elif op == "stats":
            with self.lock:
                self.protection[self._rank(conn.local_rank)] = msg.get("stats", {})

    def _commit(self, conn: WorkerConn, idx: int, step: int, stats: dict) -> None:
        """Seal the local slot, replicate its private part to the holders, then commit."""
        rank = self._rank(conn.local_rank)
        t0 = time.time()
        try:
            h = self.slots.finish_write(rank, idx, step)
            holders = self.world.get("placement", {}).get(str(rank), self.world.get("placement", {}).get(rank, []))
            if holders:
                data = memoryview(self.slots.view(rank, idx))[:h.replicated_len]   # no copy: sent from shm
                for holder in holders:
                    addr = self.world["slots"].get(str(holder), self.world["slots"].get(holder))
                    self.peers.call(addr, {"op": "put", "rank": rank, "step": step}, data)
            self.slots.commit(rank, idx, step)
        except (PeerError, SlotError) as e:
            conn.send({"op": "commit_failed", "step": step, "error": str(e)})
            if not self.slots.frozen:
                self._report({"kind": "comm_error", "rank": rank, "text": f"replication failed: {e}",
                              "step": step, "t": time.time()})
            return
        h2h = time.time() - t0
        conn.send({"op": "committed", "step": step, "h2h_s": round(h2h, 6),
                   "replicated_bytes": h.replicated_len if holders else 0})
        if self.persister is not None:
            self.persister.offer(rank, step)
        with self.lock:
            self.protection[rank] = {**stats, "committed_step": step, "h2h_s": round(h2h, 5),
                                     "replicated_bytes": h.replicated_len if holders else 0,
                                     "replica_store_bytes": self.replicas.nbytes()}

    # ------------------------------------------------------------------ peer requests
    def _peer_put(self, h: dict, payload: bytearray) -> tuple[dict, bytes]:
        self.replicas.put(int(h["rank"]), int(h["step"]), payload)
        return {}, b""

    def _peer_get_private(self, h: dict, payload: bytearray) -> tuple[dict, bytes]:
        return {}, self.replicas.get(int(h["rank"]), int(h["step"]))

    def _peer_get_shared(self, h: dict, payload: bytearray) -> tuple[dict, bytes]:
        rank, step = int(h["rank"]), int(h["step"])
        idx = self.slots.slot_of(rank, step)
        if idx is None:
            raise SlotError(f"no local snapshot of rank {rank} at step {step}")
        mm = self.slots.view(rank, idx)
        hdr = SlotHeader.unpack(mm)
        data = bytes(mm[hdr.shared_off:hdr.shared_off + hdr.shared_len])
        if crc_shared(mm, hdr) != hdr.crc_shared:
            raise SlotError(f"local snapshot of rank {rank} step {step} fails its checksum")
        return {}, data

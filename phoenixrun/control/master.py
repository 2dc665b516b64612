"""The rendezvous master: membership, spare pool, generations, fault handling, event log, status API.

Agents talk to it over authenticated JSON/HTTP: register, heartbeat, report (faults and phase
acknowledgements) and a long-polled `directive` that tells each agent what to do now. The master also hosts
the TCPStore the workers' process groups rendezvous on (one key prefix per generation).

`Master` only wires the parts together and runs them:
- control/jobstate.py  JobState: the data (members, the job's course, telemetry) and its lock;
- control/handlers.py  Handlers: the API, wire -> state (transport threads);
- control/orders.py    Orders and Inbox: directives out, reports in;
- control/monitor.py   HeartbeatMonitor: nodes gone silent -> the inbox;
- control/coordinator.py Coordinator: the controller thread, one incident at a time, carrying out
  the pure decisions of control/decide.py and faults/ through control/recovery.py's procedures.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

from phoenixrun.config import MasterConfig
from phoenixrun.control import layout_file
from phoenixrun.control.coordinator import Coordinator
from phoenixrun.control.directives import Ask, Directive, DirectiveBoard
from phoenixrun.control.events import EventLog
from phoenixrun.control.fan_in import FanIn
from phoenixrun.control.handlers import Handlers
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.lease import Lease, LeaseDir, master_id
from phoenixrun.control.monitor import HeartbeatMonitor
from phoenixrun.control.orders import Inbox, Orders
from phoenixrun.control.probe import unreachable
from phoenixrun.control.recovery import Acks, Recoveries
from phoenixrun.control.relaying import RelayDesk, expand
from phoenixrun.control.rejections import Rejections
from phoenixrun.control.roster import Roster
from phoenixrun.control.server import ControlServer
from phoenixrun.control.standby import Acquired, LeaseKeeper, await_lease
from phoenixrun.control.state import NodeRecord, Phase, Role
from phoenixrun.control.watch_desk import WatchDesk
from phoenixrun.protocol import messages
from phoenixrun.protocol.replies import Heard, TurnedAway
from phoenixrun.protocol.suspect import is_suspect_report, parse_suspect
from phoenixrun.protocol.events import (MasterDeposed, MasterStandby, MasterStarted, MasterTakeover,
                                       RejectedRequest)

log = logging.getLogger("phoenixrun.master")

EXIT_DEPOSED = 3     # a master that lost its lease to a newer epoch (it stopped acting; the job goes on)


class Master:
    def __init__(self, cfg: MasterConfig, secret: str):
        self.cfg = cfg
        self.secret = secret
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl")
        self.job = JobState(cfg)
        # a master started again over this run's directory plans from the DTensor peer set the first one was told
        self.job.course.peer_set = layout_file.load(self.run_dir, cfg.run_id, cfg.nnodes * cfg.nproc_per_node)
        # what the run directory vouches for when agents rejoin (a standby reads it again once it takes over)
        self.job.members.roster = Roster(self.run_dir, cfg.run_id)
        self.orders = Orders(self.job, self.events)
        self._inbox = Inbox()
        self.rejections = Rejections(lambda **f: self.events.emit(RejectedRequest(**f), self.job.course.generation))
        self.handlers = Handlers(self.job, self.orders, self.events, self._inbox, self.rejections)
        # the broadcasts' acks through the relays (fan_in.py)
        self.fan_in = FanIn(self.job, self.rejections, self.handlers.check_token, self.handlers.report,
                            self.heartbeat)
        self.recovery = Recoveries(self.job, self.orders, self.events, self._inbox, probe=unreachable)
        self.coordinator = Coordinator(self.job, self.orders, self.events, self._inbox, self.recovery,
                                       probe=unreachable)
        self.monitor = HeartbeatMonitor(self.job, self.events, self._inbox)
        # the directive fan-out tree (relaying.py); children heartbeat through their relays while the master confirms
        # those within half the node timeout (a relay that stops forwarding costs them at most that, plus a period)
        self.relays = RelayDesk(self.job, cfg.recovery.relay_threshold, beat_lag=cfg.recovery.node_timeout / 2)
        self.watch = WatchDesk(self.job, cfg.recovery.relay_threshold)     # silent nodes found by their ring neighbours (watch_desk.py)
        self.watch.lost = self.monitor.declare_lost
        self.monitor.watch = self.watch
        self.lease_id = master_id()
        self.lease_dir = LeaseDir(self.run_dir) if cfg.lease.lease_ttl else None
        self.acquired: Acquired | None = None
        self.keeper: LeaseKeeper | None = None

    # ---------------------------------------------------------------- the lease (--lease-ttl: control/lease.py)
    def acquire_lease(self, stop: threading.Event | None = None) -> int | None:
        """With --lease-ttl: wait until this master holds the lease (a standby waits here, no port open). Returns
        None once it holds it (start() next), or the job's exit code if it finished under another master."""
        if self.lease_dir is None or self.acquired is not None:    # no --lease-ttl, or it holds the lease
            return None
        # the store is torch's: imported before the wait, not after the takeover (20 s on a loaded 2-core machine)
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # noqa: F401  (not in torch's __all__)

        def on_wait(rec: Lease | None, why: str) -> None:
            log.info("standby: %s; waiting to take over", why)
            self.events.emit(MasterStandby(pid=os.getpid(), holder_epoch=rec.epoch if rec else None,
                                              holder_endpoint=rec.endpoint if rec else None,
                                              endpoint=f"{self.cfg.listen.host}:{self.cfg.listen.port}"), self.generation)
        got = await_lease(self.lease_dir, self.lease_id, f"{self.cfg.listen.host}:{self.cfg.listen.port}",
                          self.cfg.lease.lease_ttl, self.cfg.lease.max_clock_skew, stop or threading.Event(), on_wait)
        if not got.epoch:
            log.info("the job finished under another master (%s)", got.reason)
            return got.previous.exit_code or 0 if got.previous is not None else 0
        self.acquired = got
        self.job.master_epoch = got.epoch
        with self.job.cv:
            # the holder wrote on while this master waited; from now on a deposed holder's late lines are skipped
            if self.job.members.roster is not None:
                self.job.members.roster.close()
            self.job.members.roster = roster = Roster(self.run_dir, self.cfg.run_id)
            roster.append(got.epoch)
        return None

    def _keep_lease(self, leases: LeaseDir, got: Acquired) -> None:
        self.keeper = LeaseKeeper(leases, self.lease_id, got.epoch, self.endpoint,
                                  self.cfg.lease.lease_ttl, self.cfg.lease.max_clock_skew, self._deposed)
        self.keeper.start()
        if got.previous is not None:
            self.events.emit(MasterTakeover(epoch=got.epoch, endpoint=self.endpoint,
                                               previous_epoch=got.previous.epoch,
                                               previous_endpoint=got.previous.endpoint, reason=got.reason,
                                               waited_s=round(got.waited_s, 3)), self.generation)
            log.warning("took over as master (epoch %d) from %s: %s", got.epoch, got.previous.endpoint, got.reason)

    def _deposed(self, reason: str) -> None:
        """A newer epoch was claimed: this master stops acting at once (agents ignore its older epoch anyway)."""
        log.error("this master lost its lease (%s): stopping", reason)
        self.events.emit(MasterDeposed(epoch=self.job.master_epoch, reason=reason), self.generation)
        self.http.shutdown()
        with self.job.cv:
            self.job.course.exit_code = EXIT_DEPOSED
        self.job.stopped.set()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.cfg.lease.lease_ttl and self.acquired is None:
            self.acquire_lease()
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # the workers' rendezvous store lives here
        self.store = TCPStore(self.cfg.listen.host, self.cfg.listen.store_port, is_master=True, wait_for_workers=False,
                              use_libuv=True)
        self.store_port = self.store.port
        _raise_fd_limit()   # two connections per agent (heartbeat, directive poll)
        self.http = ControlServer(self, self.cfg.listen.host, self.cfg.listen.port)
        self.orders.wake = lambda node_ids: self.http.wake(self.relays.route(node_ids))
        self.relays.wake = self.http.wake
        self.monitor.transport = self.http
        self.http.start()
        self.endpoint = f"{self.cfg.listen.host}:{self.http.server_address[1]}"
        for target, name in ((self.monitor.run, "_monitor"), (self.coordinator.run, "_controller")):
            threading.Thread(target=target, daemon=True, name=name).start()
        if self.lease_dir is not None and self.acquired is not None:
            self._keep_lease(self.lease_dir, self.acquired)
        info = {"endpoint": self.endpoint, "pid": os.getpid(), "store_port": self.store_port,
                "run_id": self.cfg.run_id, "epoch": self.job.master_epoch}
        tmp = self.run_dir / "master.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.run_dir / "master.json")
        self.events.emit(MasterStarted(endpoint=self.endpoint, pid=os.getpid(), nnodes=self.cfg.nnodes,
                                          nproc_per_node=self.cfg.nproc_per_node, epoch=self.job.master_epoch),
                         self.generation)
        log.info("master listening on %s (store port %d)", self.endpoint, self.store_port)

    def wait(self) -> int:
        self.job.stopped.wait()
        if self.keeper is not None and self.keeper.lost is not None:
            self.events.close()
            return EXIT_DEPOSED
        # give agents a moment to collect their stop directive before the server goes away
        deadline = time.time() + 3.0
        with self.cv:
            while time.time() < deadline and any(
                    n.role != Role.FAILED and not getattr(self.directives.get(n.node_id), "acked", False)
                    for n in self.nodes.values()):
                self.cv.wait(0.1)
        if self.keeper is not None:
            self.keeper.release(self.job.course.exit_code or 0)
        self.http.shutdown()
        self.events.close()
        return self.job.course.exit_code or 0

    # ---------------------------------------------------------------- the transport's API (control/handlers.py)
    def register(self, p: dict[str, Any]) -> dict[str, Any]:
        return self.handlers.register(p).to_wire()

    def heartbeat(self, p: dict[str, Any]) -> dict[str, Any]:
        reply = self.handlers.heartbeat(p)
        if isinstance(reply, TurnedAway):
            return reply.to_wire()
        node_id = p["node_id"]
        return dataclasses.replace(reply, relay=self.relays.link(node_id), watch=self.watch.watch(node_id)).to_wire()

    def report(self, p: dict[str, Any]) -> dict[str, Any]:
        if is_suspect_report(p):      # a ring watcher's (protocol/suspect.py): judged by the watch desk
            self.watch.note(parse_suspect(p), time.time())
            return Heard().to_wire()
        return self.handlers.report(p).to_wire()

    def relayed_reports(self, p: dict[str, Any]) -> dict[str, Any]:
        return self.fan_in.take(p)

    def relayed_heartbeats(self, p: dict[str, Any]) -> dict[str, Any]:
        return self.fan_in.take_beats(p)

    def inject(self, p: dict[str, Any]) -> dict[str, Any]:
        return self.handlers.inject(p).to_wire()

    def drain(self, p: dict[str, Any]) -> dict[str, Any]:
        return self.handlers.drain(p).to_wire()

    def poll_intake(self, p: dict[str, Any]) -> messages.Poll:
        return self.handlers.poll_intake(p)

    def answer_polls(self, asks: list[Ask]) -> list[Directive | None]:
        return self.relays.answer(asks, self.handlers.answer_polls)

    def directives_sent(self, sent: list[Directive]) -> None:
        self.handlers.directives_sent(expand(sent))

    def state(self) -> dict[str, Any]:
        state = self.handlers.state()
        state["standbys"] = self.lease_dir.standbys() if self.lease_dir is not None else []
        state["relayed_reports"] = {"batches": self.fan_in.batches, "taken": self.fan_in.taken}
        state["relayed_heartbeats"] = {"batches": self.fan_in.beat_batches, "taken": self.fan_in.beats}
        return state

    def store_prefix(self, generation: int) -> str:
        return self.orders.store_prefix(generation)

    # ---------------------------------------------------------------- the job's state, as tests and tools read it
    cv = property(lambda self: self.job.cv)
    layout = property(lambda self: self.job.course.layout)
    placement = property(lambda self: self.job.course.placement)
    nodes: dict[str, NodeRecord] = property(lambda self: self.job.members.nodes)   # type: ignore[assignment]
    slots: dict[int, str] = property(lambda self: self.job.members.slots)          # type: ignore[assignment]
    phase: Phase = property(lambda self: self.job.course.phase)                   # type: ignore[assignment]
    restart_count = property(lambda self: self.job.course.restart_count)
    resumed_at = property(lambda self: self.job.course.resumed_at)
    done_nodes = property(lambda self: self.job.members.done_nodes)
    exit_code = property(lambda self: self.job.course.exit_code)
    directives: DirectiveBoard = property(lambda self: self.orders.board)  # type: ignore[assignment]
    _injections = property(lambda self: self.job.members.injections)

    @property
    def generation(self) -> int:
        return self.job.course.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self.job.course.generation = value

    @property
    def store_port(self) -> int:
        return self.job.store_port

    @store_port.setter
    def store_port(self, value: int) -> None:
        self.job.store_port = value

    @property
    def endpoint(self) -> str:
        return self.job.endpoint

    @endpoint.setter
    def endpoint(self, value: str) -> None:
        self.job.endpoint = value

    def _pump(self, timeout: float, lost: set[int], acks: Acks[Any] | None = None) -> None:
        self.recovery.pump(timeout, lost, acks)

    def _finish(self, exit_code: int, reason: str) -> None:
        self.coordinator.finish(exit_code, reason)


def _raise_fd_limit() -> None:
    """Soft open-files limit up to the hard one: a 16K-node job holds over 32K connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

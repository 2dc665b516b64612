"""The agent's side of the worker channel: one handler per op a worker sends (`WorkerOps.handlers`), instead
of a chain of ifs. Handlers run on the connection's reader thread; an op with no handler is ignored.

What workers send (phoenixrun/runtime/api.py): `hello` once connected; requests answered with a `reply` of the
same id (`alloc`, `slots`, `write`); `written` when a snapshot is in its slot; the acks of a recovery
(`quiesced`, `resumed`); what they observe (`comm_error`, `nan_loss`, `error`, `protection_mode`, `layout`);
signs of life (`progress`, `pong`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

from phoenixrun.faults import Signal, SignalKind
from phoenixrun.redundancy import LayoutError, PeerSet
from phoenixrun.protocol import WorkerOp, reports
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol import worker_orders as wo
from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.node import NodeState
from phoenixrun.agents.phases import PhaseAcks
from phoenixrun.agents.replicator import Replicator
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.slots import LocalSlots, SlotError, SlotSpaceError
from phoenixrun.agents.supervisor import WorkerSupervisor

log = logging.getLogger("phoenixrun.agent")

Handler = Callable[[WorkerConn, Any], None]     # each takes its op's message (protocol/worker_messages.py)
# ops that show the worker is making progress: the hang watchdog watches it from then on, and its step's clock starts
# no earlier (a pong shows only that it is alive: agents/watchdog.py)
PROGRESS_OPS = frozenset({WorkerOp.PROGRESS, WorkerOp.WRITE, WorkerOp.WRITTEN, WorkerOp.RESUMED})


class WorkerOps:
    def __init__(self, node: NodeState, slots: LocalSlots, supervisor: WorkerSupervisor, phases: PhaseAcks,
                 replicator: Replicator, reporter: Reporter, on_quiesce_ack: Callable[[], None]):
        self.node, self.slots, self.supervisor, self.phases = node, slots, supervisor, phases
        self.replicator, self.reporter, self.on_quiesce_ack = replicator, reporter, on_quiesce_ack
        self.handlers: dict[WorkerOp, Handler] = {
            WorkerOp.HELLO: self._hello,
            WorkerOp.ALLOC: self._request, WorkerOp.SLOTS: self._request, WorkerOp.WRITE: self._request,
            WorkerOp.WRITTEN: self._written,
            WorkerOp.QUIESCED: self._quiesced,
            WorkerOp.RESUMED: self._resumed,
            WorkerOp.COMM_ERROR: self._comm_error,
            WorkerOp.NAN_LOSS: self._nan_loss,
            WorkerOp.ERROR: self._error,
            WorkerOp.PROTECTION_MODE: self._protection_mode,
            WorkerOp.LAYOUT: self._layout,
            WorkerOp.PROGRESS: self._progress, WorkerOp.PONG: self._alive,
        }

    def on_message(self, conn: WorkerConn, msg: dict[str, Any]) -> None:
        """A line off the channel: decoded into its message type here, at the edge, then to its op's handler."""
        try:
            m = wm.decode(msg)
        except ValueError as e:
            log.warning("worker message ignored: %s", e)
            return
        if m is None:
            return        # no such op: ignored, the channel goes on
        if conn.local_rank is None and m.OP is not WorkerOp.HELLO:
            log.warning("worker message %s before the worker's hello ignored (its first message names it)", m.OP)
            return
        if conn.local_rank is not None and m.OP in PROGRESS_OPS:
            self.supervisor.progressed(conn.local_rank)
        handler = self.handlers.get(m.OP)
        if handler is not None:
            handler(conn, m)

    def on_close(self, conn: WorkerConn) -> None:
        self.supervisor.unwatch(conn)

    @staticmethod
    def _lr(conn: WorkerConn) -> int:
        lr = conn.local_rank
        assert lr is not None, "a message before the hello"   # on_message lets only a hello through before it
        return lr

    def _rank(self, conn: WorkerConn) -> int:
        return self.node.rank(self._lr(conn))

    def _report_observed(self, kind: type[reports.CommError | reports.NanLoss | reports.WorkerError], conn: WorkerConn,
                         m: wm.Observed) -> None:
        self.reporter.report(kind(rank=self._rank(conn), text=m.text, step=m.step, t=time.time()))

    # ------------------------------------------------------------------ handlers
    def _hello(self, conn: WorkerConn, m: wm.Hello) -> None:
        lr = int(m.local_rank)
        with self.node.lock:
            conn.local_rank, conn.pid = lr, m.pid
            self.node.api = self.node.api or bool(m.api)
            self.supervisor.hello(conn, lr)

    def _request(self, conn: WorkerConn, m: wm.Request[Any]) -> None:
        """alloc / slots / write: answered with a reply carrying the request's id."""
        rank = self._rank(conn)
        try:
            reply: wo.Reply
            if isinstance(m, wm.Alloc):
                reply = wo.Paths(paths=self.slots.allocate(rank, int(m.nbytes)))
            elif isinstance(m, wm.Slots):
                if self.slots.fetching.defer(rank, lambda r: conn.send(replace(r, id=m.id))):
                    log.info("rank %d waits for its state: its agent is fetching it", rank)
                    return      # answered when the fetch is over (agents/fetch_gate.py)
                reply = wo.Paths(paths=self.slots.paths(rank))
            else:   # the slot to write, grown first if the snapshot needs more (then at a new path)
                assert isinstance(m, wm.Write)
                idx = self.slots.begin_write(rank, int(m.nbytes))
                path, size = self.slots.path(rank, idx)
                reply = wo.SlotGrant(slot=idx, path=path, nbytes=size)
        except SlotSpaceError as e:
            # not transient: the snapshot cannot grow on this host. A fault of its own (classified as
            # snapshot_space), so that it is not mistaken for the comm error the worker reports next
            reply = wo.Reply(error=str(e))
            self.reporter.report(reports.Health(rank=rank, detail=str(e), t=time.time(), signal=Signal(
                kind=SignalKind.SNAPSHOT_SPACE, rank=rank, detail=str(e))))
        except SlotError as e:
            reply = wo.Reply(error=str(e))
        conn.send(replace(reply, id=m.id))

    def _written(self, conn: WorkerConn, m: wm.Written) -> None:
        self.replicator.commit(conn, int(m.slot), int(m.step), m.stats)

    def _quiesced(self, conn: WorkerConn, m: wm.Quiesced) -> None:
        with self.node.lock:
            self.phases.quiesced(self._lr(conn), int(m.next_step))
        self.on_quiesce_ack()

    def _resumed(self, conn: WorkerConn, m: wm.Resumed) -> None:
        with self.node.lock:
            timings = self.phases.resumed(self._lr(conn), m.timings)
            if m.generation == self.node.generation:
                # This worker rejoined the recovery's generation, so every rank of the world is past its restore (a
                # replacement rendezvouses only once its agent fetched its state; survivors read only their own
                # committed slots, which a write never touches): this node's snapshots may be taken again now.
                # Waiting for the master's `resume` let a worker's next snapshot be refused as "frozen" on a loaded
                # machine (its step was shorter than the way from its report to the master's directive), and
                # that refusal started a needless second local reset.
                self.replicator.freeze(False)
        if timings is not None:
            self.reporter.report(reports.Resumed(timings=timings))

    def _comm_error(self, conn: WorkerConn, m: wm.CommError) -> None:
        self._report_observed(reports.CommError, conn, m)

    def _nan_loss(self, conn: WorkerConn, m: wm.NanLoss) -> None:
        """The script handed a non-finite loss to job.observe_loss()."""
        self.supervisor.error_text[self._lr(conn)] = m.text
        self._report_observed(reports.NanLoss, conn, m)

    def _error(self, conn: WorkerConn, m: wm.ScriptError) -> None:
        """The script's own exception, before the worker exits: report it now."""
        self.supervisor.error_text[self._lr(conn)] = m.text
        self._report_observed(reports.WorkerError, conn, m)

    def _protection_mode(self, conn: WorkerConn, m: wm.ProtectionMode) -> None:
        self.reporter.report(reports.ProtectionMode(rank=self._rank(conn), every=m.every, step=m.step))

    def _layout(self, conn: WorkerConn, m: wm.Layout) -> None:
        try:
            peers = None if m.peers is None else PeerSet.from_wire(m.peers)
        except LayoutError as e:
            log.warning("rank 0 sent a layout the master would refuse: %s", e)
            return
        self.reporter.report(reports.Layout(peers=peers))

    def _progress(self, conn: WorkerConn, m: wm.Progress) -> None:
        """A step began; `step_s`: the longest step since the worker's last progress (the quiesce grace's input)."""
        if conn.local_rank is not None and m.step_s is not None:
            with self.node.lock:
                self.supervisor.stepped(conn.local_rank, m.step_s)

    def _alive(self, conn: WorkerConn, m: wm.Pong) -> None:
        """The answer to the hang watchdog's question: the process is alive."""
        if conn.local_rank is not None:
            self.supervisor.answered_ping(conn.local_rank)

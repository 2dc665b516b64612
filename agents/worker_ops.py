"""The agent's side of the worker channel: one handler per op a worker sends (`WorkerOps.handlers`), instead
of a chain of ifs. Handlers run on the connection's reader thread; an op with no handler is ignored.

What workers send (phoenixrun/runtime/api.py): `hello` once connected; requests answered with a `reply` of the
same id (`alloc`, `slots`, `write`); `written` when a snapshot is in its slot; the acks of a recovery
(`quiesced`, `resumed`); what they observe (`comm_error`, `nan_loss`, `error`, `protection_mode`, `stats`);
signs of life (`progress`, `pong`).
"""
from __future__ import annotations

import time
from typing import Callable

from phoenixrun.faults import Signal
from phoenixrun.protocol import ReportKind, WorkerOp
from phoenixrun.protocol.timings import Timings
from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.node import NodeState
from phoenixrun.agents.phases import PhaseAcks
from phoenixrun.agents.replicator import Replicator
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.slots import LocalSlots, SlotError, SlotSpaceError
from phoenixrun.agents.supervisor import WorkerSupervisor

Handler = Callable[[WorkerConn, dict], None]
# ops that show the worker is alive and making progress (a pong: alive, just waiting on a peer): the hang
# watchdog restarts its clock
PROGRESS_OPS = frozenset({WorkerOp.PROGRESS, WorkerOp.WRITE, WorkerOp.WRITTEN, WorkerOp.RESUMED, WorkerOp.PONG})


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
            WorkerOp.STATS: self._stats,
            WorkerOp.LAYOUT: self._layout,
            WorkerOp.PROGRESS: self._progress, WorkerOp.PONG: self._alive,
        }

    def on_message(self, conn: WorkerConn, msg: dict) -> None:
        op = msg.get("op")
        if not isinstance(op, str):
            return
        if conn.local_rank is not None and op in PROGRESS_OPS:
            self.supervisor.progressed(conn.local_rank)
        handler = self.handlers.get(op)
        if handler is not None:
            handler(conn, msg)

    def on_close(self, conn: WorkerConn) -> None:
        self.supervisor.unwatch(conn)

    def _rank(self, conn: WorkerConn) -> int:
        return self.node.rank(conn.local_rank)

    def _report_observed(self, kind: ReportKind, conn: WorkerConn, msg: dict) -> None:
        self.reporter.report({"kind": kind, "rank": self._rank(conn), "text": msg.get("text", ""),
                              "step": msg.get("step"), "t": time.time()})

    # ------------------------------------------------------------------ handlers
    def _hello(self, conn: WorkerConn, msg: dict) -> None:
        lr = int(msg["local_rank"])
        with self.node.lock:
            conn.local_rank, conn.pid = lr, msg.get("pid")
            self.node.api = self.node.api or bool(msg.get("api"))
            self.supervisor.hello(conn, lr)

    def _request(self, conn: WorkerConn, msg: dict) -> None:
        """alloc / slots / write: answered with a reply carrying the request's id."""
        op, rank = msg["op"], self._rank(conn)
        try:
            if op == WorkerOp.ALLOC:
                reply = {"paths": self.slots.allocate(rank, int(msg["nbytes"]))}
            elif op == WorkerOp.SLOTS:
                reply = {"paths": self.slots.paths(rank)}
            else:   # the slot to write, grown first if the snapshot needs more (then at a new path)
                idx = self.slots.begin_write(rank, int(msg.get("nbytes", 0)))
                path, size = self.slots.path(rank, idx)
                reply = {"slot": idx, "path": path, "nbytes": size}
        except SlotSpaceError as e:
            # not transient: the snapshot cannot grow on this host. A fault of its own (classified as
            # snapshot_space), so that it is not mistaken for the comm error the worker reports next
            reply = {"error": str(e)}
            self.reporter.report({"kind": ReportKind.HEALTH, "rank": rank, "detail": str(e), "t": time.time(), "signal": Signal(
                kind="snapshot_space", node=self.node.slot, rank=rank, detail=str(e)).to_dict()})
        except SlotError as e:
            reply = {"error": str(e)}
        conn.send({"op": WorkerOp.REPLY, "id": msg["id"], **reply})

    def _written(self, conn: WorkerConn, msg: dict) -> None:
        self.replicator.commit(conn, int(msg["slot"]), int(msg["step"]), msg.get("stats", {}))

    def _quiesced(self, conn: WorkerConn, msg: dict) -> None:
        with self.node.lock:
            self.phases.quiesced(conn.local_rank, int(msg.get("next_step", 0)))
        self.on_quiesce_ack()

    def _resumed(self, conn: WorkerConn, msg: dict) -> None:
        with self.node.lock:
            timings = self.phases.resumed(conn.local_rank, Timings.from_wire(msg.get("timings") or {}))
            if msg.get("generation") == self.node.generation:
                # This worker rejoined the recovery's generation, so every rank of the world is past its restore (a
                # replacement rendezvouses only once its agent fetched its state; survivors read only their own
                # committed slots, which a write never touches): this node's snapshots may be taken again now.
                # Waiting for the master's `resume` let a worker's next snapshot be refused as "frozen" on a loaded
                # machine (its step was shorter than the way from its report to the master's directive), and
                # that refusal started a needless second local reset.
                self.replicator.freeze(False)
        if timings is not None:
            self.reporter.report({"kind": ReportKind.RESUMED, "timings": timings.to_wire()})

    def _comm_error(self, conn: WorkerConn, msg: dict) -> None:
        self._report_observed(ReportKind.COMM_ERROR, conn, msg)

    def _nan_loss(self, conn: WorkerConn, msg: dict) -> None:
        """The script handed a non-finite loss to job.observe_loss()."""
        self.supervisor.error_text[conn.local_rank] = msg.get("text", "")
        self._report_observed(ReportKind.NAN_LOSS, conn, msg)

    def _error(self, conn: WorkerConn, msg: dict) -> None:
        """The script's own exception, before the worker exits: report it now."""
        self.supervisor.error_text[conn.local_rank] = msg.get("text", "")
        self._report_observed(ReportKind.WORKER_ERROR, conn, msg)

    def _protection_mode(self, conn: WorkerConn, msg: dict) -> None:
        self.reporter.report({"kind": ReportKind.PROTECTION_MODE, "rank": self._rank(conn), "every": msg.get("every"),
                              "step": msg.get("step")})

    def _layout(self, conn: WorkerConn, msg: dict) -> None:
        self.reporter.report({"kind": ReportKind.LAYOUT, "peers": msg.get("peers")})

    def _stats(self, conn: WorkerConn, msg: dict) -> None:
        with self.node.lock:
            self.node.protection[self._rank(conn)] = msg.get("stats", {})

    def _progress(self, conn: WorkerConn, msg: dict) -> None:
        """A step began; `step_s`: the longest step since the worker's last progress (the quiesce grace's input)."""
        if conn.local_rank is not None and msg.get("step_s") is not None:
            with self.node.lock:
                self.supervisor.stepped(conn.local_rank, msg["step_s"])

    def _alive(self, conn: WorkerConn, msg: dict) -> None:
        """Nothing to do beyond restarting the hang clock (PROGRESS_OPS)."""

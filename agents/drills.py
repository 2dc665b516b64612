"""Fault drills: `phoenixrun inject` carried out on this node - real effects where this machine allows (a worker
killed, stopped, its collectives aborted, the node's traffic cut), the injected health source for hardware
faults (Xid, ECC)."""
from __future__ import annotations

import logging
import os
import signal
import threading

from phoenixrun.protocol import worker_orders as wo
from phoenixrun.protocol.messages import valid_fault
from phoenixrun.faults import InjectedHealthSource, Signal, SignalKind
from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.node import Lifecycle, NodeState
from phoenixrun.agents.partition import GatedPeerClient, NetworkCut
from phoenixrun.agents.peer import PeerServer
from phoenixrun.agents.supervisor import WorkerSupervisor

log = logging.getLogger("phoenixrun.agent")


class FaultDrills:
    def __init__(self, node: NodeState, life: Lifecycle, supervisor: WorkerSupervisor, injected: InjectedHealthSource,
                 cut: NetworkCut, peer_server: PeerServer, peers: GatedPeerClient):
        self.node, self.life, self.supervisor, self.injected = node, life, supervisor, injected
        self.cut, self.peer_server, self.peers = cut, peer_server, peers

    def inject(self, fault: str) -> None:
        """Never raises: it runs on the heartbeat thread, and a bad fault spec must not stop the heartbeats
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
        workers, conns = self.supervisor.running()
        if fault == "comm-timeout" and conns:
            conns[0].send(wo.AbortComm())                  # its collectives fail for real; the node stays healthy
        elif fault == "nan" and conns:
            conns[0].send(wo.PoisonLoss())                 # its next job.observe_loss() sees NaN
        elif fault.startswith("slow:"):
            for c in conns:                                # every worker of the node computes slower: a straggler
                c.send(wo.Slow(factor=float(fault[5:])))
        elif fault == "partition" or fault.startswith("partition:"):
            self.partition(float(fault.partition(":")[2] or 0) or None, conns)
        elif fault == "crash-worker" and workers:
            os.kill(workers[0].pid, signal.SIGKILL)
        elif fault == "hang" and workers:
            os.kill(workers[0].pid, signal.SIGSTOP)
        elif fault == "kill-node":
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.startswith("xid:"):
            self.injected.inject(Signal(kind=SignalKind.XID, code=int(fault[4:]), node=self.node.slot,
                                        detail="injected"))
        elif fault == "ecc":
            self.injected.inject(Signal(kind=SignalKind.ECC_UNCORRECTABLE, node=self.node.slot, detail="injected"))
        else:
            log.error("cannot inject %r here", fault)

    def partition(self, seconds: float | None, conns: list[WorkerConn]) -> None:
        """Drop this node's traffic (agents/partition.py); it comes back after `seconds` (None: never)."""
        log.warning("partition drill: dropping this node's traffic%s",
                    f" for {seconds:g}s" if seconds else f" until kill -USR1 {os.getpid()}")
        self.cut.start()
        self.peer_server.suspend()
        self.peers.drop_all()
        for conn in conns:                         # the node-local channel still works
            conn.send(wo.AbortComm())
        if seconds:
            t = threading.Timer(seconds, self.heal)
            t.daemon = True
            t.start()

    def heal(self) -> None:
        if self.life.stopping or not self.cut.active:
            return
        try:
            self.peer_server.resume()
        except OSError as e:                       # the port was taken meanwhile: peers cannot reach us
            log.warning("partition healed but the peer server cannot listen again: %s", e)
        self.cut.heal()
        log.warning("partition drill over: this node's traffic flows again")

"""The agent's reports to the master: an outbox, delivered in order by one thread, retried with backoff while
the master is unreachable (a restart), so a fault seen meanwhile is handled once it is back. Queueing never
blocks: any thread may report while holding the agent's lock. A broadcast's acks go through the node's relay when
it has one (agents/relay.py's UpLink; protocol/relay.py), and to the master directly when that fails."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any

from phoenixrun.protocol.replies import TurnedAway, report_reply
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.protocol.relay import RELAYED_KINDS
from phoenixrun.protocol.reports import Report
from phoenixrun.agents.node import Lifecycle, NodeState
from phoenixrun.agents.peer import PeerError
from phoenixrun.agents.relay import UpLink

log = logging.getLogger("phoenixrun.agent")


class Reporter:
    def __init__(self, node: NodeState, client: ControlClient, life: Lifecycle):
        self.node, self.client, self.life = node, client, life
        self.outbox: queue.Queue[Report | None] = queue.Queue()
        self._flush_deadline = float("inf")
        self._sender: threading.Thread | None = None
        self.uplink: UpLink | None = None    # through this node's relay (set once the master link exists)

    def report(self, ev: Report) -> None:
        """Queue a report for the master; delivered in order, retried until it gets through."""
        self.outbox.put(self._stamped(ev))

    def _stamped(self, ev: Report) -> Report:
        """With this node's header: its id, generation and slot now, and the time (unless ev has its own)."""
        return ev.sent_by(self.node.node_id, self.node.generation, self.node.slot, time.time())

    def send_now(self, ev: Report, timeout: float = 2.0) -> str | None:
        """Deliver one report now, past the outbox (the caller acts on whether the master got it): None if it
        did, else why not."""
        try:
            reply = report_reply(self.client.post("/v1/report", self._payload(self._stamped(ev)), timeout=timeout))
        except (ControlError, ValueError) as e:
            return str(e)
        return "fenced" if isinstance(reply, TurnedAway) else None

    def start(self) -> None:
        self._sender = threading.Thread(target=self._send_reports, daemon=True, name="reports")
        self._sender.start()

    def close(self, flush_s: float = 1.0) -> None:
        """Last reports (why we left) get `flush_s` to go out."""
        self._flush_deadline = time.time() + flush_s
        self.outbox.put(None)
        if self._sender is not None:
            self._sender.join(timeout=flush_s + 0.5)

    def _payload(self, ev: Report) -> dict[str, Any]:
        return {**ev.to_wire(), "token": self.node.token}     # the current token: a rejoin since it was queued changes it

    def _via_relay(self, ev: Report) -> bool:
        """Send an ack through this node's relay: True if the master took it (or fenced this node) that way; False:
        send it to the master directly (no relay now, the relay failed, or the master refused it from the relay -
        the direct send then says why, as without relays)."""
        token = self.node.token
        if self.uplink is None or not token:
            return False
        try:
            reply = self.uplink.send(self.node.node_id, token, json.dumps(ev.to_wire()).encode())
        except PeerError as e:
            log.info("ack %s through the relay failed (%s): sending it to the master", ev.kind, e)
            return False
        if reply is None or "error" in reply:
            return False
        try:
            decoded = report_reply(reply)
        except ValueError as e:
            log.warning("report %s: %s", ev.kind, e)
            return True
        if isinstance(decoded, TurnedAway):
            self.life.fenced(decoded.reason, decoded.exit_code or 0)
        return True

    def _send_reports(self) -> None:
        while True:
            ev = self.outbox.get()
            if ev is None:
                return
            if ev.kind in RELAYED_KINDS and self._via_relay(ev):
                continue
            delay = 0.1
            while True:
                try:
                    reply = report_reply(self.client.post("/v1/report", self._payload(ev)))
                    if isinstance(reply, TurnedAway):      # replaced while it was away: never rejoin
                        self.life.fenced(reply.reason, reply.exit_code or 0)
                    break
                except ValueError as e:      # the master took it (HTTP 200) with an answer this agent cannot read
                    log.warning("report %s: %s", ev.kind, e)
                    break
                except ControlError as e:    # master down or restarting: a fault seen now is handled later
                    if e.refused:            # the report itself was refused: sending it again will not help
                        log.warning("report %s refused by the master: %s", ev.kind, e)
                        break
                    log.debug("report %s not delivered yet: %s", ev.kind, e)
                if self.life.stopping and time.time() > self._flush_deadline:
                    log.warning("report %s not delivered: the master is unreachable", ev.kind)
                    break
                time.sleep(delay)
                delay = min(2.0, delay * 2)

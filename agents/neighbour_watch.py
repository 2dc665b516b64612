"""This agent's part in the ring watch (decisions: control/ring_watch.py): ping the neighbours the master's
heartbeat reply names, over the peer transport (op PING_OP, answered by the agent's peer server thread, so a hung
host - whose kernel still completes TCP handshakes - does not answer it), and report one that stays silent past
SUSPECT_AFTER_S to the master as a suspect (protocol/suspect.py). The master confirms; this agent only reports.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from phoenixrun.control.ring_watch import PING_S, SUSPECT_AFTER_S, is_suspect, silent_for
from phoenixrun.protocol.peer_requests import Ping
from phoenixrun.protocol.reports import Report, Suspect
from phoenixrun.agents.peer import PeerError

log = logging.getLogger("phoenixrun.agent")

PING_OP = Ping.OP
Call = Callable[[str, Ping], object]                 # PeerClient.call (a client with a short io timeout)
Send = Callable[[Report], object]                    # Reporter.send_now


def answer_ping(header: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
    """The peer op PING_OP: the agent runs."""
    return {"pong": True}, b""


class NeighbourWatch:
    def __init__(self, call: Call, send: Send, stopped: threading.Event) -> None:
        self.call, self.send, self.stopped = call, send, stopped
        self._lock = threading.Lock()
        self._targets: dict[str, str] = {}          # neighbour id -> its peer address
        self._since: dict[str, float] = {}          # neighbour id -> when this agent began watching it
        self._answered: dict[str, float] = {}       # neighbour id -> its last answer (monotonic)
        self._reported: set[str] = set()            # suspected and reported, not heard since

    def follow(self, watch: Iterable[Sequence[str]]) -> None:
        """The heartbeat reply's `watch`: (node id, peer address) of each neighbour (protocol/replies.py); one
        without an address yet is not pinged."""
        got = {w[0]: w[1] for w in watch if w[1]}
        now = time.monotonic()
        with self._lock:
            for nid in got:
                self._since.setdefault(nid, now)
            for gone in set(self._targets) - set(got):
                self._since.pop(gone, None)
                self._answered.pop(gone, None)
                self._reported.discard(gone)
            self._targets = got

    def run(self) -> None:
        """Thread: a ping round every PING_S until the agent stops."""
        due = time.monotonic()
        while not self.stopped.wait(max(0.0, due - time.monotonic())):
            lag = max(0.0, time.monotonic() - due)
            due = time.monotonic() + PING_S
            self.round(lag)

    def round(self, lag: float) -> None:
        with self._lock:
            targets = dict(self._targets)
        for nid, addr in targets.items():
            try:
                self.call(addr, Ping())
                with self._lock:
                    self._answered[nid] = time.monotonic()
                    self._reported.discard(nid)
            except PeerError:
                pass
            now = time.monotonic()
            with self._lock:
                last, since = self._answered.get(nid, 0.0), self._since.get(nid, now)
                due = nid not in self._reported and is_suspect(last, since, now, lag)
                if due:
                    self._reported.add(nid)
            if due:
                quiet = silent_for(last, since, now)
                log.warning("neighbour %s (%s) has not answered for %.2fs: reported to the master", nid, addr, quiet)
                self.send(Suspect(suspect=nid, silent_for=round(quiet, 3)))


PING_IO_TIMEOUT_S = SUSPECT_AFTER_S / 2     # a ping that takes this long is a missed answer, not a stuck round

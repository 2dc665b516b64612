"""An agent's ring watch (agents/neighbour_watch.py) against real peer ports: a live neighbour's agent answers its
pings, a hung host's kernel accepts the connection and nothing answers, a dead one refuses - only the last two are
reported, each once."""
from __future__ import annotations

import socket
import threading
from typing import Any

from phoenixrun.agents.neighbour_watch import PING_IO_TIMEOUT_S, PING_OP, NeighbourWatch, answer_ping
from phoenixrun.agents.peer import PeerClient, PeerServer
from phoenixrun.protocol.names import ReportKind
from phoenixrun.protocol.reports import Suspect

SECRET = "s" * 32


def test_a_hung_and_a_dead_neighbour_are_reported_once_a_live_one_never() -> None:
    live = PeerServer("127.0.0.1", SECRET, {PING_OP: answer_ping})
    hung = socket.create_server(("127.0.0.1", 0))      # listens (the kernel completes handshakes), never answers
    dead = socket.create_server(("127.0.0.1", 0))
    dead_addr = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()                                        # refuses
    sent: list[dict[str, Any]] = []
    both = threading.Event()

    def send(ev: Suspect) -> None:
        sent.append(ev)
        if len(sent) >= 2:
            both.set()
    stop = threading.Event()
    client = PeerClient(SECRET, connect_timeout=PING_IO_TIMEOUT_S, io_timeout=PING_IO_TIMEOUT_S)
    watch = NeighbourWatch(client.call, send, stop)
    watch.follow([["live", live.addr], ["hung", f"127.0.0.1:{hung.getsockname()[1]}"], ["dead", dead_addr]])
    t = threading.Thread(target=watch.run, daemon=True)
    t.start()
    try:
        assert both.wait(60), sent
        watch.round(0.0)    # another round: a neighbour already reported is not reported again
    finally:
        stop.set()
        t.join(10)
        live.close()
        hung.close()
    assert sorted(e.suspect for e in sent) == ["dead", "hung"], sent
    assert all(e.kind == ReportKind.SUSPECT and e.silent_for >= 0.5 for e in sent), sent

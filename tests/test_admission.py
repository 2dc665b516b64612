"""Idle strangers cannot lock the job's own callers out (issue 31 items 3 and 4): when a server's room for
unauthenticated connections is full, the oldest idle one is closed for a newcomer (protocol/admission.py), and
refusals are logged once per interval with a count. The decisions (table tests), then real sockets against a
real PeerServer and a real Master."""
from __future__ import annotations

import logging
import select
import socket
import time

import pytest

from phoenixrun.protocol.peer_requests import Ping
from phoenixrun import auth
from phoenixrun.agents import peer as peer_mod
from phoenixrun.agents.peer import PeerClient, PeerServer
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.protocol.admission import Throttle, pick_eviction
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.protocol.constants import MAX_UNAUTHENTICATED as MASTER_MAX_UNAUTHENTICATED


# ------------------------------------------------------------------ decisions (pure)
@pytest.mark.parametrize("waiting, unread, expect", [
    ([], set(), None),                                                 # room not full: nothing to pick from
    ([("a", 0.0, False), ("b", 1.0, False)], set(), "a"),              # the oldest idle one
    ([("a", 0.0, True), ("b", 1.0, False)], set(), "b"),               # its server is checking a's bytes
    ([("a", 0.0, False), ("b", 1.0, False)], {"a"}, "b"),              # a's frame is on its way
    ([("a", 0.0, True), ("b", 1.0, False)], {"b"}, None),              # none idle: refuse the newcomer
    ([("a", 9.8, False)], set(), None),                                # too new: its caller may not have sent yet
    ([("a", 0.0, True), ("b", 9.8, False), ("c", 0.0, False)], set(), None),   # (accept order: c is not older)
])
def test_pick_eviction(waiting, unread, expect):
    assert pick_eviction(waiting, now=10.0, grace=0.5, unread=lambda k: k in unread) == expect


def test_pick_eviction_looks_at_a_bounded_number():
    waiting = [(i, 0.0, True) for i in range(300)] + [("idle", 0.0, False)]
    assert pick_eviction(waiting, now=10.0, scan=256) is None
    assert pick_eviction(waiting, now=10.0, scan=400) == "idle"


def test_throttle_writes_one_line_per_interval_with_the_count_held_back():
    t = Throttle(interval=10.0)
    assert t.note(0.0) == 0
    assert [t.note(x) for x in (1.0, 2.0, 9.9)] == [None, None, None]
    assert t.note(10.0) == 3
    assert t.note(15.0) is None
    assert t.note(30.0) == 1
    assert t.total == 7


# ------------------------------------------------------------------ the agent's peer port (real sockets)
def _connect_many(addr: str, n: int) -> list[socket.socket]:
    host, port = addr.rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]


def _lines(caplog, logger: str, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and any(w in r.getMessage() for w in words)]


def test_idle_strangers_on_the_peer_port_do_not_keep_the_jobs_peers_out(caplog):
    """Issue 31 item 3: 64 idle connections filled a survivor's peer port, the spare's restore connection was
    closed at accept and the job stopped. Before the fix the call here fails ("peer closed the connection")."""
    caplog.set_level(logging.INFO, logger="phoenixrun.agent.peer")
    peer = PeerServer("127.0.0.1", "s", {"ping": lambda h, p: ({"pong": True}, b"")})
    idle = _connect_many(peer.addr, peer_mod.MAX_UNAUTHENTICATED)
    try:
        time.sleep(1.0)                               # older than the grace: idle
        for _ in range(3):                            # a fresh connection each time (the spare's restore client)
            assert PeerClient("s").call(peer.addr, Ping())[0]["pong"]
        idle += _connect_many(peer.addr, 200)         # a burst: more strangers than idle ones to close
        for _ in range(3):
            time.sleep(0.6)
            assert PeerClient("s").call(peer.addr, Ping())[0]["pong"]
        lines = _lines(caplog, "phoenixrun.agent.peer", "refused a connection", "closed an idle")
        assert 1 <= len(lines) <= 4, lines            # 200+ refusals/evictions: one line per interval per kind
        assert peer.evicted.total + peer.refused.total >= 200
    finally:
        for s in idle:
            s.close()
        peer.close()


def test_refusals_on_the_peer_port_are_logged_once_per_interval(caplog):
    """Issue 31 item 4: one line per refused connection was 76,115 lines (11.5 MB) in 45 s. Before the fix this
    burst wrote one line per connection past the cap."""
    caplog.set_level(logging.INFO, logger="phoenixrun.agent.peer")
    peer = PeerServer("127.0.0.1", "s", {"ping": lambda h, p: ({}, b"")})
    idle = []
    try:
        for _ in range(3):    # bursts of strangers, some refused (too new to close), some taking idle ones' place
            idle += _connect_many(peer.addr, 150)
            time.sleep(0.6)
        lines = _lines(caplog, "phoenixrun.agent.peer", "refused a connection", "closed an idle")
        assert 1 <= len(lines) <= 2, lines
        assert peer.evicted.total + peer.refused.total >= 200
    finally:
        for s in idle:
            s.close()
        peer.close()


def test_a_trickling_stranger_is_closed_at_the_auth_deadline():
    """Before the fix each byte bought another I/O timeout: one byte every 0.3 s held the connection as long as
    the sender liked. Now the whole first header must be in within the auth timeout of the accept."""
    peer = PeerServer("127.0.0.1", "s", {"ping": lambda h, p: ({}, b"")}, io_timeout=1.0)
    (s,) = _connect_many(peer.addr, 1)
    t0 = time.monotonic()
    closed_after = None
    try:
        s.sendall(b"\x00\x00\x00")                    # 3 bytes of a header length; then one byte every 0.3 s
        sent = 3
        while closed_after is None and time.monotonic() - t0 < 6:
            time.sleep(0.3)
            try:
                if select.select([s], [], [], 0)[0] and s.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
                s.sendall(b"\x40" if sent == 3 else b" ")   # a 64-byte header, its JSON led by blanks
                sent += 1
            except OSError:
                closed_after = time.monotonic() - t0
        assert closed_after is not None and closed_after < 2.0, closed_after
        assert PeerClient("s").call(peer.addr, Ping())[0]["ok"]
    finally:
        s.close()
        peer.close()


# ------------------------------------------------------------------ the master (real sockets)
@pytest.fixture
def master(tmp_path):
    secret = auth.new_secret()
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=2, nproc_per_node=2, node_timeout=1e6), secret)
    m.start()
    yield m, secret
    m._finish(0, "test over")


def test_idle_strangers_do_not_lock_status_and_drain_out_of_the_master(master, caplog):
    """Issue 31 item 4: 4,097 idle connections locked `phoenixrun status` and `phoenixrun drain` out. Before the
    fix the state read here fails (the connection closed at accept: no status)."""
    caplog.set_level(logging.INFO, logger="phoenixrun.master")
    m, secret = master
    idle = _connect_many(m.endpoint, MASTER_MAX_UNAUTHENTICATED + 100)
    try:
        time.sleep(1.0)
        assert ControlClient(m.endpoint, secret).get_json("/v1/state")["phase"]
        with pytest.raises(ControlError) as e:        # answered (refused: no node in slot 0), not locked out
            ControlClient(m.endpoint, secret).post("/v1/drain", {"slot": 0, "reason": "test"})
        assert e.value.status is not None and 400 <= e.value.status < 500, e.value
        lines = _lines(caplog, "phoenixrun.master", "refused a connection", "closed an idle")
        assert len(lines) <= 4, lines
        assert m.state()["rejected_requests"]["by_reason"].get("evicted_idle", 0) >= 1
    finally:
        for s in idle:
            s.close()

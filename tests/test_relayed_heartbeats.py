"""Heartbeats through the relays (protocol/relay.py, "Heartbeats travel the tree the same way"; issue 32 items 1
and 3): a child hands its relay each heartbeat, sealed and numbered (agents/beats.py's BeatLink), the relay sends
the master its children's newest in one request a period (BeatDesk), and the master takes each only if its own
node sealed it and it is newer than the last it took (control/fan_in.py, a real master). Where the relay stops
passing them on, the child heartbeats the master directly (beat_route). In a real job: test_e2e_relay.py; at
scale: test_master_scale.py."""
from __future__ import annotations

import json
import time

import pytest

from phoenixrun.agents.beats import BeatDesk, BeatLink
from phoenixrun.agents.peer import PeerClient, PeerError, PeerServer
from phoenixrun.agents.relay import RelayCache
from phoenixrun.protocol.relay import (BEAT_OP, Batch, batch_replies, beat_route, beat_seal, beat_sealed, poll_key,
                                       report_seal)
from phoenixrun.protocol.replies import RelayLink

SECRET = "s3cret"


@pytest.mark.parametrize("relay, lag, now, confirmed_sent_at, to", [
    ("r:1", 2.5, 10.0, 9.0, "r:1"),       # confirmed recently: through the relay
    ("r:1", 2.5, 10.0, 7.5, "r:1"),       # exactly at the limit: still the relay
    ("r:1", 2.5, 10.0, 7.4, None),        # unconfirmed for longer than the master allows: the master directly
    ("r:1", 2.5, 10.0, 0.0, None),        # never confirmed (a child's first heartbeats go direct)
    (None, 2.5, 10.0, 9.9, None),         # no relay (or it failed)
    ("r:1", None, 10.0, 9.9, None),       # the master does not take relayed heartbeats
])
def test_where_the_next_heartbeat_goes(relay, lag, now, confirmed_sent_at, to):
    assert beat_route(relay, lag, now, confirmed_sent_at) == to


def test_a_silent_relay_never_holds_a_childs_heartbeats_longer_than_the_master_allows():
    """Property: whatever the relay does, a child that heartbeats every `period` and has had no confirmation since
    `t0` sends a heartbeat to the master directly within lag + period of t0."""
    for lag in (0.5, 1.0, 2.5):
        for period in (0.1, 0.5, 1.0):
            t, sent = 0.0, []
            while t < 20:
                sent.append((t, beat_route("r:1", lag, t, 0.0)))
                t += period
            first_direct = next(at for at, to in sent if to is None)
            assert first_direct <= lag + period + 1e-9


def test_a_heartbeat_seal_binds_the_bytes_and_the_token_and_is_not_a_report_seal():
    body = b'{"node_id": "n2", "seq": 3}'
    mac = beat_seal("tok-a", body)
    assert beat_sealed("tok-a", body, mac)
    assert not beat_sealed("tok-b", body, mac)
    assert not beat_sealed("tok-a", body.replace(b"3", b"4"), mac)
    assert not beat_sealed("tok-a", body, report_seal("tok-a", body))    # an ack's seal does not pass as a beat's


def test_the_link_says_how_long_relayed_heartbeats_may_go_unconfirmed():
    assert RelayLink.from_wire(RelayLink("r:1", "n1", False, 2.5).to_wire()) == RelayLink("r:1", "n1", False, 2.5)
    assert RelayLink.from_wire({"parent": "r:1", "via": "n1", "serves": False}).beats is None   # an older master


# ------------------------------------------------------------------ a real master (conftest.py: n1-n3)
def _beat(token: str, node_id: str, seq: int | None, **extra: object) -> tuple[bytes, str]:
    p: dict = {"node_id": node_id, "worker_pids": [7], "snapshots": {}, "replicas": {}, "protection": {},
               "api": True, **extra}
    if seq is not None:
        p["seq"] = seq
    body = json.dumps(p).encode()
    return body, beat_seal(token, body)


def test_the_master_takes_each_sealed_fresh_heartbeat_and_refuses_the_rest_in_place(three_node_master):
    m, client, tokens = three_node_master
    before = m.job.members.nodes["n2"].last_heartbeat
    good = _beat(tokens["n2"], "n2", 5)
    forged = _beat(tokens["n1"], "n3", 1)                   # the relay's own token: not n3's seal
    altered = (good[0].replace(b"[7]", b"[8]"), good[1])
    unnumbered = _beat(tokens["n3"], "n3", None)
    replies = batch_replies(client.post("/v1/heartbeats", Batch("n1", tokens["n1"],
                                                                (good, forged, altered, unnumbered)).to_wire()))
    assert replies[0]["ok"] is True and replies[0]["role"] == "active"     # n2's own heartbeat reply
    assert [r.get("reason") for r in replies[1:]] == ["bad_seal", "bad_seal", "invalid"]
    assert m.job.members.nodes["n2"].last_heartbeat > before
    assert m.job.members.nodes["n2"].worker_pids == [7]
    # a replay (or one overtaken by the child's own direct heartbeat) is ignored, and is no hostile input
    again = batch_replies(client.post("/v1/heartbeats", Batch("n1", tokens["n1"], (good,)).to_wire()))
    assert again[0]["reason"] == "stale"
    newer = batch_replies(client.post("/v1/heartbeats", Batch("n1", tokens["n1"],
                                                              (_beat(tokens["n2"], "n2", 6),)).to_wire()))
    assert newer[0]["ok"] is True
    state = client.get_json("/v1/state")
    assert state["relayed_heartbeats"] == {"batches": 3, "taken": 2}
    assert state["rejected_requests"]["by_reason"] == {"bad_seal": 2, "invalid": 1}


def test_a_relay_must_carry_its_own_token(three_node_master):
    m, client, tokens = three_node_master
    with pytest.raises(Exception, match="token"):
        client.post("/v1/heartbeats", Batch("n1", tokens["n2"], (_beat(tokens["n2"], "n2", 1),)).to_wire())
    assert client.get_json("/v1/state")["relayed_heartbeats"] == {"batches": 0, "taken": 0}


# ------------------------------------------------------------------ relay and child, over real sockets
@pytest.fixture
def relay(three_node_master):
    """n1 relays for n2 and n3: its BeatDesk posts to the real master, its peer server takes the children's."""
    m, client, tokens = three_node_master
    cache = RelayCache()
    cache.store({"keys": {c: poll_key(tokens[c]) for c in ("n2", "n3")}, "children": {}})
    desk = BeatDesk(cache, lambda batch: batch_replies(client.post("/v1/heartbeats", batch.to_wire())),
                    lambda: ("n1", tokens["n1"]))
    server = PeerServer("127.0.0.1", SECRET, {BEAT_OP: desk.serve})
    yield m, tokens, desk, server.addr
    server.close()


def test_a_childs_heartbeat_reaches_the_master_with_its_relays_next_flush(relay):
    m, tokens, desk, addr = relay
    link = BeatLink(PeerClient(SECRET, io_timeout=10))
    link.lag = 5.0
    link.confirmed(time.monotonic())             # as after its first, direct, heartbeat
    heard0 = m.job.members.nodes["n2"].last_heartbeat
    beat = {"node_id": "n2", "token": tokens["n2"], "worker_pids": [11], "snapshots": {}, "replicas": {},
            "protection": {}, "api": True}
    assert link.route(addr) == addr
    assert link.send(addr, "n2", tokens["n2"], beat) is None             # nothing from the master yet
    assert m.job.members.nodes["n2"].last_heartbeat == heard0            # kept at the relay until its flush
    sent_at = time.monotonic()
    assert desk.flush() == 1 and desk.batches == 1
    assert m.job.members.nodes["n2"].worker_pids == [11] and m.job.members.nodes["n2"].last_heartbeat > heard0
    reply = link.send(addr, "n2", tokens["n2"], {**beat, "worker_pids": [12]})
    assert reply is not None and reply["ok"] is True and reply["role"] == "active"   # the reply to the first
    assert link.confirmed_at <= sent_at and link.confirmed_at > sent_at - 5   # the first's send time, confirmed
    assert link.send(addr, "n2", tokens["n2"], beat) is None             # each reply is handed over once
    assert desk.flush() == 1                                            # only the newest of the two unsent
    assert m.job.members.nodes["n2"].worker_pids == [11]


def test_the_relay_never_sees_the_childs_token(relay):
    m, tokens, desk, addr = relay
    seen = []
    inner = desk.post
    desk.post = lambda batch: (seen.append(batch), inner(batch))[1]
    link = BeatLink(PeerClient(SECRET, io_timeout=10))
    link.send(addr, "n2", tokens["n2"], {"node_id": "n2", "token": tokens["n2"], "worker_pids": [], "api": True})
    desk.flush()
    assert seen and all(tokens["n2"].encode() not in body for b in seen for body, _ in b.reports)


def test_a_stranger_cannot_hand_a_relay_heartbeats(relay):
    m, tokens, desk, addr = relay
    with pytest.raises(PeerError, match="not a child"):
        BeatLink(PeerClient(SECRET)).send(addr, "n1", tokens["n1"], {"node_id": "n1"})   # n1 is no child of it
    assert desk.flush() == 0 and desk.batches == 0


def test_unconfirmed_heartbeats_send_the_child_to_the_master(relay):
    """A relay that takes heartbeats but never passes them on: the child's confirmation goes stale, and its next
    heartbeat goes to the master directly."""
    m, tokens, desk, addr = relay
    link = BeatLink(PeerClient(SECRET, io_timeout=10))
    link.lag = 2.5
    t0 = time.monotonic()
    link.confirmed(t0)
    for _ in range(3):
        link.send(addr, "n2", tokens["n2"], {"node_id": "n2", "worker_pids": [], "api": True})   # never flushed
    assert link.route(addr, now=t0 + 2.0) == addr
    assert link.route(addr, now=t0 + 2.6) is None

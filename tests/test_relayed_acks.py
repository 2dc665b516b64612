"""Acks through the relays (protocol/relay.py, "Acks travel the tree the other way"; issue 32 item 2): a relay
sends the master its children's sealed acks in one request (agents/relay.py's AckBatcher, over real sockets), and
the master takes each only if its own node sealed it and it is an ack (control/fan_in.py, a real master). In a
real job: test_e2e_relay.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from phoenixrun.agents.peer import PeerClient, PeerError, PeerServer
from phoenixrun.agents.relay import AckBatcher, RelayCache, UpLink
from phoenixrun.protocol.client import ControlError
from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.relay import REPORT_OP, Batch, batch_replies, batch_size, poll_key, report_seal, report_sealed

SECRET = "s3cret"


def test_a_report_seal_binds_the_bytes_and_the_token():
    body = b'{"kind": "quiesced", "node_id": "n2"}'
    mac = report_seal("tok-a", body)
    assert report_sealed("tok-a", body, mac)
    assert not report_sealed("tok-b", body, mac)
    assert not report_sealed("tok-a", body.replace(b"n2", b"n3"), mac)
    assert not report_sealed("tok-a", body, None)


@pytest.mark.parametrize("wire", [
    None, [], {"token": "t", "reports": []}, {"node_id": "r", "reports": []}, {"node_id": "r", "token": "t"},
    {"node_id": "r", "token": "t", "reports": [{"d": "{}"}]}, {"node_id": "r", "token": "t", "reports": [{"mac": "m"}]},
    {"node_id": "r", "token": "t", "reports": [{"d": 1, "mac": "m"}]},
    {"node_id": "r", "token": "t", "reports": [{"d": "{}", "mac": "m"}] * 4097},
])
def test_a_malformed_batch_is_refused_whole(wire):
    with pytest.raises(MessageError):
        Batch.from_wire(wire)


@pytest.mark.parametrize("sizes, limit, n", [
    ([], 10, 0), ([5], 10, 1), ([50], 10, 1), ([4, 6, 1], 10, 2), ([10, 1], 10, 1), ([3, 3, 3, 3], 10, 3),
    ([1] * 20, 10, 10),
])
def test_a_request_carries_the_first_report_then_what_fits(sizes, limit, n):
    assert batch_size(sizes, limit) == n


def test_a_batch_round_trips():
    b = Batch("r1", "tok", ((b'{"a": 1}', "m1"), (b'{"b": 2}', "m2")))
    assert Batch.from_wire(json.loads(json.dumps(b.to_wire()))) == b


# ------------------------------------------------------------------ the relay's side, over real sockets
@pytest.fixture
def batcher():
    """A relay of children c0..c19 whose master answers each report with who sent it; the first request is held
    until `release` is set, so the other children's acks queue behind it."""
    cache = RelayCache()
    cache.store({"keys": {f"c{i}": poll_key(f"tok{i}") for i in range(20)}, "children": {}})
    posts: list[Batch] = []
    release = threading.Event()
    fail = []

    def post(batch: Batch) -> list[dict]:
        posts.append(batch)
        release.wait(30)
        if fail:
            raise ControlError("master unreachable")
        return [{"ok": True, "ignored": json.loads(body)["node_id"]} for body, _ in batch.reports]
    acks = AckBatcher(cache, post, lambda: ("r1", "relay-token"))
    server = PeerServer("127.0.0.1", SECRET, {REPORT_OP: acks.serve})
    yield server.addr, posts, release, fail, acks
    release.set()
    server.close()


def _send_all(addr: str, n: int) -> tuple[dict, dict, list[threading.Thread]]:
    got, errors = {}, {}

    def one(i: int) -> None:
        link = UpLink(PeerClient(SECRET, io_timeout=20), lambda: addr)
        try:
            got[i] = link.send(f"c{i}", f"tok{i}", json.dumps({"kind": "quiesced", "node_id": f"c{i}"}).encode())
        except PeerError as e:
            errors[i] = str(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return got, errors, threads


def test_the_relay_sends_its_childrens_acks_together_and_answers_each_its_own(batcher):
    addr, posts, release, _, acks = batcher
    got, errors, threads = _send_all(addr, 20)
    deadline = time.monotonic() + 30      # the first child's ack is held in its request; the other 19 queue
    while not (len(posts) == 1 and acks.queued == 19) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(posts) == 1 and acks.queued == 19, (len(posts), acks.queued)
    release.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert {i: r["ignored"] for i, r in got.items()} == {i: f"c{i}" for i in range(20)}   # each its own reply
    assert len(posts) == 2 and acks.batches == 2      # combined: the first, then the 19 queued in one
    assert sum(len(b.reports) for b in posts) == 20
    assert all(b.relay == "r1" and b.token == "relay-token" for b in posts)
    for b in posts:                       # sealed by each child, under its own token
        for body, mac in b.reports:
            i = json.loads(body)["node_id"][1:]
            assert report_sealed(f"tok{i}", body, mac)


def test_children_hear_when_the_relay_cannot_reach_the_master(batcher):
    addr, posts, release, fail, _ = batcher
    fail.append(True)
    release.set()
    got, errors, threads = _send_all(addr, 5)
    for t in threads:
        t.join(30)
    assert not got and len(errors) == 5 and all("master unreachable" in e for e in errors.values())


def test_a_stranger_is_not_relayed(batcher):
    addr, posts, release, _, _ = batcher
    release.set()
    with pytest.raises(PeerError, match="not a child"):
        UpLink(PeerClient(SECRET), lambda: addr).send("c99", "tok99", b'{"kind": "quiesced"}')
    assert UpLink(PeerClient(SECRET), lambda: None).send("c1", "tok1", b"{}") is None    # no relay: direct
    assert not posts


# ------------------------------------------------------------------ the master's side, a real master (conftest.py)
def _entry(token: str, report: dict) -> tuple[bytes, str]:
    body = json.dumps(report).encode()
    return body, report_seal(token, body)


def test_the_master_takes_each_sealed_ack_and_refuses_the_rest_in_place(three_node_master):
    m, client, tokens = three_node_master
    ack = {"kind": "resumed", "node_id": "n2", "generation": 0, "slot": 1}
    good = _entry(tokens["n2"], ack)
    forged = _entry(tokens["n1"], {**ack, "node_id": "n3"})               # the relay's own token: not n3's seal
    altered = (good[0].replace(b'"slot": 1', b'"slot": 2'), good[1])
    fault = _entry(tokens["n3"], {"kind": "worker_exit", "node_id": "n3", "generation": 0, "slot": 2,
                                  "rank": 2, "exit_code": 1})              # sealed, but not an ack
    replies = batch_replies(client.post("/v1/reports", Batch("n1", tokens["n1"],
                                                             (good, forged, altered, fault)).to_wire()))
    assert replies[0] == {"ok": True}
    assert [r.get("reason") for r in replies[1:]] == ["bad_seal", "bad_seal", "not_relayed"]
    state = client.get_json("/v1/state")
    assert state["relayed_reports"] == {"batches": 1, "taken": 1}
    assert state["rejected_requests"]["by_reason"] == {"bad_seal": 2, "not_relayed": 1}


def test_a_relay_must_carry_its_own_token(three_node_master):
    m, client, tokens = three_node_master
    good = _entry(tokens["n2"], {"kind": "resumed", "node_id": "n2", "generation": 0, "slot": 1})
    with pytest.raises(ControlError, match="403"):
        client.post("/v1/reports", Batch("n1", tokens["n2"], (good,)).to_wire())    # n2's token, not n1's
    assert client.get_json("/v1/state")["relayed_reports"] == {"batches": 0, "taken": 0}

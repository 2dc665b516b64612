"""The relay protocol's parts (protocol/relay.py, agents/relay.py, control/relaying.py) over real sockets: a relay
serves its children what the master sealed for them and nothing else; a child refuses what the master did not
seal; the master's desk answers a relay with a bundle and maps wake-ups to relays. The tree: test_relay_tree.py;
a relay killed in a real job: test_e2e_relay.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from phoenixrun.agents.peer import PeerClient, PeerError, PeerServer
from phoenixrun.agents.relay import ParentLink, RelayCache
from phoenixrun.config import MasterConfig
from phoenixrun.control.directives import Ask, DirectiveBoard
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.relaying import Bundle, RelayDesk, expand
from phoenixrun.control.state import NodeRecord, Role
from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.relay import RELAY_OP, parse_relay_state, poll_key, seal, sealed
from phoenixrun.protocol.replies import RelayLink

SECRET = "s3cret"


def entry(token: str, version: int, fields: dict, generation: int = 0) -> dict:
    body = json.dumps({**fields, "version": version}).encode()
    return {"v": version, "g": generation, "d": body.decode(), "mac": seal(token, body)}


@pytest.fixture
def relay():
    cache = RelayCache()
    server = PeerServer("127.0.0.1", SECRET, {RELAY_OP: cache.serve})
    yield cache, server.addr
    server.close()


def test_seal_binds_the_bytes_and_the_token():
    body = b'{"command": "run", "version": 3}'
    mac = seal("tok-a", body)
    assert sealed("tok-a", body, mac)
    assert not sealed("tok-b", body, mac)                       # another node's token
    assert not sealed("tok-a", body.replace(b"run", b"stop"), mac)
    assert not sealed("tok-a", body, None) and poll_key("tok-a") != poll_key("tok-b") != "tok-b"


@pytest.mark.parametrize("value, ok", [
    ({}, True), ({"n1": [3, 2]}, True), ({"n1": [-1, -1]}, True),
    ([], False), ({"n1": [3]}, False), ({"n1": ["3", 2]}, False), ({"n1": [3, -2]}, False),
    ({"n1": [True, 2]}, False), ({f"n{i}": [1, 1] for i in range(4097)}, False),
])
def test_relay_state_is_validated_whole(value, ok):
    if ok:
        assert parse_relay_state(value) == {k: tuple(v) for k, v in value.items()}
    else:
        with pytest.raises(MessageError):
            parse_relay_state(value)


def test_a_child_gets_its_sealed_directive_through_the_relay(relay):
    cache, addr = relay
    child = ParentLink(PeerClient(SECRET, io_timeout=8))
    cache.store({"keys": {"c1": poll_key("tok1")}, "children": {"c1": entry("tok1", 5, {"command": "run"})}})
    assert child.poll(addr, "c1", "tok1", 4) == {"command": "run", "version": 5}
    t0 = time.monotonic()
    assert child.poll(addr, "c1", "tok1", 5) is None            # nothing newer: a noop after the relay poll
    assert time.monotonic() - t0 >= 1.0
    assert cache.state() == {"c1": [5, 5]}                      # its ack, for the relay's next poll


def test_a_parked_child_is_answered_when_the_bundle_arrives(relay):
    cache, addr = relay
    cache.store({"keys": {"c1": poll_key("tok1")}, "children": {}})
    got: list = []
    t = threading.Thread(target=lambda: got.append(ParentLink(PeerClient(SECRET, io_timeout=8)).poll(
        addr, "c1", "tok1", 3)))
    t.start()
    deadline = time.monotonic() + 30      # parked: the relay recorded its ack (version 3) and waits for a bundle
    while cache.state()["c1"][1] != 3:
        assert time.monotonic() < deadline, "the child's poll never reached the relay"
        time.sleep(0.01)
    cache.store({"keys": {"c1": poll_key("tok1")}, "children": {"c1": entry("tok1", 7, {"command": "quiesce"})}})
    t.join(5)
    assert got == [{"command": "quiesce", "version": 7}]


def test_a_forged_or_foreign_directive_is_refused_by_the_child(relay):
    cache, addr = relay
    child = ParentLink(PeerClient(SECRET, io_timeout=8))
    forged = entry("tok1", 9, {"command": "stop"})
    forged["d"] = forged["d"].replace("stop", "run ")           # the relay altered the bytes
    cache.store({"keys": {"c1": poll_key("tok1"), "c2": poll_key("tok2")},
                 "children": {"c1": forged, "c2": entry("tok1", 9, {"command": "stop"})}})   # c2's sealed for c1
    for node, token in (("c1", "tok1"), ("c2", "tok2")):
        with pytest.raises(PeerError, match="did not seal"):
            child.poll(addr, node, token, -1)


def test_a_stranger_or_an_unknown_child_gets_nothing(relay):
    cache, addr = relay
    cache.store({"keys": {"c1": poll_key("tok1")}, "children": {"c1": entry("tok1", 5, {"command": "run"})}})
    with pytest.raises(PeerError, match="not a child"):
        ParentLink(PeerClient(SECRET, io_timeout=8)).poll(addr, "c1", "wrong-token", -1)
    with pytest.raises(PeerError, match="not a child"):
        ParentLink(PeerClient(SECRET, io_timeout=8)).poll(addr, "c9", "tok9", -1)
    with pytest.raises(PeerError, match="unauthorized"):         # the job secret first, as for every peer op
        ParentLink(PeerClient("wrong", io_timeout=8)).poll(addr, "c1", "tok1", -1)


def test_an_older_directive_never_replaces_a_newer_one_in_the_relay(relay):
    cache, _ = relay
    cache.store({"keys": {"c1": "k"}, "children": {"c1": entry("tok1", 8, {"command": "run"})}})
    cache.store({"keys": {"c1": "k"}, "children": {"c1": entry("tok1", 6, {"command": "quiesce"})}})
    assert cache.state()["c1"][0] == 8


# ------------------------------------------------------------------ the master's desk
def job_with(n: int, threshold: int) -> tuple[JobState, RelayDesk]:
    job = JobState(MasterConfig(run_dir="/tmp/unused", nnodes=n, nproc_per_node=1))
    for i in range(n):
        nid = f"n{i:02d}"
        job.members.nodes[nid] = NodeRecord(nid, "127.0.0.1", 0, f"127.0.0.1:{9000 + i}", "", Role.ACTIVE, slot=i)
        job.members.tokens[nid] = f"tok{i}"
    desk = RelayDesk(job, threshold)
    desk.refresh(now=1e9)
    return job, desk


def answerer(board: DirectiveBoard):
    return lambda asks: [board.answer(a.node_id, a.version) for a in asks]


def test_below_the_threshold_nobody_is_told_of_a_tree():
    _, desk = job_with(3, 4)
    assert desk.link("n00") is None and desk.route(["n01"]) == ["n01"]


def test_the_desk_bundles_a_relays_children_sealed_for_each():
    job, desk = job_with(9, 4)
    relay = desk.tree.relays[0]
    kids = desk.tree.children(relay)
    assert desk.link(relay) == RelayLink(parent=None, via=None, serves=True)
    assert desk.link(kids[0]) == RelayLink(parent=job.members.nodes[relay].peer_addr, via=relay, serves=False)
    board = DirectiveBoard(first_version=100)
    board.set(job.members.nodes, command="quiesce", generation=1)
    assert set(desk.route([kids[0]])) == {kids[0], relay}

    poll = Ask(relay, -1, {})
    (b,) = desk.answer([poll], answerer(board))
    assert isinstance(b, Bundle) and {d.version for d in expand([b])} == {101}
    got = json.loads(b.body)
    assert got["own"]["command"] == "quiesce" and set(got["children"]) == set(kids) == set(got["keys"])
    for c in kids:
        e = got["children"][c]
        assert sealed(job.members.tokens[c], e["d"].encode(), e["mac"]) and e["v"] == 101 and e["g"] == 1
        assert got["keys"][c] == poll_key(job.members.tokens[c])
    # everything held, nothing new: parked; the children's acks recorded on the board
    held = Ask(relay, 101, {c: (101, 101) for c in kids})
    assert desk.answer([held], answerer(board)) == [None]
    assert all(board.get(c).acked for c in kids)


def test_a_dead_relays_children_are_handed_to_another_and_it_is_woken():
    job, desk = job_with(9, 4)
    woken: list[str] = []
    desk.wake = woken.extend
    dead = desk.tree.relays[0]
    orphans = desk.tree.children(dead)
    job.members.nodes[dead].role = Role.FAILED
    desk.refresh(now=2e9)
    new = {desk.tree.parent[c] for c in orphans}
    assert dead not in desk.tree.parent and None not in new and set(woken) == new


def test_a_relay_polling_before_it_knows_it_serves_gets_its_children_at_once():
    """Its poll carries no `relay` field (it was sent before a heartbeat reply said it serves): parked, it would
    learn its children only when the poll expired (15-30 s after a real job's start, refusing them meanwhile)."""
    job, desk = job_with(9, 4)
    relay = desk.tree.relays[0]
    board = DirectiveBoard(first_version=100)
    board.set(job.members.nodes, command="run", generation=0)
    board.answer(relay, -1)
    (b,) = desk.answer([Ask(relay, 101)], answerer(board))   # its own directive held already: nothing new for it
    assert isinstance(b, Bundle)
    got = json.loads(b.body)
    assert got["own"] is None and set(got["keys"]) == set(desk.tree.children(relay)) == set(got["children"])
    child = desk.tree.children(relay)[0]
    assert desk.answer([Ask(child, 101)], answerer(board)) == [None]     # a child's plain poll: parked, as before


def test_a_relay_reported_lost_relays_no_more_before_its_recovery_replaces_it():
    """Its role is still active until the recovery promotes a spare (after the quiesce acks): the tree must not
    wait for that, or a hung relay's children miss the quiesce until their calls to it time out (3-5 s)."""
    job, desk = job_with(9, 4)
    woken: list[str] = []
    desk.wake = woken.extend
    hung = desk.tree.relays[0]
    orphans = desk.tree.children(hung)
    job.members.lost.add(hung)                     # control/monitor.py, as it reports the loss
    desk.refresh(now=2e9)
    assert hung not in desk.tree.parent and hung not in desk.tree.relays
    new = {desk.tree.parent[c] for c in orphans}
    assert None not in new and set(woken) >= new
    assert desk.link(orphans[0]).via in new        # what the orphan's next heartbeat reply says


def test_a_poll_at_a_relay_the_child_left_ends_at_once():
    """agents/master_link.py's follow: moved off a (hung) relay, the child's poll there ends now (ParentLink.leave),
    not when the call would time out."""
    release, entered = threading.Event(), threading.Event()

    def hang(header, payload):
        entered.set()
        release.wait(30)
        return {}, b""
    server = PeerServer("127.0.0.1", "s", {RELAY_OP: hang})
    link = ParentLink(PeerClient("s", io_timeout=30))
    failed: list[str] = []

    def poll() -> None:
        try:
            link.poll(server.addr, "c1", "tok1", -1)
        except PeerError as e:
            failed.append(str(e))
    t = threading.Thread(target=poll)
    t.start()
    assert entered.wait(10)                        # the call is in flight: the relay holds it
    link.leave(server.addr)
    t.join(10)
    release.set()
    server.close()
    assert not t.is_alive() and failed

"""Partition drill building blocks and fencing on rejoin, without a job: the pure fence decision, the master's
answers to a replaced node on every endpoint, and the agent's cut (control calls, peer server, peer calls)."""
import json
import socket

import pytest

from phoenixrun.protocol.peer_requests import Ping
from phoenixrun import auth
from phoenixrun.agents.partition import GatedControlClient, GatedPeerClient, NetworkCut
from phoenixrun.agents.peer import PeerError, PeerServer
from phoenixrun.cli import valid_fault
from phoenixrun.protocol.client import ControlError
from phoenixrun.control.directives import Ask
from phoenixrun.control.events import read_events
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.control.recovery import Cascade
from phoenixrun.control.state import NodeRecord, Role, fence_reply
from phoenixrun.protocol.directives import Quiesce, Run
from phoenixrun.protocol import reports


def _node(role, slot=None):
    return NodeRecord(node_id="n1", host="h", agent_pid=1, peer_addr="h:1", fault_domain="d", role=role, slot=slot,
                      last_fault="host_pcie: no heartbeat")


@pytest.mark.parametrize("role", [Role.ACTIVE, Role.SPARE])
def test_live_nodes_are_not_fenced(role):
    assert fence_reply(_node(role, 0 if role == Role.ACTIVE else None)) is None
    assert fence_reply(None) is None


def test_failed_node_gets_stop_with_reason():
    r = fence_reply(_node(Role.FAILED))
    assert r is not None and r.fenced and r.exit_code == 0 and "n1" in r.reason and "no heartbeat" in r.reason
    wire = r.to_wire()     # what every endpoint answers: a stop order its directive poll acts on too
    assert wire["fenced"] is True and wire["command"] == "stop" and wire["role"] == "failed" and wire["slot"] is None


def _register(m: Master, nid: str) -> dict:
    return m.register({"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:1"})


def test_replaced_node_is_fenced_on_every_endpoint(tmp_path):
    """After replacement a node that talks again (healed partition) is told to stop, whatever it asks, and
    is never given work: no directive of the new generation, no heartbeat bookkeeping, no report queued."""
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=1, nproc_per_node=1), auth.new_secret())
    m.store_port = 0                              # not started: no store, no HTTP; the handlers are called directly
    token = _register(m, "a")["token"]
    assert isinstance(m._inbox.get_nowait(), reports.Joined)
    assert m.heartbeat({"node_id": "a", "token": token})["ok"]
    with m.cv:                                    # what _replace_slots does to the node it replaces
        m.nodes["a"].role, m.nodes["a"].slot = Role.FAILED, None
        m.generation = 3
        m.orders.direct(["a"], Run())                 # even a pending order must not reach it
    hb = m.heartbeat({"node_id": "a", "snapshots": {"0": [9]}})
    assert hb["fenced"] and hb["command"] == "stop" and "inject" not in hb
    assert m.nodes["a"].snapshots == {}           # its reports are not taken into the job's state
    d = json.loads(m.answer_polls([Ask("a", 5)])[0].body)
    assert d["fenced"] and d["command"] == "stop" and d["version"] == 6
    assert m.report({"node_id": "a", "kind": "worker_exit", "rank": 0, "returncode": 1})["fenced"]
    assert m._inbox.empty()
    assert _register(m, "a")["fenced"]
    m.events.close()
    fenced = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "node_fenced"]
    assert len(fenced) == 1 and fenced[0]["node"] == "a" and fenced[0]["via"] == "heartbeat"


def test_cut_fails_control_and_peer_calls_and_heal_restores_them():
    cut = NetworkCut()
    ctl = GatedControlClient("127.0.0.1:9", "s", cut)
    peers = GatedPeerClient("s", cut)
    server = PeerServer("127.0.0.1", "s", {"ping": lambda h, p: ({"pong": True}, b"")})
    try:
        assert peers.call(server.addr, Ping())[0]["pong"]
        cut.start()
        with pytest.raises(ControlError, match="partitioned"):
            ctl.post("/v1/heartbeat", {})
        with pytest.raises(PeerError, match="partitioned"):
            peers.call(server.addr, Ping())
        server.suspend()                          # others (the master's probe) cannot connect now
        host, port = server.addr.rsplit(":", 1)
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=0.5).close()
        cut.heal()
        server.resume()                           # same address: peers and the master know it
        assert GatedPeerClient("s", cut).call(server.addr, Ping())[0]["pong"]
    finally:
        server.close()


@pytest.mark.parametrize("fault,ok", [
    ("partition", True), ("partition:2.5", True), ("partition:0", False), ("partition:x", False),
    ("partition:inf", False), ("comm-timeout", True), ("nan", True), ("xid:79", True), ("xid:", False),
    ("crash-worker", True), ("bogus", False), ("nan:1", False),
    ("slow:3", True), ("slow:1.5", True), ("slow:0.5", False), ("slow:101", False), ("slow:x", False), ("slow", False),
])
def test_inject_accepts_known_faults_only(fault, ok):
    assert valid_fault(fault) is ok


def test_store_prefix_is_per_generation_and_not_guessable(tmp_path):
    """Generation fencing: a generation's rendezvous prefix is known only through the master's directives, so
    an old generation's worker cannot compute a newer one's; every directive carries the current one."""
    a = Master(MasterConfig.build(run_dir=tmp_path / "a", nnodes=1, nproc_per_node=1), auth.new_secret())
    b = Master(MasterConfig.build(run_dir=tmp_path / "b", nnodes=1, nproc_per_node=1), auth.new_secret())
    assert a.store_prefix(4) == a.store_prefix(4) != a.store_prefix(5)
    assert a.store_prefix(4) != b.store_prefix(4)       # not a function of the generation number alone
    assert a.store_prefix(4).startswith("/phoenixrun/gen4-")
    with a.cv:
        a.generation = 4
        a.orders.direct(["x"], Quiesce())
    assert json.loads(a.directives.get("x").body)["store_prefix"] == a.store_prefix(4)
    a.events.close()
    b.events.close()


def test_a_burst_of_node_losses_during_recovery_is_one_cascade(tmp_path):
    """A rack going down mid-recovery: every loss already queued joins the same new cycle (one cascade, not one
    per node, which would use up the retry budget on one correlated failure); other reports stay queued."""
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=4, nproc_per_node=1), auth.new_secret())
    m.store_port = 0
    for nid in ("a", "b", "c", "d", "spare"):
        _register(m, nid)
    while not m._inbox.empty():
        m._inbox.get_nowait()
    for nid in ("b", "c"):
        m._inbox.put(reports.NodeLost(node_id=nid, detail="no heartbeat for 5.1s"))
    m._inbox.put(reports.WorkerExit(node_id="a", rank=0, returncode=1))
    m._inbox.put(reports.Left(node_id="d"))
    m._inbox.put(reports.NodeLost(node_id="spare", detail="no heartbeat for 5.1s"))
    lost: set[int] = set()
    with pytest.raises(Cascade, match="2 more queued node losses"):
        m._pump(0.1, lost)
    assert lost == {m.nodes[n].slot for n in ("b", "c", "d")}
    assert isinstance(m._inbox.get_nowait(), reports.WorkerExit) and m._inbox.empty()
    assert m.nodes["spare"].role == Role.FAILED                # a lost spare taken with them is never promoted
    m.events.close()
    detected = [e["node"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "fault_detected"]
    assert sorted(detected) == ["b", "c", "d"]

"""The protocol against a real Master over HTTP: each outcome has its own status code (callers read the
code, not an error string), and the control client's injected gate drops calls like a partition."""
from __future__ import annotations

import threading
import time

import pytest

from phoenixrun import auth
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.protocol import Endpoint, ReportKind, Status
from phoenixrun.protocol.client import ControlClient, ControlError


@pytest.fixture
def running(tmp_path):
    """A started Master with both slots taken by registrations made here: the job is running."""
    secret = auth.new_secret()
    master = Master(MasterConfig.build(run_dir=tmp_path, nnodes=2, nproc_per_node=1, node_timeout=1e6), secret)
    master.start()
    client = ControlClient(master.endpoint, secret)
    tokens = {}
    for i in range(2):
        reply = client.post(Endpoint.REGISTER, {"node_id": f"n{i}", "host": "127.0.0.1", "agent_pid": 100 + i,
                                                "peer_addr": f"127.0.0.1:{2000 + i}", "nproc_per_node": 1})
        tokens[f"n{i}"] = reply["token"]
    deadline = time.time() + 60
    while master.phase.value != "running" and time.time() < deadline:
        time.sleep(0.02)
    assert master.phase.value == "running"
    yield master, secret, tokens, client
    master._finish(0, "test over")
    master.http.shutdown()


def test_each_outcome_has_its_status_code(running):
    master, secret, tokens, client = running
    t0 = tokens["n0"]
    cases = [   # path, body, status, reason, counted as a rejection
        (Endpoint.HEARTBEAT, {"node_id": "ghost"}, Status.UNKNOWN_NODE, "unknown_node", False),
        (Endpoint.REPORT, {"node_id": "ghost", "kind": ReportKind.LEFT}, Status.UNKNOWN_NODE, "unknown_node", False),
        (Endpoint.HEARTBEAT, {"node_id": "n0", "token": tokens["n1"]}, Status.WRONG_TOKEN, "wrong_token", True),
        (Endpoint.REPORT, {"node_id": "n0", "token": t0, "kind": ReportKind.LEFT, "generation": 99},
         Status.CONFLICT, "generation_not_issued", True),
        (Endpoint.REPORT, {"node_id": "n0", "token": t0, "kind": "no_such_kind"}, Status.BAD_REQUEST, "invalid", True),
        ("/v1/nothing", {}, Status.NO_SUCH_ENDPOINT, None, False),
    ]
    for path, body, status, reason, counted in cases:
        before = master.state()["rejected_requests"]["total"]
        with pytest.raises(ControlError) as e:
            client.post(path, body)
        assert e.value.status == status and e.value.reason == reason, (path, body, e.value)
        assert e.value.refused is (status != Status.UNKNOWN_NODE)
        assert e.value.unknown_node is (status == Status.UNKNOWN_NODE)
        assert master.state()["rejected_requests"]["total"] == before + counted, (path, body)
    # what an agent does on UNKNOWN_NODE: register (here a new node id: the job has its nodes, so a spare),
    # then the same call goes through
    reg = client.post(Endpoint.REGISTER, {"node_id": "ghost", "host": "127.0.0.1", "agent_pid": 7,
                                          "peer_addr": "127.0.0.1:2007", "nproc_per_node": 1})
    assert client.post(Endpoint.HEARTBEAT, {"node_id": "ghost", "token": reg["token"]})["ok"]


def test_the_gate_drops_calls_before_and_replies_in_flight(running):
    master, secret, tokens, _ = running
    cut = threading.Event()
    calls = []

    def gate() -> str | None:
        calls.append(cut.is_set())
        return "network partitioned (test)" if cut.is_set() else None

    client = ControlClient(master.endpoint, secret, gate=gate)
    hb = {"node_id": "n0", "token": tokens["n0"], "worker_pids": [4242]}
    assert client.post(Endpoint.HEARTBEAT, hb)["ok"] and calls == [False, False]
    assert master.nodes["n0"].worker_pids == [4242]

    cut.set()     # cut: nothing goes out
    with pytest.raises(ControlError, match="network partitioned") as e:
        client.post(Endpoint.HEARTBEAT, {**hb, "worker_pids": [1]})
    assert e.value.status is None and not e.value.refused
    assert master.nodes["n0"].worker_pids == [4242]      # the master never heard it

    # a cut that begins while the call is in flight: the master took it, the reply is lost
    cut.clear()
    state = iter([None, "network partitioned (test)"])
    client.gate = lambda: next(state)
    with pytest.raises(ControlError, match="network partitioned"):
        client.post(Endpoint.HEARTBEAT, {**hb, "worker_pids": [5]})
    assert master.nodes["n0"].worker_pids == [5]

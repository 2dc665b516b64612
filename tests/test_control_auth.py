"""The master authenticates every caller and rejects malformed messages without acting on them."""
import json
import os
import stat
import time
import urllib.error
import urllib.request

import pytest

from phoenixrun import auth
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.control.events import read_events
from phoenixrun.control.master import Master, MasterConfig


@pytest.fixture
def master(tmp_path):
    secret = auth.new_secret()
    auth.write_secret(tmp_path, secret)
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=2, nproc_per_node=1), secret)
    m.start()
    yield m, secret
    m._finish(0, "test over")
    m.http.shutdown()


def _post(endpoint, path, body: bytes, token=None):
    req = urllib.request.Request(f"http://{endpoint}{path}", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_secret_file_is_private(tmp_path):
    p = auth.write_secret(tmp_path, "s3cret")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert auth.read_secret(run_dir=tmp_path) == "s3cret"


def test_unauthenticated_and_wrong_secret_rejected(master, tmp_path):
    m, secret = master
    reg = json.dumps({"node_id": "n1", "host": "h", "agent_pid": 1, "peer_addr": "h:1"}).encode()
    assert _post(m.endpoint, "/v1/register", reg)[0] == 401
    assert _post(m.endpoint, "/v1/register", reg, token="wrong")[0] == 401
    with pytest.raises(ControlError, match="401"):
        ControlClient(m.endpoint, "wrong").get_json("/v1/state")
    assert m.nodes == {}                                  # nothing was acted on
    # counted, and one event per peer and reason per interval (not one per refusal)
    rejected = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "rejected_request"]
    assert len(rejected) == 1 and rejected[0]["reason"] == "unauthorized" and rejected[0]["count"] == 1
    state = ControlClient(m.endpoint, secret).get_json("/v1/state")
    assert state["rejected_requests"] == {"total": 3, "by_reason": {"unauthorized": 3}}
    assert 'phoenixrun_rejected_requests_total{reason="unauthorized"} 3' in \
        ControlClient(m.endpoint, secret).get_text("/metrics")


def test_malformed_rejected_and_valid_accepted(master, tmp_path):
    m, secret = master
    assert _post(m.endpoint, "/v1/register", b"not json", token=secret)[0] == 400
    assert _post(m.endpoint, "/v1/register", b"[1, 2]", token=secret)[0] == 400
    assert _post(m.endpoint, "/v1/register", b'{"host": "h"}', token=secret)[0] == 400   # missing fields
    assert m.nodes == {}
    code, body = _post(m.endpoint, "/v1/register",
                       json.dumps({"node_id": "n1", "host": "h", "agent_pid": 1, "peer_addr": "h:1"}).encode(), secret)
    assert code == 200 and body["role"] == "active" and body["slot"] == 0
    state = ControlClient(m.endpoint, secret).get_json("/v1/state")
    assert [n["node_id"] for n in state["nodes"]] == ["n1"]
    assert "phoenixrun_nodes" in ControlClient(m.endpoint, secret).get_text("/metrics")


# ------------------------------------------------------------------ a node's registration cannot be taken
MAX_GEN = 2 ** 31 - 1
FORGED_REJOIN = {"role": "spare", "slot": None, "generation": MAX_GEN}     # the issue's


def _agent(i: int) -> dict:
    """What a real agent registers with (agents/agent.py): its own nonce included."""
    return {"node_id": f"n{i}", "host": "127.0.0.1", "agent_pid": 100 + i, "peer_addr": f"127.0.0.1:{2000 + i}",
            "fault_domain": f"n{i}", "nproc_per_node": 1, "nonce": f"{i:02d}" + "ab" * 15}


def _started(run_dir, secret) -> Master:
    m = Master(MasterConfig.build(run_dir=run_dir, nnodes=2, nproc_per_node=1, node_timeout=1e6), secret)
    m.start()
    return m


def _running(m: Master, client: ControlClient, n: int = 3) -> dict[str, str]:
    tokens = {f"n{i}": client.post("/v1/register", _agent(i))["token"] for i in range(n)}
    deadline = time.time() + 60
    while m.phase.value != "running" and time.time() < deadline:
        time.sleep(0.02)
    assert m.phase.value == "running"
    return tokens


def test_a_nodes_token_cannot_be_taken_with_what_the_state_api_shows(tmp_path):
    """Issue 31 item 1: re-registering with the node_id, host, agent_pid and peer_addr that GET /v1/state
    publishes returned the node's live token; with it, forged workers_done reports ended a job early."""
    secret = auth.new_secret()
    m = _started(tmp_path, secret)
    try:
        client = ControlClient(m.endpoint, secret)
        tokens = _running(m, client)
        shown = client.get_text("/v1/state")
        for i, token in enumerate(tokens.values()):    # neither the nonces nor the tokens are served
            assert _agent(i)["nonce"] not in shown and token not in shown
        assert "nonce" not in shown
        state = json.loads(shown)
        for n in state["nodes"]:
            published = {k: n[k] for k in ("node_id", "host", "agent_pid", "peer_addr", "fault_domain")}
            for body in (published, {**published, "nproc_per_node": 1}, {**published, "nonce": "0" * 32}):
                code, reply = _post(m.endpoint, "/v1/register", json.dumps(body).encode(), secret)
                assert code == 403 and reply["reason"] == "wrong_nonce", (body, code, reply)
                assert "token" not in reply and "nonce" in reply["error"]
        # without a token, no report is taken: the job runs on
        for s, nid in m.slots.items():
            code, reply = _post(m.endpoint, "/v1/report", json.dumps(
                {"node_id": nid, "kind": "workers_done", "generation": 0, "slot": s}).encode(), secret)
            assert code == 403, reply
        assert m.phase.value == "running" and m.exit_code is None and not m.done_nodes
        # the agent itself, retrying with its nonce (its reply was lost), still gets its answer
        again = client.post("/v1/register", _agent(1))
        assert again["slot"] == 1 and again["token"] == tokens["n1"]
    finally:
        m._finish(0, "test over")
        m.http.shutdown()


def test_a_fresh_master_refuses_a_forged_rejoin(tmp_path):
    """Issue 31 item 2, a master that never restarted: the forged rejoin was answered 200, and the real agents
    were then admitted as spares."""
    secret = auth.new_secret()
    m = _started(tmp_path, secret)
    try:
        body = {**_agent(7), "node_id": "intruder", "rejoin": FORGED_REJOIN}
        code, reply = _post(m.endpoint, "/v1/register", json.dumps(body).encode(), secret)
        assert code == 409 and reply["reason"] == "not_restarted" and "did not take over" in reply["error"]
        assert m.nodes == {} and m.generation == 0 and m.resumed_at is None
        # the real agents still get their slots
        client = ControlClient(m.endpoint, secret)
        assert [client.post("/v1/register", _agent(i))["slot"] for i in range(2)] == [0, 1]
    finally:
        m._finish(0, "test over")
        m.http.shutdown()


def test_a_restarted_master_refuses_rejoins_the_run_directory_does_not_vouch_for(tmp_path):
    """Issue 31 item 2, a restarted master: a forged rejoin made the job's generation 2147483647, after which
    every real report was discarded as stale. A rejoin needs the agent's nonce, a generation some master issued
    and the slot the run directory gives that node."""
    secret = auth.new_secret()
    first = _started(tmp_path, secret)
    client = ControlClient(first.endpoint, secret)
    _running(first, client)                          # n0, n1 active; n2 a spare; generation 0
    first.http.shutdown()                            # the first master is gone (no job_finished)
    m = _started(tmp_path, secret)
    try:
        def post(body):
            return _post(m.endpoint, "/v1/register", json.dumps(body).encode(), secret)

        published = {k: v for k, v in _agent(2).items() if k != "nonce"}
        forged = [
            ({**_agent(7), "node_id": "intruder", "rejoin": FORGED_REJOIN}, 403, "wrong_nonce"),
            ({**published, "rejoin": FORGED_REJOIN}, 403, "wrong_nonce"),
            ({**published, "nonce": "0" * 32, "rejoin": {**FORGED_REJOIN, "generation": 0}}, 403, "wrong_nonce"),
            ({**_agent(2), "rejoin": FORGED_REJOIN}, 409, "generation_not_issued"),
            ({**_agent(2), "rejoin": {"role": "active", "slot": 1, "generation": 1}}, 409, "generation_not_issued"),
        ]
        for body, code, reason in forged:
            got, reply = post(body)
            assert (got, reply.get("reason")) == (code, reason), (body, got, reply)
        assert m.nodes == {} and m.generation == 0 and m.resumed_at is None
        # a node of the run claiming another node's slot is fenced, not given it
        got, reply = post({**_agent(2), "rejoin": {"role": "active", "slot": 0, "generation": 0}})
        assert got == 200 and reply["role"] == "failed" and "given to n0" in reply["reason"]
        # the real agents rejoin as they were
        for i, (role, slot) in enumerate([("active", 0), ("active", 1)]):
            got, reply = post({**_agent(i), "rejoin": {"role": role, "slot": slot, "generation": 0}})
            assert got == 200 and reply["slot"] == slot and reply["token"], reply
        assert m.slots == {0: "n0", 1: "n1"} and m.generation == 0
        shown = ControlClient(m.endpoint, secret).get_text("/v1/state")
        assert not any(_agent(i)["nonce"] in shown for i in range(3))
    finally:
        m._finish(0, "test over")
        m.http.shutdown()
        first._finish(0, "test over")

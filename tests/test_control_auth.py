"""The master authenticates every caller and rejects malformed messages without acting on them."""
import json
import os
import stat
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
    m = Master(MasterConfig(run_dir=tmp_path, nnodes=2, nproc_per_node=1), secret)
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

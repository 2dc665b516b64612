"""Fixtures more than one test module uses."""
from __future__ import annotations

import pytest

from phoenixrun import auth
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.protocol.client import ControlClient


@pytest.fixture
def three_node_master(tmp_path):
    """A real master with nodes n1-n3 registered: (master, a client, node id -> its token). n1 plays the relay in
    the relayed acks and heartbeats tests."""
    secret = auth.new_secret()
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=3, nproc_per_node=1, node_timeout=1e6), secret)
    m.start()
    client = ControlClient(m.endpoint, secret)
    tokens = {}
    for i in range(1, 4):
        reply = client.post("/v1/register", {"node_id": f"n{i}", "host": "127.0.0.1", "agent_pid": 1,
                                              "peer_addr": f"127.0.0.1:{i}"})
        tokens[f"n{i}"] = reply["token"]
    yield m, client, tokens
    m._finish(0, "test over")
    m.http.shutdown()

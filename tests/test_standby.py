"""A standby master's fencing, without a cluster: a master that lost its lease stops acting; every order and reply
names the master's epoch; an agent listens only to the newest epoch it has seen and moves on to the next endpoint
when one cannot be reached. (The takeover on a real Slurm: tests/test_slurm.py; the lease table: test_lease.py.)"""
import json
import socket

import pytest

from phoenixrun import auth
from phoenixrun.agents.master_link import MasterLink
from phoenixrun.agents.node import Lifecycle, NodeState
from phoenixrun.control.lease import LeaseDir
from phoenixrun.control.master import EXIT_DEPOSED, Master, MasterConfig
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.status import render


def render_text(state: dict) -> str:
    """What `phoenixrun status` prints for this state."""
    import io
    from rich.console import Console
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(state))
    return console.export_text()


def test_a_master_that_lost_its_lease_stops_acting(tmp_path):
    secret = auth.new_secret()
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=1, nproc_per_node=1, lease_ttl=30), secret)
    m.start()
    client = ControlClient(m.endpoint, secret, timeout=5)
    LeaseDir(tmp_path).announce("b", {"endpoint": "hostB:29500", "pid": 1, "since": 0})   # a standby waits
    state = client.get_json("/v1/state")
    assert state["master_epoch"] == 1 and state["standbys"][0]["endpoint"] == "hostB:29500"
    shown = render_text(state)
    assert "epoch 1, standby hostB:29500" in shown, shown
    assert json.loads((tmp_path / "master.json").read_text())["epoch"] == 1
    assert m.keeper.renew() is True                        # still the holder
    assert LeaseDir(tmp_path).claim(2, "standby", "elsewhere:1")   # a standby took over (this one was paused)
    assert m.keeper.renew() is False                       # the next renewal sees it
    assert m.wait() == EXIT_DEPOSED
    with pytest.raises(ControlError):
        client.get_json("/v1/state")                       # it answers nobody any more
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    deposed = [e for e in events if e["event"] == "master_deposed"]
    assert deposed and deposed[0]["epoch"] == 1 and "epoch 2" in deposed[0]["reason"]
    assert not LeaseDir(tmp_path).read()[0].finished       # a deposed master does not end the job for the standby


def test_orders_and_replies_carry_the_epoch(tmp_path):
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=1, nproc_per_node=1), auth.new_secret())
    m.store_port = 0
    m.job.master_epoch = 7
    reply = m.register({"node_id": "a", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9"})
    assert reply["master_epoch"] == 7
    assert m.heartbeat({"node_id": "a", "token": reply["token"]})["master_epoch"] == 7
    m.register({"node_id": "b", "host": "127.0.0.1", "agent_pid": 2, "peer_addr": "127.0.0.1:8"})
    assert m.directives.get("b").decoded().master_epoch == 7       # a spare's wait order
    m.events.close()


class _Client:
    base = "http://test:1"

    def __init__(self):
        self.moved = 0

    def move_on(self):
        self.moved += 1


# (epoch seen before, the reply's, listened to, epoch seen after, moved on, version reset)
EPOCHS = [
    (0, None, True, 0, 0, False),      # masters without a lease (and an expired poll's noop) name none
    (2, None, True, 2, 0, False),
    (0, 0, True, 0, 0, False),
    (1, 1, True, 1, 0, False),
    (1, 2, True, 2, 0, True),          # a standby took over: its directive versions are its own
    (0, 1, True, 1, 0, True),
    (2, 1, False, 2, 1, False),        # a deposed master, resumed: not listened to, try the next endpoint
    (2, "2", False, 2, 1, False),      # not an epoch
]


@pytest.mark.parametrize("seen,epoch,listened,after,moved,reset", EPOCHS)
def test_agents_listen_to_the_newest_epoch(seen, epoch, listened, after, moved, reset):
    client = _Client()
    link = MasterLink(NodeState("n", 1), Lifecycle(), client, {}, 0.5, dict, dict, lambda f: None)
    link.epoch, link._version = seen, 41
    reply = {} if epoch is None else {"master_epoch": epoch}
    assert link.current_master(reply) is listened
    assert (link.epoch, client.moved, link._version == -1) == (after, moved, reset)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_moves_on_to_the_next_endpoint_when_one_is_unreachable():
    a, b = _closed_port(), _closed_port()
    client = ControlClient(f"127.0.0.1:{a},127.0.0.1:{b}", "s", timeout=2)
    assert client.port == a
    with pytest.raises(ControlError, match=f":{a}"):
        client.post("/v1/heartbeat", {})
    assert client.port == b
    with pytest.raises(ControlError, match=f":{b}"):
        client.post("/v1/heartbeat", {})
    assert client.port == a
    one = ControlClient(f"127.0.0.1:{a}", "s", timeout=2)
    with pytest.raises(ControlError):
        one.post("/v1/heartbeat", {})
    assert one.port == a

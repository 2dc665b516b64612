"""protocol/figures.py and protocol/reshard.py: the payloads that travelled as free dicts inside typed messages
(a rank's protection figures in every heartbeat, a shrink or grow's part of a restart order and of a worker's
assignment) are types now - the wire round-trips them, decoding ignores names it does not know and refuses a
wrong type naming the field."""
from __future__ import annotations

import json

import pytest

from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol.directives import Assignment
from phoenixrun.protocol.figures import COUNTS, FIELDS, SECONDS, Figures
from phoenixrun.protocol.messages import Heartbeat, Job, MessageError, Register, Rejoin, parse_heartbeat, parse_register
from phoenixrun.protocol.reshard import Image, NodeReshard, WorkerReshard


JOB = Job(nnodes=2, nproc_per_node=2, world_size=4)


def _wire(obj):
    return json.loads(json.dumps(obj.to_wire()))


def test_figures_round_trip_and_leave_unmeasured_ones_off_the_wire():
    full = Figures(**{f: (i + 0.5 if f in SECONDS else i) for i, f in enumerate(FIELDS)})
    assert Figures.from_wire(_wire(full)) == full
    assert Figures().to_wire() == {} and Figures(every=2).to_wire() == {"every": 2}
    assert Figures.from_wire({"h2h_s": 1, "snap_s": 9.0}) == Figures(h2h_s=1.0)     # an int is a number; unknown: ignored
    assert type(Figures.from_wire({"h2h_s": 1}).h2h_s) is float


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("bad", ["1", [1], None, True])
def test_a_duration_that_is_not_a_number_is_refused_by_name(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be a number"):
        Figures.from_wire({name: bad})


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_a_count_that_is_not_a_non_negative_integer_is_refused_by_name(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be a non-negative integer"):
        Figures.from_wire({name: bad})


def test_committed_adds_the_agents_figures_to_the_workers():
    w = Figures(d2h_s=0.02, compute_s=0.3, every=1)
    assert w.committed(7, 0.01, 100, 200) == Figures(d2h_s=0.02, compute_s=0.3, every=1, committed_step=7,
                                                     h2h_s=0.01, replicated_bytes=100, replica_store_bytes=200)


def test_the_heartbeat_carries_figures_and_a_written_message_too():
    hb = parse_heartbeat({"node_id": "n", "protection": {"0": {"compute_s": 0.25, "committed_step": 3}}}, JOB)
    assert hb.protection == {0: Figures(compute_s=0.25, committed_step=3)}
    with pytest.raises(MessageError, match=r"protection\[0\]\.stall_s must be a number, got 'x'"):
        parse_heartbeat({"node_id": "n", "protection": {"0": {"stall_s": "x"}}}, JOB)
    m = wm.Written(slot=1, step=4, stats=Figures(d2h_s=0.5, slot_bytes=10))
    assert wm.decode(_wire(m)) == m


def test_a_node_reshard_round_trips_int_keyed_through_a_directive():
    r = NodeReshard("shrink", 6, 8, (Image(4, True, 0), Image(2, False, 1)), {2: 4, 3: 2})
    a = Assignment(slot=1, reshard=r, nnodes=2)
    assert Assignment.from_wire(_wire(a)) == a
    assert _wire(a)["reshard"]["predecessor"] == {"2": 4, "3": 2}             # JSON's string keys on the wire


@pytest.mark.parametrize("wire, match", [
    ({"kind": "split", "old_world": 6, "step": 8}, "kind shrink or grow"),
    ({"kind": "grow", "old_world": -1, "step": 8}, r"reshard\.old_world must be a non-negative integer"),
    ({"kind": "grow", "old_world": 6}, r"reshard\.step"),
    ({"kind": "grow", "old_world": 6, "step": 8, "images": {"a": 1}}, r"reshard\.images must be a list"),
    ({"kind": "grow", "old_world": 6, "step": 8, "images": [{"old_rank": 1, "own": "yes", "reader": 0}]},
     "each image must be"),
    ({"kind": "grow", "old_world": 6, "step": 8, "predecessor": {"x": 1}}, "is not a slot or rank number"),
    ({"kind": "grow", "old_world": 6, "step": 8, "predecessor": {"1": "2"}}, r"predecessor\[1\] must be a rank"),
    ([1], "must be an object"),
])
def test_a_malformed_node_reshard_is_refused_by_name(wire, match):
    with pytest.raises(ValueError, match=match):
        NodeReshard.from_wire(wire)


def test_a_worker_reshard_round_trips_and_refuses_what_is_not_one():
    w = WorkerReshard(6, 4, {4: "/dev/shm/a", 2: "/dev/shm/c"})
    assert WorkerReshard.from_wire(_wire(w)) == w and WorkerReshard.from_wire(_wire(WorkerReshard(3))).predecessor is None
    with pytest.raises(ValueError, match="predecessor must be a rank or null"):
        WorkerReshard.from_wire({"old_world": 6, "predecessor": "4"})
    with pytest.raises(ValueError, match="map old ranks to file paths"):
        WorkerReshard.from_wire({"old_world": 6, "images": {"4": 7}})


def test_what_an_agent_sends_parses_back_to_the_type_it_built():
    """The agent builds its heartbeat, registration and rejoin as the types the master parses them into
    (agents/agent.py): through JSON and the master's parser each comes back equal."""
    hb = Heartbeat(node_id="n1", token="t" * 32, worker_pids=[11, 12], snapshots={0: [3, 4], 1: [4]},
                   replicas={2: [4]}, protection={0: Figures(every=1, committed_step=4)}, api=True, warm_ready=False)
    assert parse_heartbeat(_wire(hb), JOB) == hb
    spare = Heartbeat(node_id="n9", token=None, worker_pids=[], snapshots={}, replicas={}, protection={}, api=False,
                      warm_ready=True)
    assert parse_heartbeat(_wire(spare), JOB) == spare
    rejoin = Rejoin(role="active", slot=1, generation=3, restart_count=1, api=True, frozen=False,
                    snapshots={2: [7]}, replicas={0: [7]}, world_slots={0: "10.0.0.1:7000", 1: "10.0.0.2:7000"})
    for reg in (Register(node_id="n1", host="h1", agent_pid=42, peer_addr="10.0.0.2:7000", fault_domain="rack1",
                         nonce="a" * 32, nproc_per_node=2, node_rank=1),
                Register(node_id="n1", host="h1", agent_pid=42, peer_addr="10.0.0.2:7000", fault_domain="rack1",
                         nonce="a" * 32, nproc_per_node=2, rejoin=rejoin)):
        assert parse_register(_wire(reg), JOB) == reg

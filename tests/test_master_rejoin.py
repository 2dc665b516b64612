"""A restarted master rebuilds the job from the agents' rejoin registrations (handlers called directly,
no processes): slots, roles and generation come back, and of two agents claiming one slot the one that
missed a recovery while away is fenced."""
from phoenixrun import auth
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.control.state import Role


def _master(tmp_path) -> Master:
    m = Master(MasterConfig(run_dir=tmp_path, nnodes=2, nproc_per_node=1), auth.new_secret())
    m.store_port = 0          # not started: no store, no HTTP
    return m


def _rejoin(m: Master, nid: str, role: str, slot, generation: int) -> dict:
    return m.register({"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": f"127.0.0.1:{slot or 9}",
                       "rejoin": {"role": role, "slot": slot, "generation": generation, "restart_count": 1,
                                  "api": True, "snapshots": {"0": [41, 42]}, "world": {}}})


def test_rejoins_rebuild_slots_roles_and_generation(tmp_path):
    m = _master(tmp_path)
    assert _rejoin(m, "a", "active", 0, 4)["role"] == "active"
    assert _rejoin(m, "b", "active", 1, 4)["slot"] == 1
    assert _rejoin(m, "s", "spare", None, 4)["role"] == "spare"
    assert m.slots == {0: "a", 1: "b"} and m.nodes["s"].role == Role.SPARE
    assert m.generation == 4 and m.restart_count == 1 and m.resumed_at is not None
    assert m.nodes["a"].snapshots == {0: [41, 42]}
    # a brand-new node arriving now is a spare, never a slot owner, even though the master just started
    fresh = m.register({"node_id": "new", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:7"})
    assert fresh["role"] == "spare"
    m.events.close()


def test_of_two_claims_on_one_slot_the_older_generation_is_fenced(tmp_path):
    m = _master(tmp_path)
    _rejoin(m, "stale", "active", 1, 2)       # healed partition: replaced in generation 3, got here first
    _rejoin(m, "a", "active", 0, 3)
    assert _rejoin(m, "spare-now-1", "active", 1, 3)["slot"] == 1
    assert m.slots == {0: "a", 1: "spare-now-1"} and m.nodes["stale"].role == Role.FAILED
    assert m.heartbeat({"node_id": "stale"})["command"] == "stop"      # its agent stops at its next call
    # the other way round: a claim older than the holder's is refused
    assert _rejoin(m, "older", "active", 0, 1)["role"] == "failed"
    assert m.slots[0] == "a"
    m.events.close()

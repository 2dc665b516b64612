"""A restarted master rebuilds the job from the agents' rejoin registrations (handlers called directly, no
processes): slots, roles and generation come back, and of two agents claiming one slot the one that missed a
recovery while away is fenced. Rejoins are taken only as the run directory's roster vouches for them
(control/roster.py): never by a master that did not take over a running job, never from a caller without the
agent's nonce, never with a generation no master issued or a slot the roster gives another node."""
import json

import pytest

from phoenixrun import auth
from phoenixrun.control import roster
from phoenixrun.control.master import Master, MasterConfig
from phoenixrun.control.state import Role
from phoenixrun.protocol.directives import Run
from phoenixrun.protocol.messages import MessageError

MAX_GEN = 2 ** 31 - 1


def _master(tmp_path, nnodes=2) -> Master:
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=nnodes, nproc_per_node=1), auth.new_secret())
    m.store_port = 0          # not started: no store, no HTTP
    return m


def nonce(nid: str) -> str:
    return f"{nid}-nonce-0123456789abcdef"


def _register(m: Master, nid: str, node_rank=None) -> dict:
    body = {"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9", "nonce": nonce(nid)}
    if node_rank is not None:
        body["node_rank"] = node_rank
    return m.register(body)


def _previous_master(tmp_path, slots: dict[int, str], spares=(), generation=0, nnodes=2) -> None:
    """A master that ran this job before the one under test (its agents registered with their nonces, it issued
    `generation`), then died: what it leaves is the run directory's roster."""
    m = _master(tmp_path, nnodes)
    for s, nid in sorted(slots.items()):
        assert _register(m, nid, node_rank=s)["slot"] == s
    for nid in spares:
        assert _register(m, nid, node_rank=nnodes + 10)["role"] == "spare"
    with m.cv:
        m.generation = generation
        m.orders.direct(list(m.slots.values()), Run())      # the roster is written before any order
    m.events.close()


def _rejoin(m: Master, nid: str, role: str, slot, generation: int, with_nonce=True) -> dict:
    body = {"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": f"127.0.0.1:{slot or 9}",
            "rejoin": {"role": role, "slot": slot, "generation": generation, "restart_count": 1,
                       "api": True, "snapshots": {"0": [41, 42]}, "world": {}}}
    if with_nonce:
        body["nonce"] = nonce(nid)
    return m.register(body)


def test_rejoins_rebuild_slots_roles_and_generation(tmp_path):
    _previous_master(tmp_path, {0: "a", 1: "b"}, spares=["s"], generation=4)
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
    # a rejoin retried (its reply was lost) gets the same answer, with its nonce only
    again = _rejoin(m, "a", "active", 0, 4)
    assert again["slot"] == 0 and again["token"] == m.job.members.tokens["a"]
    with pytest.raises(MessageError) as e:
        _rejoin(m, "a", "active", 0, 4, with_nonce=False)
    assert e.value.code == 403
    m.events.close()


def test_of_two_claims_on_one_slot_the_older_generation_is_fenced(tmp_path):
    # slot 1 was "stale"'s, then given to "spare-now-1" in generation 3 (a healed partition: "stale" got here first)
    _previous_master(tmp_path, {0: "a", 1: "stale"}, spares=["spare-now-1", "older"], generation=2)
    m0 = _master(tmp_path)
    with m0.cv:
        m0.job.members.roster.append(0, generation=3, slots={1: "spare-now-1"})
    m0.events.close()
    m = _master(tmp_path)
    reply = _rejoin(m, "stale", "active", 1, 2)
    assert reply["role"] == "failed" and "spare-now-1" in reply["reason"]
    assert _rejoin(m, "a", "active", 0, 3)["slot"] == 0
    assert _rejoin(m, "spare-now-1", "active", 1, 3)["slot"] == 1
    assert m.slots == {0: "a", 1: "spare-now-1"}
    # a claim on a slot the run directory gives another node is refused, whatever its generation says
    assert _rejoin(m, "older", "active", 0, 1)["role"] == "failed"
    assert m.slots[0] == "a"
    m.events.close()


def test_a_master_that_did_not_restart_refuses_every_rejoin(tmp_path):
    """The issue's forged rejoin on a fresh master: the real agents were then admitted as spares and the job
    failed before step 1."""
    m = _master(tmp_path)
    forged = {"node_id": "x", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
              "nonce": nonce("x"), "rejoin": {"role": "spare", "slot": None, "generation": MAX_GEN}}
    with pytest.raises(MessageError) as e:
        m.register(forged)
    assert e.value.code == 409 and e.value.reason == "not_restarted" and "did not take over" in str(e.value)
    assert m.nodes == {} and m.generation == 0 and m.resumed_at is None
    # a registration of the same node without the rejoin is an ordinary one: it gets slot 0
    assert _register(m, "a")["slot"] == 0
    m.events.close()


def test_a_restarted_master_takes_only_what_the_run_directory_vouches_for(tmp_path):
    """The issue's forged rejoin on a restarted master: the job's generation became 2147483647 and every real
    report was then discarded as stale."""
    _previous_master(tmp_path, {0: "a", 1: "b"}, spares=["s"], generation=5)
    m = _master(tmp_path)

    def refused(nid, role, slot, gen, with_nonce=True, body_nonce=None):
        body = {"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                "rejoin": {"role": role, "slot": slot, "generation": gen}}
        if with_nonce:
            body["nonce"] = body_nonce or nonce(nid)
        with pytest.raises(MessageError) as e:
            m.register(body)
        return e.value

    assert refused("intruder", "spare", None, MAX_GEN).code == 403                   # not in the roster
    assert refused("s", "spare", None, MAX_GEN, with_nonce=False).code == 403         # the spare's id, no nonce
    assert refused("s", "spare", None, 5, body_nonce="f" * 32).code == 403            # a wrong nonce
    assert refused("a", "active", 0, 5, with_nonce=False).code == 403                 # an active node's id
    e = refused("s", "spare", None, MAX_GEN)                                          # its nonce, a forged generation
    assert e.code == 409 and e.reason == "generation_not_issued" and "generation 5" in str(e)
    assert m.nodes == {} and m.generation == 0 and m.resumed_at is None               # nothing taken
    # with its nonce, its generation and its slot: taken
    assert _rejoin(m, "a", "active", 0, 5)["slot"] == 0
    assert _rejoin(m, "s", "spare", None, 3)["role"] == "spare"
    assert m.generation == 5
    m.events.close()


def test_rejoining_a_slot_of_another_node_is_fenced(tmp_path):
    _previous_master(tmp_path, {0: "a", 1: "b"}, spares=["s"], generation=2)
    m = _master(tmp_path)
    reply = _rejoin(m, "s", "active", 0, 2)              # the spare claims a's slot
    assert reply["role"] == "failed" and "given to a" in reply["reason"]
    assert m.slots == {} and "s" not in m.nodes
    assert _rejoin(m, "a", "active", 0, 2)["slot"] == 0
    m.events.close()


def test_nobody_rejoins_a_finished_job(tmp_path):
    _previous_master(tmp_path, {0: "a", 1: "b"}, generation=1)
    m0 = _master(tmp_path)
    with m0.cv:
        m0.job.members.roster.append(0, finished=True)          # what Coordinator.finish writes
    m0.events.close()
    m = _master(tmp_path)
    with pytest.raises(MessageError) as e:
        _rejoin(m, "a", "active", 0, 1)
    assert e.value.code == 409 and e.value.reason == "not_restarted"
    m.events.close()


def test_roster_lines_survive_a_cut_write_and_skip_a_deposed_masters(tmp_path):
    r = roster.Roster(tmp_path, "run")
    r.append(1, generation=2, slots={0: "a"}, nonces={"a": roster.digest("n" * 16)})
    with open(tmp_path / roster.NAME, "a") as f:
        f.write('\n{"epoch": 1, "slots": {"0": "cut sh')       # a master killed mid-write
    r.append(2)                                                   # a standby took over (epoch 2)
    r.append(2, slots={1: "b"})
    with open(tmp_path / roster.NAME, "a") as f:                  # the deposed holder wrote on after that
        f.write("\n" + json.dumps({"epoch": 1, "generation": 99, "slots": {"0": "evil"}}) + "\n")
    again = roster.Roster(tmp_path, "run")
    assert again.restarted and again.generation == 2 and again.slots == {0: "a", 1: "b"}
    assert again.vouches_nonce("a", "n" * 16) and not again.vouches_nonce("a", "m" * 16)
    assert "n" * 16 not in (tmp_path / roster.NAME).read_text()      # the digest is kept, never the nonce
    assert not roster.Roster(tmp_path, "another-run").restarted      # another run's roster vouches for nothing

"""The master's replies to registrations and heartbeats (protocol/replies.py): each decodes back into the type
the master built, the wire keeps the fields agents of every version read, and a field of the wrong type is
refused by name."""
import pytest

from phoenixrun.protocol.replies import (Admitted, Draining, Heard, HeartbeatReply, Injected, JobTerms, PersistTerms,
                                         RelayLink, TurnedAway, heartbeat_reply, registration_reply, report_reply)

TERMS = JobTerms(run_id="r1", store_port=29500, nnodes=4, nproc_per_node=2, tp=2, pp=1, max_restarts=3,
                 persist=PersistTerms(dir="/ckpt", every=50, keep=2, world_size=8))


@pytest.mark.parametrize("reply", [
    Admitted("active", 3, "tok", TERMS, master_epoch=2),
    Admitted("spare", None, "tok", JobTerms("r1", 1, 1, 1, 1, 1, 0), master_epoch=None),
    TurnedAway("node rank 1 is already taken", exit_code=2, master_epoch=1),
    TurnedAway("fenced: node n1 was declared lost", exit_code=0, fenced=True),
    TurnedAway("slot 1 belongs to n2"),
])
def test_a_registration_reply_decodes_to_what_the_master_built(reply):
    assert registration_reply(reply.to_wire()) == reply


@pytest.mark.parametrize("reply", [
    HeartbeatReply("active", ("hang",), RelayLink("10.0.0.2:7001", "n2", False), (("n3", "10.0.0.3:7001"),), 4),
    HeartbeatReply("spare"),
    HeartbeatReply("active", relay=RelayLink(None, None, True)),
    TurnedAway("fenced: node n1 was declared lost", exit_code=0, fenced=True, master_epoch=4),
])
def test_a_heartbeat_reply_decodes_to_what_the_master_built(reply):
    assert heartbeat_reply(reply.to_wire()) == reply


def test_the_wire_keeps_the_fields_agents_read():
    wire = Admitted("active", 0, "tok", TERMS, master_epoch=1).to_wire()
    assert {"role", "slot", "token", "run_id", "store_port", "nnodes", "nproc_per_node", "tp", "pp", "max_restarts",
            "persist", "master_epoch"} <= set(wire)
    assert wire["persist"] == {"dir": "/ckpt", "every": 50, "keep": 2, "world_size": 8}
    hb = HeartbeatReply("active", ("xid",), None, (("n1", "h:1"),), 3).to_wire()
    assert hb == {"ok": True, "role": "active", "inject": ["xid"], "master_epoch": 3, "watch": [["n1", "h:1"]]}
    fence = TurnedAway("fenced: gone", exit_code=0, fenced=True).to_wire()   # a directive poll reads it as a stop
    assert fence == {"role": "failed", "slot": None, "reason": "fenced: gone", "fenced": True, "command": "stop",
                     "exit_code": 0}


@pytest.mark.parametrize("field, value", [
    ("store_port", "29500"), ("nnodes", None), ("tp", True), ("token", 7), ("slot", "1"), ("run_id", 1),
    ("persist", "yes"), ("master_epoch", "2"), ("role", "boss"),
])
def test_a_registration_reply_field_of_the_wrong_type_is_named(field, value):
    wire = {**Admitted("active", 0, "tok", TERMS, master_epoch=1).to_wire(), field: value}
    with pytest.raises(ValueError, match=field):
        registration_reply(wire)


@pytest.mark.parametrize("wire, named", [
    ({"role": "active", "inject": "hang"}, "inject"),
    ({"role": "active", "watch": [["n1"]]}, "watch"),
    ({"role": "active", "relay": ["h:1"]}, "relay"),
    ({"role": "active", "relay": {"parent": 5}}, "parent"),
    ({"role": "active", "master_epoch": 1.5}, "master_epoch"),
])
def test_a_heartbeat_reply_it_cannot_read_is_refused_by_name(wire, named):
    with pytest.raises(ValueError, match=named):
        heartbeat_reply(wire)


@pytest.mark.parametrize("reply", [Heard(), Heard(ignored="stale generation 2 (now 3)"),
                                   TurnedAway("fenced: gone", exit_code=0, fenced=True)])
def test_a_report_reply_decodes_to_what_the_master_built(reply):
    assert report_reply(reply.to_wire()) == reply


@pytest.mark.parametrize("wire", [{}, {"ok": False}, {"ok": True, "ignored": 3}, []])
def test_a_report_reply_it_cannot_read_is_refused(wire):
    with pytest.raises(ValueError, match="report reply"):
        report_reply(wire)


@pytest.mark.parametrize("reply", [Injected("n3"), Draining("n1", 1)])
def test_an_operator_reply_decodes_to_what_the_master_built(reply):
    assert type(reply).from_wire(reply.to_wire()) == reply


@pytest.mark.parametrize("cls, wire, named", [
    (Injected, {"ok": True}, "node"), (Injected, [], "object"),
    (Draining, {"ok": True, "node": "n1"}, "slot"), (Draining, {"node": "n1", "slot": "1"}, "slot"),
])
def test_an_operator_reply_it_cannot_read_is_refused_by_name(cls, wire, named):
    with pytest.raises(ValueError, match=named):
        cls.from_wire(wire)

"""The protocol's names are its wire: every member round-trips as exactly its string, and the sets are frozen.

A newcomer adding a command, report kind, op or event updates the frozen set here on purpose (and the
other end of the wire, and docs/architecture.md / docs/operations.md where the name is documented)."""
from __future__ import annotations

import json

import pytest

from phoenixrun.control import wire
from phoenixrun.protocol import REPORT_KINDS, Command, Endpoint, Event, PeerOp, ReportKind, WorkerOp
from phoenixrun.protocol.client import ControlError
from phoenixrun.protocol import directives
from phoenixrun.protocol.codec import int_keys
from phoenixrun.protocol.restore import RankSource
from phoenixrun.protocol.status import REASON_PHRASES, Status, refused

FROZEN = {
    Command: {"noop", "wait", "run", "restart", "quiesce", "restore", "stop"},
    ReportKind: {"left", "workers_done", "worker_exit", "worker_hang", "restore_failed", "restore_refused", "resumed", "quiesced",
                 "comm_error", "nan_loss", "worker_error", "protection_mode", "health", "layout", "drain", "suspect",
                 "joined", "node_lost", "attempt_check"},
    WorkerOp: {"hello", "alloc", "slots", "write", "written", "progress", "pong", "quiesced", "resumed",
               "comm_error", "nan_loss", "error", "protection_mode", "layout", "reply", "assign", "rebuild",
               "quiesce", "committed", "commit_failed", "ping", "abort_comm", "poison_loss", "slow", "agent_gone"},
    PeerOp: {"put", "get_private", "get_shared", "ping"},
    Event: {"master_started", "master_recovered", "master_stalled", "master_standby", "master_takeover", "master_deposed",
            "node_joined", "node_rejoined",
            "node_refused", "node_fenced", "spare_lost", "spare_promoted", "job_started", "job_finished",
            "directive_sent", "fault_injected", "fault_detected", "protection_mode", "recovery_started",
            "recovery_plan", "recovery_done", "recovery_failed", "restore_refused", "restart", "fallback_restart", "fallback_done",
            "checkpoint_rejected", "rejected_request", "drain_requested", "straggler", "job_shrunk", "job_grown"},
    Endpoint: {"/v1/register", "/v1/heartbeat", "/v1/report", "/v1/reports", "/v1/heartbeats", "/v1/directive",
               "/v1/inject", "/v1/drain", "/v1/state", "/metrics"},
}


@pytest.mark.parametrize("enum", list(FROZEN), ids=lambda e: e.__name__)
def test_the_set_of_names_is_frozen(enum):
    assert {m.value for m in enum} == FROZEN[enum], \
        f"{enum.__name__} changed: update FROZEN in this test deliberately (and the other end of the wire)"


@pytest.mark.parametrize("member", [m for enum in FROZEN for m in enum], ids=lambda m: f"{type(m).__name__}.{m.name}")
def test_every_member_round_trips_as_its_plain_string(member):
    enum, s = type(member), member.value
    assert member == s and hash(member) == hash(s) and str(member) == s and f"{member}" == s
    assert enum(s) is member                       # what a receiver does with the string it read
    assert json.dumps({"k": member}) == json.dumps({"k": s})
    assert wire.dumps({"k": member}) == wire.dumps({"k": s})     # orjson where installed: byte-identical too
    back = wire.loads(wire.dumps({"k": member}))["k"]
    assert type(back) is str and enum(back) is member


def test_unknown_names_are_refused():
    for enum in FROZEN:
        with pytest.raises(ValueError):
            enum("no_such_name")


def test_report_kinds_on_the_wire_are_the_agent_sent_ones():
    # the master queues joined / node_lost / attempt_check itself: a report claiming one is refused
    assert set(REPORT_KINDS) == FROZEN[ReportKind] - {"joined", "node_lost", "attempt_check"}
    # a stale generation makes a report about workers moot; one about the node or a recovery ack is not
    assert {k for k, moot in REPORT_KINDS.items() if moot} == {
        "workers_done", "worker_exit", "worker_hang", "comm_error", "nan_loss", "worker_error"}


# ------------------------------------------------------------------ status codes (pure)
@pytest.mark.parametrize("code, is_refusal", [
    (None, False),                     # the master was not reached: try again later
    (Status.OK, False),
    (Status.BAD_REQUEST, True), (Status.UNAUTHORIZED, True), (Status.WRONG_TOKEN, True),
    (Status.NO_SUCH_ENDPOINT, True), (Status.CONFLICT, True), (Status.TOO_LARGE, True),
    (Status.UNKNOWN_NODE, False),      # register again, then the same message goes through
    (Status.MASTER_ERROR, False),
])
def test_which_answers_refuse_the_message_itself(code, is_refusal):
    assert refused(code) is is_refusal
    assert ControlError("x", status=code).refused is is_refusal
    assert ControlError("x", status=code).unknown_node is (code == Status.UNKNOWN_NODE)


def test_every_status_has_a_reason_phrase():
    assert all(REASON_PHRASES.get(s) for s in Status)


# ------------------------------------------------------------------ codec (pure)
@pytest.mark.parametrize("raw, expected", [
    ({}, {}), (None, {}),
    ({"0": "a:1", "12": "b:2"}, {0: "a:1", 12: "b:2"}),      # as JSON carries them
    ({0: "a:1", 3: "b:2"}, {0: "a:1", 3: "b:2"}),            # as an in-process caller built them
    ({"1": [2, 3], 4: [0]}, {1: [2, 3], 4: [0]}),
])
def test_int_keys_normalises_json_keys(raw, expected):
    assert int_keys(raw) == expected


@pytest.mark.parametrize("bad", [{"x": 1}, {"-1": 1}, {-1: 1}, {"1.5": 1}, {True: 1}, {"9" * 12: 1}])
def test_int_keys_refuses_keys_that_are_not_numbers_and_names_the_map(bad):
    with pytest.raises(ValueError, match="world.slots: key"):
        int_keys(bad, "world.slots")


def test_a_directive_decoded_from_the_wire_is_the_order_the_master_gave():
    order = directives.Restore(restart_count=1, restore_step=9)
    own = directives.Assignment(slot=1, world=directives.World({0: "h:1", 1: "h:2"}, {2: [0], 3: [0, 1]}, 5),
                                fetch={3: RankSource(private=("h:1", "h:3"), shared=(("h:2", 1),))})
    sent = {**order.to_wire(), **own.to_wire(), "version": 4, "generation": 2, "store_prefix": "/p/", "master_epoch": 0}
    received = json.loads(wire.dumps(sent))               # what the agent's client hands it: string keys
    assert set(received["world"]["slots"]) == {"0", "1"}
    d = directives.decode(received)
    assert (d.order, d.own, d.version, d.generation, d.store_prefix) == (order, own, 4, 2, "/p/")
    assert received["world"]["slots"] == {"0": "h:1", "1": "h:2"}    # the input is not modified
    assert directives.decode({"command": "noop", "version": 1}).order == directives.Noop()


@pytest.mark.parametrize("order", [directives.Noop(), directives.Wait(warm=True), directives.Run(resume=True),
                                   directives.Run(restart_count=0), directives.Restart(restore_step=None),
                                   directives.Restart(restart_count=2, restore_step=5, store_port=7),
                                   directives.Quiesce(), directives.Quiesce(at_step=12),
                                   directives.Restore(restore_step=3),
                                   directives.Stop(exit_code=1, reason="r", job_end=True),
                                   directives.Stop(fenced=True, reason="fenced: x")])
def test_every_order_round_trips_the_wire(order):
    assert directives.decode(json.loads(wire.dumps(order.to_wire()))).order == order


def test_an_unknown_command_is_nothing_to_do_and_a_bad_field_names_itself():
    assert isinstance(directives.decode({"command": "teleport", "version": 3}).order, directives.Unknown)
    with pytest.raises(ValueError, match="'slot' must be an integer"):
        directives.decode({"command": "run", "slot": "zero"})


def test_the_status_codes_are_frozen():
    assert {s.name: int(s) for s in Status} == {
        "OK": 200, "BAD_REQUEST": 400, "UNAUTHORIZED": 401, "WRONG_TOKEN": 403, "NO_SUCH_ENDPOINT": 404,
        "METHOD_NOT_ALLOWED": 405, "READ_TIMEOUT": 408, "CONFLICT": 409, "UNKNOWN_NODE": 410, "TOO_LARGE": 413,
        "HEAD_TOO_LARGE": 431, "MASTER_ERROR": 500}


def test_parsed_messages_are_frozen_except_the_hot_heartbeat():
    import dataclasses
    from phoenixrun.protocol import messages as m
    job = m.Job(nnodes=2, nproc_per_node=1, world_size=2)
    reg = m.parse_register({"node_id": "n", "host": "h", "agent_pid": 1, "peer_addr": "h:1"}, job)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.node_id = "other"
    poll = m.parse_poll({"node_id": "n", "version": -1}, newest_version=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        poll.version = 3
    # Heartbeat stays plain (a frozen __init__ cost the 16K/s heartbeat parse 28%: messages.py); reports are
    # frozen (protocol/reports.py)
    assert not m.Heartbeat.__dataclass_params__.frozen
    from phoenixrun.protocol import reports
    assert all(c.__dataclass_params__.frozen for c in reports.KINDS.values())

"""The protocol's names are its wire: every member round-trips as exactly its string, and the sets are frozen.

A newcomer adding a command, report kind, op or event updates the frozen set here on purpose (and the
other end of the wire, and docs/architecture.md / docs/operations.md where the name is documented)."""
from __future__ import annotations

import json

import pytest

from phoenixrun.control import wire
from phoenixrun.protocol import REPORT_KINDS, Command, Event, PeerOp, ReportKind, WorkerOp

FROZEN = {
    Command: {"noop", "wait", "run", "restart", "quiesce", "restore", "stop"},
    ReportKind: {"left", "workers_done", "worker_exit", "worker_hang", "restore_failed", "resumed", "quiesced",
                 "comm_error", "nan_loss", "worker_error", "protection_mode", "health",
                 "joined", "node_lost", "attempt_check"},
    WorkerOp: {"hello", "alloc", "slots", "write", "written", "progress", "pong", "quiesced", "resumed",
               "comm_error", "nan_loss", "error", "protection_mode", "stats", "reply", "assign", "rebuild",
               "quiesce", "committed", "commit_failed", "ping", "abort_comm", "poison_loss", "agent_gone"},
    PeerOp: {"put", "get_private", "get_shared", "ping"},
    Event: {"master_started", "master_recovered", "master_stalled", "node_joined", "node_rejoined",
            "node_refused", "node_fenced", "spare_lost", "spare_promoted", "job_started", "job_finished",
            "directive_sent", "fault_injected", "fault_detected", "protection_mode", "recovery_started",
            "recovery_plan", "recovery_done", "recovery_failed", "restart", "fallback_restart", "fallback_done",
            "checkpoint_rejected", "rejected_request"},
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

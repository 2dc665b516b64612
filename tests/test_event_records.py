"""protocol/events.py: one record type per event name, and the fields each writes (docs/design.md's event
contract) - the same shape for every detected fault, optional fields only where given."""
from __future__ import annotations

import dataclasses
import json

import pytest

from phoenixrun.control.decide import MIDWAY_WORKER_ACTION, fault_detected, midway_worker_verdict
from phoenixrun.control.events import EventLog, read_events
from phoenixrun.faults import Action, Classification
from phoenixrun.faults.taxonomy import FaultClass
from phoenixrun.protocol import reports
from phoenixrun.protocol.events import RECORDS, FaultDetected, NodeFenced, RecoveryDone
from phoenixrun.protocol.names import Event, ReportKind

BASE = {"node", "slot", "signal", "rank", "returncode", "detail", "class", "kind", "action", "step"}
LOCAL = Classification(FaultClass.TRANSIENT_COMM, Action.LOCAL_RESET, True, "comm")


def test_every_event_name_has_one_record_type():
    assert set(RECORDS) == set(Event)
    assert all(r.NAME is name for name, r in RECORDS.items())


def test_a_record_is_frozen_and_refuses_an_unknown_field():
    rec = NodeFenced(node="n1", reason="replaced", via="heartbeat")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.node = "n2"     # type: ignore[misc]
    with pytest.raises(TypeError):
        NodeFenced(node="n1", reason="x", vai="heartbeat")   # type: ignore[call-arg]


def test_optional_fields_are_written_only_when_given():
    assert NodeFenced(node="n1", reason="r", via="heartbeat").fields() == {"node": "n1", "reason": "r",
                                                                           "via": "heartbeat"}
    assert NodeFenced(node="n1", reason="r", slot=0).fields() == {"node": "n1", "reason": "r", "slot": 0}
    done = RecoveryDone(restored_step=3, replayed_steps=1, steps_completed_before=4, duration_s=1.0,
                        detect_to_done_s=1.5, replaced_slots={1: "s"}, attempts=1, phases={"quiesce_s": 0.1})
    assert "cause" not in done.fields() and "drained_node" not in done.fields()


@pytest.mark.parametrize("report, how", [
    (reports.WorkerExit(rank=3, returncode=-9, detail="killed", step=7), {}),
    (reports.NodeLost(detail="silent"), {"during_recovery": True}),
    (reports.NodeLost(), {"signal": ReportKind.NODE_LOST, "symptom_of_loss": True, "detail": "gone"}),
    (reports.WorkerExit(rank=1, returncode=1), {"action": "stop", "step": 4, "repeats": 3}),
    (reports.WorkerExit(rank=1, returncode=1), {"verdict": "root_cause", "reporters": ["a"], "symptoms": []}),
])
def test_every_detection_writes_the_same_fields_with_the_class(report, how):
    fields = fault_detected(report, "n1", 1, LOCAL, **how).fields()
    assert BASE <= set(fields)
    assert set(fields) - BASE == {k for k in how if k not in ("signal", "detail", "action", "step")}
    assert fields["class"] == fields["kind"] == "transient_comm"
    assert fields["action"] == how.get("action", "local_reset")


def test_a_worker_lost_mid_recovery_is_classified_and_filed_as_a_local_reset():
    c = midway_worker_verdict(reports.WorkerExit(rank=0, returncode=1, detail="boom"), 0, 2)
    assert c.action is MIDWAY_WORKER_ACTION
    assert isinstance(c.fault_class, FaultClass)
    assert "class" in fault_detected(reports.WorkerExit(returncode=1), "n", 0, c, during_recovery=True).fields()


def test_the_log_writes_a_record_with_its_name_and_generation(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    line = log.emit(FaultDetected(node="n", slot=0, signal="worker_exit", rank=0, returncode=1, detail="d",
                                  fault_class="software_unknown", action="local_reset", step=None), 4)
    log.close()
    [read] = read_events(tmp_path / "events.jsonl")
    assert read == json.loads(json.dumps(line))
    assert (read["event"], read["generation"], read["class"]) == ("fault_detected", 4, "software_unknown")

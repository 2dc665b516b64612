"""The console's one line per incident (control/incident.py), from the events that open and close it."""
import pytest

from phoenixrun.control.incident import incident_line, short_detail

NODE_LOST = {"t": 100.0, "event": "fault_detected", "node": "vm-3-f7a5", "slot": 1, "signal": "node_lost",
             "rank": None, "returncode": None, "detail": "agent unreachable", "class": "node_lost",
             "action": "node_replace"}
KILLED = {"t": 100.0, "event": "fault_detected", "node": "n0", "slot": 0, "signal": "worker_exit", "rank": 1,
          "returncode": -9, "detail": "rank 1 exited with signal 9", "class": "transient_comm", "action": "local_reset"}
RAISED = {"t": 100.0, "event": "fault_detected", "node": "n0", "slot": 0, "signal": "worker_error", "rank": 0,
          "detail": "Traceback (most recent call last):\n  File \"train.py\", line 9\nValueError: bad batch\n",
          "class": "software_unknown", "action": "external_fallback"}
XID = {"t": 100.0, "event": "fault_detected", "node": "n2", "slot": 2, "signal": "health", "rank": None,
       "detail": "Xid 79: GPU has fallen off the bus", "class": "host_pcie", "action": "node_replace"}
EXITED = {"t": 100.0, "event": "fault_detected", "node": "n0", "slot": 0, "signal": "worker_exit", "rank": 0,
          "returncode": 1, "detail": "rank 0 exited with code 1", "class": "software_unknown"}

SWAP = {"t": 104.6, "event": "recovery_done", "restored_step": 7, "replayed_steps": 1, "duration_s": 4.5316,
        "replaced_slots": {"1": "vm-4-0496"}, "attempts": 1}
RESET = {"t": 101.2, "event": "recovery_done", "restored_step": 12, "replayed_steps": 0, "duration_s": 1.24,
         "replaced_slots": {}, "attempts": 1}
TWO = {"t": 109.0, "event": "recovery_done", "restored_step": 30, "replayed_steps": 2, "duration_s": 9.0,
       "replaced_slots": {"10": "s1", "2": "s0"}, "attempts": 3}
RESTART = {"t": 100.5, "event": "restart", "restart_count": 1, "reason": "node(s) in slot(s) [1] lost"}
FALLBACK = {"t": 130.0, "event": "fallback_done", "restore_step": 20, "duration_s": 30.0}
SHRUNK = {"t": 112.0, "event": "job_shrunk", "nnodes": 3, "world_size": 6, "restored_step": 9, "replayed_steps": 1,
          "duration_s": 12.0}
STOPPED = {"t": 101.0, "event": "job_finished", "exit_code": 75,
           "reason": "node in slot 1 lost and no spare registered within --spare-wait 6s"}

TABLE = [
    # a SIGKILLed node, a spare took its slot: the operator's first question answered in one line
    (NODE_LOST, SWAP, "vm", 0,
     "incident: node lost on slot 1 (node vm-3-f7a5, host vm) [node_lost: agent unreachable] -> hot swap onto spare "
     "vm-4-0496 in 4.5 s; restored step 7, 1 step replayed; 0 spares left"),
    (KILLED, RESET, None, 1,
     "incident: rank 1 killed by SIGKILL on slot 0 (node n0) [transient_comm] -> local reset in 1.2 s; restored "
     "step 12, 0 steps replayed; 1 spare left"),
    (XID, TWO, "gpu7", 2,
     "incident: hardware health signal on slot 2 (node n2, host gpu7) [host_pcie: Xid 79: GPU has fallen off the "
     "bus] -> hot swap onto spares s0 (slot 2), s1 (slot 10) in 9.0 s (3 attempts); restored step 30, 2 steps "
     "replayed; 2 spares left"),
    # a plain script: torchrun's restart, every step again
    (NODE_LOST, RESTART, "vm", 0,
     "incident: node lost on slot 1 (node vm-3-f7a5, host vm) [node_lost: agent unreachable] -> torchrun-style "
     "restart 1, ordered 0.5 s after detection: every worker starts again from the beginning (every step "
     "replayed); 0 spares left"),
    # the agent's own exit text adds nothing to "exited with code 1"
    (EXITED, RESTART, None, None,
     "incident: rank 0 exited with code 1 on slot 0 (node n0) [software_unknown] -> torchrun-style restart 1, "
     "ordered 0.5 s after detection: every worker starts again from the beginning (every step replayed)"),
    # an exception's message, not its traceback
    (RAISED, FALLBACK, "h", 0,
     "incident: rank 0 raised an exception on slot 0 (node n0, host h) [software_unknown: ValueError: bad batch] "
     "-> restart from the persistent checkpoint of step 20 in 30.0 s; 0 spares left"),
    (RAISED, STOPPED | {"exit_code": 1, "reason": "exception in user code (rank 0 on slot 0)"}, "h", 0,
     "incident: rank 0 raised an exception on slot 0 (node n0, host h) [software_unknown: ValueError: bad batch] "
     "-> stopped (exit 1): exception in user code (rank 0 on slot 0); 0 spares left"),
    (NODE_LOST, STOPPED, "vm", 0,
     "incident: node lost on slot 1 (node vm-3-f7a5, host vm) [node_lost: agent unreachable] -> stopped (exit 75): "
     "node in slot 1 lost and no spare registered within --spare-wait 6s; 0 spares left"),
    (NODE_LOST, SHRUNK, "vm", 0,
     "incident: node lost on slot 1 (node vm-3-f7a5, host vm) [node_lost: agent unreachable] -> no spare: shrunk to "
     "3 nodes (world size 6) in 12.0 s; restored step 9, 1 step replayed; 0 spares left"),
    # an interrupted drain (no fault_detected: the recovery opened the incident itself)
    ({"t": 100.0, "node": "n1", "slot": None, "signal": "drain", "detail": "drain interrupted: phase deadline passed"},
     SWAP, None, 0,
     "incident: planned drain on no slot (node n1) [drain interrupted: phase deadline passed] -> hot swap onto "
     "spare vm-4-0496 in 4.5 s; restored step 7, 1 step replayed; 0 spares left"),
    (None, RESTART, None, None,
     "incident: node(s) in slot(s) [1] lost -> torchrun-style restart 1: every worker starts again from the "
     "beginning (every step replayed)"),
]


@pytest.mark.parametrize("fault, outcome, host, spares, line", TABLE)
def test_incident_line(fault, outcome, host, spares, line):
    assert incident_line(fault, outcome, host=host, spares_left=spares) == line


def test_one_line_whatever_the_text():
    long = {**RAISED, "detail": "RuntimeError: " + "x" * 500 + "\n\n"}
    line = incident_line(long, SWAP, host="h", spares_left=0)
    assert "\n" not in line and len(line) < 300 and "xxx..." in line


@pytest.mark.parametrize("text, short", [
    ("", ""), (None, ""), ("one", "one"), ("a\nb\n\n  ", "b"), ("y" * 200, "y" * 117 + "..."),
])
def test_short_detail(text, short):
    assert short_detail(text) == short

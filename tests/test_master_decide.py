"""The master's fault decisions as pure functions (control/decide.py): tables."""
import itertools
from dataclasses import replace

import pytest

from phoenixrun.control.decide import (JobEnd, Remedy, Response, attempt_ranks, attempt_verdict, carried_out_first,
                                       detail_of, escalated, exit_code_of, fallback_reason, is_definite, loss_verdict,
                                       respond, signal_of)
from phoenixrun.faults import Action, Classification, FaultClass, Signal, SignalKind, correlate
from phoenixrun.faults.correlate import Correlation, NodeDecision, Verdict
from phoenixrun.faults.escalate import Escalation
from phoenixrun.protocol import reports as r


@pytest.mark.parametrize("ev, kind, code, detail", [
    (r.NodeLost(detail="no heartbeat for 5.1s"), "node_heartbeat_lost", None, "no heartbeat for 5.1s"),
    (r.Left(detail="bye"), "node_unreachable", None, "bye"),
    (r.NanLoss(rank=3, text="loss nan"), "nan_loss", None, "loss nan"),
    (r.WorkerError(rank=1, text="ValueError"), "user_exception", None, "ValueError"),
    (r.WorkerHang(rank=1, detail="no progress"), "worker_hang", None, "no progress"),
    (r.WorkerExit(rank=0, returncode=-9, detail="killed"), "worker_exit", -9, "killed"),
    (r.WorkerExit(rank=0, returncode=1, text="tb", detail="d"), "worker_exit", 1, "tb"),
    (r.CommError(rank=2, text="gloo"), "collective_error", None, "gloo"),
    (r.Health(signal=Signal(kind=SignalKind.XID, code=79, detail="fell off")), "xid", 79, "fell off"),
])
def test_signal_of_a_report(ev, kind, code, detail):
    s = signal_of(replace(ev, t=12.5), 3)
    assert (s.kind.value, s.node, s.code, s.detail) == (kind, 3, code, detail)
    if not isinstance(ev, r.Health):
        assert s.timestamp == 12.5


@pytest.mark.parametrize("ev, definite", [
    (r.NodeLost(), True),
    (r.WorkerExit(returncode=-9), True),
    (r.WorkerExit(returncode=1), False),      # an exit without a reason may be a peer's symptom
    (r.WorkerHang(), True),                   # its own process did not answer its agent (agents/watchdog.py)
    (r.CommError(text="gloo"), False),
    (r.WorkerError(text="ValueError"), True),
])
def test_definite_root_causes(ev, definite):
    assert is_definite(replace(ev, t=1.0), 0, max_local_resets=3) is definite
    assert is_definite(replace(ev, t=1.0), None, max_local_resets=3) is False     # a node without a slot


@pytest.mark.parametrize("ev, code", [(r.CommError(), None), (r.WorkerExit(returncode=0), 0),
                                      (r.WorkerExit(returncode=1), 1), (r.WorkerExit(returncode=-9), 137),
                                      (r.WorkerExit(returncode=-15), 143)])
def test_exit_code_of(ev, code):
    assert exit_code_of(ev) == code


def test_detail_of():
    assert detail_of(r.CommError(detail="d", text="t")) == "d"
    assert detail_of(r.CommError(text="t" * 400)) == "t" * 300
    assert detail_of(r.NodeLost()) == ""


def _decision(node: int, action: Action | None) -> NodeDecision:
    c = Classification(FaultClass.SOFTWARE_UNKNOWN, action or Action.LOCAL_RESET, True, "r")
    s = Signal(kind="worker_exit", node=node, code=1, timestamp=1.0)
    return NodeDecision(node, Verdict.SYMPTOM if action is None else Verdict.ROOT_CAUSE, action, c, s, (s,))


# the order the master used before the precedence was one (SEVERITY in master.py): fallback, replace, reset
_OLD = {Action.EXTERNAL_FALLBACK: 0, Action.NODE_REPLACE: 1, Action.LOCAL_RESET: 2}


@pytest.mark.parametrize("actions", list(itertools.product([None, *Action], repeat=3)))
def test_the_decision_carried_out_is_the_one_the_old_severity_picked(actions):
    corr = Correlation(tuple(_decision(i, a) for i, a in enumerate(actions)))
    got = carried_out_first(corr)
    old = sorted(corr.acted_on, key=lambda d: _OLD[d.action])
    assert got is (old[0] if old else None)


def test_the_decision_carried_out_of_a_real_window():
    sigs = [Signal(kind="collective_error", node=0, timestamp=1.0),
            Signal(kind="node_heartbeat_lost", node=1, timestamp=1.1),
            Signal(kind="nan_loss", node=2, timestamp=1.2)]
    assert carried_out_first(correlate(sigs)).node == 2                  # a fallback decides the job
    assert carried_out_first(correlate(sigs[:2])).node == 1              # the lost node, not the symptom
    assert carried_out_first(correlate(sigs[:1])).action is Action.LOCAL_RESET   # transient
    assert carried_out_first(Correlation(())) is None


@pytest.mark.parametrize("api, action, kind, expected", [
    (True, Action.LOCAL_RESET, "worker_exit", Response(Remedy.HOT_SWAP, False, False)),
    (True, Action.NODE_REPLACE, "node_lost", Response(Remedy.HOT_SWAP, True, False)),     # gone: nobody to fence
    (True, Action.NODE_REPLACE, "left", Response(Remedy.HOT_SWAP, True, False)),
    (True, Action.NODE_REPLACE, "health", Response(Remedy.HOT_SWAP, True, True)),        # still up: fenced
    (True, Action.NODE_REPLACE, "worker_hang", Response(Remedy.HOT_SWAP, True, True)),
    (True, Action.NODE_REPLACE, "worker_exit", Response(Remedy.HOT_SWAP, True, True)),
    (True, Action.NODE_REPLACE, "comm_error", Response(Remedy.HOT_SWAP, True, True)),
    (True, Action.EXTERNAL_FALLBACK, "nan_loss", Response(Remedy.FALLBACK, False, False)),
    (True, Action.EXTERNAL_FALLBACK, "health", Response(Remedy.FALLBACK, False, False)),
    (False, Action.LOCAL_RESET, "worker_exit", Response(Remedy.RESTART, False, False)),
    (False, Action.NODE_REPLACE, "node_lost", Response(Remedy.RESTART, True, False)),
    (False, Action.NODE_REPLACE, "health", Response(Remedy.RESTART, True, True)),
    (False, Action.EXTERNAL_FALLBACK, "nan_loss", Response(Remedy.RESTART, False, False)),   # torchrun: restart
])
def test_what_carries_a_decision_out(api, action, kind, expected):
    assert respond(api, action, kind) == expected


def test_escalated_classification():
    c = Classification(FaultClass.TRANSIENT_COMM, Action.LOCAL_RESET, True, "gloo", False)
    assert escalated(c, Escalation(Action.LOCAL_RESET, 0, "gloo")) is c
    e = escalated(c, Escalation(Action.NODE_REPLACE, 3, "gloo; escalated"))
    assert (e.fault_class, e.action, e.reason) == (FaultClass.TRANSIENT_COMM, Action.NODE_REPLACE, "gloo; escalated")


def test_fallback_reason():
    c = Classification(FaultClass.SOFTWARE_UNKNOWN, Action.EXTERNAL_FALLBACK, True, "non-finite loss")
    assert fallback_reason(c, r.NanLoss(text="loss=nan", rank=1), 0) == \
        "non-finite loss: loss=nan (rank 1 on slot 0)"
    assert fallback_reason(c, r.Health(signal=Signal(kind=SignalKind.XID, code=79)), 2) == \
        "non-finite loss (rank None on slot 2)"


@pytest.mark.parametrize("kind, cls", [(r.NodeLost, FaultClass.NODE_LOST), (r.Left, FaultClass.NODE_LOST)])
def test_a_node_lost_mid_recovery_is_filed_by_the_classifier(kind, cls):
    c = loss_verdict(kind(node_id="b"), 1, max_local_resets=3)     # no "t": a probe's own report
    assert (c.fault_class, c.action) == (cls, Action.NODE_REPLACE)
    with pytest.raises(ValueError, match="not a node loss"):
        loss_verdict(r.WorkerExit(returncode=1), 1, max_local_resets=3)


def test_attempt_ranks_and_verdict():
    keys = ["default_pg/0//cpu//0/0", "/default_pg/0//cpu//0/3", "default_pg/0//cpu//0/9", "other/1"]
    assert attempt_ranks(keys, 4) == {0, 3}
    assert attempt_verdict({0, 3}, 4, None) is None          # first look: again later
    assert attempt_verdict({0, 3}, 4, 1) is None             # still arriving
    assert attempt_verdict({0, 3}, 4, 2) == [1, 2]           # no one new for a whole interval: it hangs
    assert attempt_verdict(set(), 4, 0) is None              # nobody at init_process_group yet
    assert JobEnd(0, "done").exit_code == 0

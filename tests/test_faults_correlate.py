import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.faults.correlate import Verdict, correlate
from phoenixrun.faults.taxonomy import Action, Signal, SignalKind

K = SignalKind
GLOO_CLOSED = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def comm(node, t=10.0):
    return Signal(K.COLLECTIVE_ERROR, node=node, detail=GLOO_CLOSED, timestamp=t)


def test_dead_node_is_root_cause_and_survivors_only_quiesce():
    window = [comm(0, 10.1), comm(2, 10.2), Signal(K.NODE_HEARTBEAT_LOST, node=1, timestamp=11.0), comm(3, 10.3)]
    r = correlate(window)
    assert [d.node for d in r.acted_on] == [1]
    d1 = r.decision(1)
    assert d1.verdict is Verdict.ROOT_CAUSE and d1.action is Action.NODE_REPLACE
    assert d1.signal.kind is K.NODE_HEARTBEAT_LOST
    for n in (0, 2, 3):
        assert r.decision(n).verdict is Verdict.SYMPTOM and r.decision(n).action is None
    assert r.nodes(Action.NODE_REPLACE) == [1]
    assert not r.external_fallback


def test_killed_worker_local_reset_while_its_peers_exit_without_text():
    # Rank on node 2 SIGKILLed: its local peers and other nodes' workers fail in the collective and exit 1
    # (no exception text reached the agent). Only node 2 is reset; nobody falls back.
    window = [
        Signal(K.WORKER_EXIT, node=2, rank=4, code=-9, timestamp=5.0),
        Signal(K.WORKER_EXIT, node=2, rank=5, code=1, timestamp=5.5),
        Signal(K.WORKER_EXIT, node=0, rank=0, code=1, timestamp=5.6),
        comm(1, 5.7),
    ]
    r = correlate(window)
    assert [(d.node, d.action) for d in r.acted_on] == [(2, Action.LOCAL_RESET)]
    assert {d.node for d in r.symptoms} == {0, 1}
    assert not r.external_fallback


def test_hardware_verdict_beats_the_exception_it_caused_on_the_same_node():
    window = [
        Signal(K.USER_EXCEPTION, node=1, detail="RuntimeError: CUDA error: unknown error", timestamp=1.0),
        Signal(K.XID, node=1, code=79, timestamp=1.2),
        comm(0, 1.1),
    ]
    r = correlate(window)
    assert r.decision(1).action is Action.NODE_REPLACE and r.decision(1).signal.code == 79
    assert not r.external_fallback


def test_several_root_causes_each_acted_on_with_their_own_action():
    window = [
        Signal(K.XID, node=0, code=48, timestamp=1.0),
        Signal(K.NAN_LOSS, node=3, timestamp=1.0),
        Signal(K.WORKER_EXIT, node=1, code=-11, timestamp=1.0),
        comm(2),
    ]
    r = correlate(window)
    assert {(d.node, d.action) for d in r.acted_on} == {
        (0, Action.NODE_REPLACE), (1, Action.LOCAL_RESET), (3, Action.EXTERNAL_FALLBACK)}
    assert r.external_fallback
    assert r.decision(2).verdict is Verdict.SYMPTOM


def test_comm_errors_only_are_transient_local_resets_of_the_reporters():
    r = correlate([comm(0), comm(1), comm(1, 10.5)])
    assert [(d.node, d.verdict, d.action) for d in r.decisions] == [
        (0, Verdict.TRANSIENT, Action.LOCAL_RESET), (1, Verdict.TRANSIENT, Action.LOCAL_RESET)]
    assert len(r.decision(1).signals) == 2


def test_repeated_transient_escalates_with_history():
    history = {1: [comm(1, t) for t in (100.0, 200.0)]}
    r = correlate([comm(0, 300.0), comm(1, 300.0)], history, max_local_resets=2)
    assert r.decision(0).action is Action.LOCAL_RESET
    assert r.decision(1).action is Action.NODE_REPLACE


def test_a_hang_is_its_own_nodes_root_cause():
    """A hang is reported only for a worker that did not answer its agent (and was killed by it): a root cause
    like a worker's death, whatever else the window holds; the peers blocked on it are symptoms."""
    hang = Signal(K.WORKER_HANG, node=1, timestamp=30.0)
    r = correlate([hang, comm(0, 20.0)])
    assert r.decision(1).verdict is Verdict.ROOT_CAUSE and r.decision(1).action is Action.LOCAL_RESET
    assert r.decision(0).verdict is Verdict.SYMPTOM
    r = correlate([hang, Signal(K.NODE_UNREACHABLE, node=2, timestamp=31.0)])
    assert r.decision(1).verdict is Verdict.ROOT_CAUSE and r.decision(1).action is Action.LOCAL_RESET
    assert [d.node for d in r.acted_on] == [1, 2] and r.decision(2).action is Action.NODE_REPLACE


def test_signal_without_node_is_rejected():
    with pytest.raises(ValueError):
        correlate([Signal(K.NAN_LOSS)])


def test_empty_window():
    r = correlate([])
    assert r.decisions == () and not r.external_fallback


DEFINITE = st.sampled_from([
    Signal(K.NODE_HEARTBEAT_LOST), Signal(K.NODE_UNREACHABLE), Signal(K.XID, code=79), Signal(K.XID, code=48),
    Signal(K.XID, code=13), Signal(K.ECC_UNCORRECTABLE), Signal(K.ROW_REMAP_FAILURE), Signal(K.NIC_DOWN),
    Signal(K.WORKER_EXIT, code=-9), Signal(K.WORKER_EXIT, code=-7), Signal(K.GPU_RECOVERY_ACTION, code=2),
    Signal(K.WORKER_HANG),
])
SURVIVOR = st.sampled_from([
    Signal(K.COLLECTIVE_ERROR, detail=GLOO_CLOSED), Signal(K.WORKER_EXIT, code=1),
    Signal(K.USER_EXCEPTION, detail="Watchdog caught collective operation timeout"),
    Signal(K.WORKER_EXIT, code=-6, detail="NCCL error: ncclRemoteError"),
])


@settings(max_examples=200, deadline=None)
@given(
    nnodes=st.integers(2, 16), data=st.data(),
    culprit_sigs=st.lists(DEFINITE, min_size=1, max_size=3),
)
def test_property_survivors_never_blamed(nnodes, data, culprit_sigs):
    culprit = data.draw(st.integers(0, nnodes - 1))
    window = [Signal(s.kind, node=culprit, code=s.code, detail=s.detail, timestamp=data.draw(st.floats(0, 5)))
              for s in culprit_sigs]
    for n in range(nnodes):
        if n != culprit:
            for s in data.draw(st.lists(SURVIVOR, max_size=3)):
                window.append(Signal(s.kind, node=n, code=s.code, detail=s.detail,
                                     timestamp=data.draw(st.floats(0, 5))))
    order = data.draw(st.permutations(range(len(window))))
    r = correlate([window[i] for i in order])
    assert [d.node for d in r.acted_on] == [culprit]
    assert all(d.action is None for d in r.symptoms)
    assert not r.external_fallback


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.sampled_from(
    ["Connection reset by peer", "Timed out waiting 30000ms", "ncclSystemError", "Broken pipe"])), min_size=1))
def test_property_comm_only_is_transient_for_exactly_the_reporters(reports):
    r = correlate([Signal(K.COLLECTIVE_ERROR, node=n, detail=t) for n, t in reports])
    assert [d.node for d in r.decisions] == sorted({n for n, _ in reports})
    assert all(d.verdict is Verdict.TRANSIENT and d.action is Action.LOCAL_RESET for d in r.decisions)

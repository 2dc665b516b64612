import signal

import pytest

from phoenixrun.faults.classify import (COLLECTIVE_ERROR_PATTERNS, classify, collective_cause, count_incidents,
                                       exit_signal_number)
from phoenixrun.faults.taxonomy import Action, FaultClass, Signal, SignalKind

K = SignalKind
TC, GM, HP, NS, SU, NL = (FaultClass.TRANSIENT_COMM, FaultClass.GPU_MEMORY, FaultClass.HOST_PCIE,
                          FaultClass.NETWORK_STORAGE, FaultClass.SOFTWARE_UNKNOWN, FaultClass.NODE_LOST)
LR, NR, XF = Action.LOCAL_RESET, Action.NODE_REPLACE, Action.EXTERNAL_FALLBACK

# (signal, fault class, action, root cause, ambiguous)
TABLE = [
    # Xids named in the table
    *[(Signal(K.XID, code=x), GM, NR, True, False) for x in (48, 64, 95)],
    *[(Signal(K.XID, code=x), HP, NR, True, False) for x in (79, 119, 120)],
    *[(Signal(K.XID, code=x), GM, LR, True, False) for x in (13, 31, 43, 94)],
    *[(Signal(K.XID, code=x), SU, XF, True, False) for x in (1, 45, 74, 999)],  # unknown Xid
    (Signal(K.ECC_UNCORRECTABLE), GM, NR, True, False),
    (Signal(K.ROW_REMAP_FAILURE), GM, NR, True, False),
    *[(Signal(K.GPU_RECOVERY_ACTION, code=v), HP, NR, True, False) for v in (1, 2, 3, 4, 6, 7, 42)],
    # a vanished or silent agent (SIGKILL, a crash, a partition) names no hardware: a node loss, cause unknown
    (Signal(K.NODE_HEARTBEAT_LOST), NL, NR, True, False),
    (Signal(K.NODE_HEARTBEAT_LOST, detail="agent unreachable"), NL, NR, True, False),
    (Signal(K.NODE_UNREACHABLE, detail="agent got signal 15"), NL, NR, True, False),
    (Signal(K.NIC_DOWN), NS, NR, True, False),
    (Signal(K.STORAGE_ERROR), NS, NR, True, False),
    # the agent cannot grow a snapshot slot (shared memory full): never a local reset that would loop
    (Signal(K.SNAPSHOT_SPACE, detail="cannot allocate 1048576 bytes of snapshot memory in /dev/shm"),
     HP, XF, True, False),
    (Signal(K.NAN_LOSS), SU, XF, True, False),
    (Signal(K.USER_EXCEPTION, detail="ValueError: bad batch"), SU, XF, True, False),
    (Signal(K.USER_EXCEPTION), SU, XF, True, False),
    (Signal(K.USER_EXCEPTION, detail="RuntimeError: CUDA error: uncorrectable ECC error encountered"),
     GM, NR, True, False),
    (Signal(K.USER_EXCEPTION, detail="RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
     TC, LR, False, False),
    (Signal(K.COLLECTIVE_ERROR, detail="anything"), TC, LR, False, False),
    (Signal(K.WORKER_HANG), TC, LR, True, False),   # its own process did not answer (agents/watchdog.py)
    # worker exits: killed by a signal (Popen -N or shell 128+N) -> local reset; exit code -> the text decides
    *[(Signal(K.WORKER_EXIT, code=-s), TC, LR, True, False)
      for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGTERM)],
    (Signal(K.WORKER_EXIT, code=128 + signal.SIGKILL), TC, LR, True, False),
    (Signal(K.WORKER_EXIT, code=-signal.SIGABRT, detail="Watchdog caught collective operation timeout"),
     TC, LR, False, False),
    (Signal(K.WORKER_EXIT, code=1, detail="Traceback ...\nKeyError: 'x'"), SU, XF, True, False),
    (Signal(K.WORKER_EXIT, code=1, detail="RuntimeError: NCCL error in: ..., ncclRemoteError"), TC, LR, False, False),
    (Signal(K.WORKER_EXIT, code=1), SU, XF, True, True),
]


def test_table_covers_every_signal_kind():
    assert {s.kind for s, *_ in TABLE} == set(SignalKind)


@pytest.mark.parametrize("sig,fc,action,root,ambiguous", TABLE, ids=lambda v: getattr(v, "value", None))
def test_table(sig, fc, action, root, ambiguous):
    c = classify(sig)
    assert (c.fault_class, c.action, c.root_cause, c.ambiguous) == (fc, action, root, ambiguous), c.reason
    assert c.reason


COLLECTIVE_TEXTS = [
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600000 ms",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
    "ncclInternalError: Internal check failed.",
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer",
    "RuntimeError: Application timeout caused pair closure",       # gloo 2.13: every other op of a timed-out context
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1",
    "RuntimeError: [../gloo/transport/tcp/pair.cc:575] Read error [127.0.0.1]:29500: Connection reset",
    "RuntimeError: [../gloo/transport/tcp/pair.cc:444] write: Broken pipe",
    "torch.distributed.DistStoreError: Socket Timeout ... timed out",
    "RuntimeError: NCCL communicator was aborted on rank 2.",
    "torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
    # ProcessGroupNCCL's texts as torch 2.x emits them (ProcessGroupNCCL.cpp / NCCLUtils.cpp; see classify.py)
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=6463, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=1800000) ran for 1800017 milliseconds before timing out.",
    "[rank1]:[E1003 18:37:01.833637681 ProcessGroupNCCL.cpp:621] [Rank 1] Some NCCL operations have failed or timed "
    "out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete "
    "data.",
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Work WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=60000) timed out in blocking wait.",
    "DistBackendError: NCCL communicator was aborted on rank 1. Original reason for failure was: [PG ID 0 PG GUID "
    "0(default_pg) Rank 1] Watchdog caught collective operation timeout",
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: NCCL error: "
    "remote process exited or there was a network error, NCCL version 2.20.5\nncclRemoteError: A call failed "
    "possibly due to a network error or a remote process exiting prematurely.",
    "[PG ID 0 PG GUID 0(default_pg) Rank 2] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making "
    "progress in monitoring enqueued collectives. This typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy) "
    "hang blocking the watchdog",
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, "
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3",
]

# CUDA errors of the rank's own context, even when NCCL's watchdog is the one that reports them: never a symptom
GPU_TEXTS = [
    # (text, class, action)
    ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: CUDA error: "
     "an illegal memory access was encountered", SU, XF),
    ("torch.distributed.DistBackendError: [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread "
     "terminated with exception: CUDA error: uncorrectable ECC error encountered", GM, NR),
]


@pytest.mark.parametrize("text,fc,action", GPU_TEXTS)
@pytest.mark.parametrize("kind", [K.COLLECTIVE_ERROR, K.USER_EXCEPTION])
def test_cuda_errors_reported_by_the_nccl_watchdog_are_not_symptoms(text, fc, action, kind):
    c = classify(Signal(kind, detail=text))
    assert (c.fault_class, c.action, c.root_cause) == (fc, action, True), c.reason
    assert collective_cause(RuntimeError(text)) is None


@pytest.mark.parametrize("text", COLLECTIVE_TEXTS)
@pytest.mark.parametrize("kind", [K.COLLECTIVE_ERROR, K.USER_EXCEPTION])
def test_collective_texts_are_symptoms(text, kind):
    c = classify(Signal(kind, detail=text))
    assert (c.fault_class, c.action, c.root_cause) == (TC, LR, False)


def test_every_pattern_is_exercised():
    low = " ".join(COLLECTIVE_TEXTS).lower()
    assert all(p.lower() in low for p in COLLECTIVE_ERROR_PATTERNS)


@pytest.mark.parametrize("sig, reason", [
    (Signal(K.NODE_HEARTBEAT_LOST, detail="agent unreachable"), "node lost, cause unknown: agent unreachable"),
    (Signal(K.NODE_HEARTBEAT_LOST, detail="no heartbeat for 5.1s"), "node lost, cause unknown: no heartbeat for 5.1s"),
    (Signal(K.NODE_HEARTBEAT_LOST), "node lost, cause unknown"),
    (Signal(K.NODE_UNREACHABLE, detail="agent got signal 15"), "node left: agent got signal 15"),
])
def test_a_lost_node_is_reported_as_what_was_seen(sig, reason):
    """A SIGKILLed node (its agent refuses connections) was filed as host_pcie, "agent heartbeat lost": an operator
    would have filed a hardware ticket for a kill."""
    c = classify(sig)
    assert (c.fault_class, c.reason) == (FaultClass.NODE_LOST, reason)


def test_exit_signal_number():
    assert exit_signal_number(-9) == 9
    assert exit_signal_number(137) == 9
    assert exit_signal_number(1) is None
    assert exit_signal_number(128) is None


def _at(kind, t, code=None, node=0):
    return Signal(kind, node=node, code=code, timestamp=t)


@pytest.mark.parametrize("sig", [
    _at(K.XID, 1000.0, code=13), _at(K.XID, 1000.0, code=94),
    _at(K.WORKER_EXIT, 1000.0, code=-9), _at(K.WORKER_HANG, 1000.0),
])
def test_escalation_after_repeated_local_resets(sig):
    past = [_at(K.XID, t, code=31) for t in (100.0, 300.0)]
    assert classify(sig, past, max_local_resets=3).action is LR
    past.append(_at(K.WORKER_EXIT, 500.0, code=-11))
    c = classify(sig, past, max_local_resets=3)
    assert c.action is NR and "escalated" in c.reason
    assert c.fault_class is classify(sig).fault_class  # escalation changes the action, not the diagnosis


def test_escalation_counts_incidents_not_signals():
    sig = _at(K.XID, 1000.0, code=13)
    # four ranks of one node killed together is one incident; the current incident does not count as a repeat
    same_incident = [_at(K.WORKER_EXIT, 100.0 + 0.01 * r, code=-9) for r in range(4)]
    current = [_at(K.WORKER_EXIT, 999.5, code=-9)]
    assert classify(sig, same_incident + current, max_local_resets=2).action is LR
    assert classify(sig, same_incident + [_at(K.XID, 200.0, code=43)], max_local_resets=2).action is NR


def test_escalation_ignores_other_nodes_and_non_local_reset_history():
    sig = _at(K.XID, 1000.0, code=43, node=0)
    other_node = [_at(K.XID, t, code=43, node=1) for t in (100.0, 200.0, 300.0)]
    not_local = [_at(K.XID, t, code=79) for t in (400.0, 500.0, 600.0)]
    assert classify(sig, other_node + not_local, max_local_resets=1).action is LR


def test_escalation_never_touches_node_replace_or_fallback():
    past = [_at(K.WORKER_EXIT, t, code=-9) for t in (1.0, 10.0, 20.0)]
    assert classify(_at(K.XID, 100.0, code=79), past, max_local_resets=0).action is NR
    assert classify(_at(K.NAN_LOSS, 100.0), past, max_local_resets=0).action is XF


def test_count_incidents():
    assert count_incidents([]) == 0
    assert count_incidents([5.0, 1.0, 1.5, 9.0, 9.1], gap_s=2.0) == 3


@pytest.mark.parametrize("kwargs", [
    dict(kind=K.WORKER_EXIT, code=0), dict(kind=K.WORKER_EXIT), dict(kind=K.XID),
    dict(kind=K.GPU_RECOVERY_ACTION, code=0), dict(kind="no_such_kind"),
])
def test_invalid_signals_rejected(kwargs):
    with pytest.raises(ValueError):
        Signal(**kwargs)


def test_signal_round_trips_through_dict():
    s = Signal(K.XID, node=2, rank=5, code=79, detail="gpu 1", timestamp=12.5)
    d = s.to_dict()
    assert d["kind"] == "xid"
    assert Signal.from_dict(d) == s
    assert Signal.from_dict({"kind": "nan_loss", "extra": 1}).kind is K.NAN_LOSS


def test_enum_values_are_stable():
    assert [c.value for c in FaultClass] == [
        "transient_comm", "gpu_memory", "host_pcie", "network_storage", "software_unknown", "node_lost"]
    assert [a.value for a in Action] == ["local_reset", "node_replace", "external_fallback"]


class _Own(Exception):
    pass


def _raised_from(cause: BaseException, outer: BaseException, explicit: bool = True) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as e:
            if explicit:
                raise outer from e
            raise outer
    except BaseException as wrapped:
        return wrapped


GLOO_CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25253")


def test_collective_cause_finds_a_wrapped_collective_error():
    # torch.distributed.pipelining's wrapping of a lost neighbour (seen in tests/test_e2e_3d.py)
    wrapped = _raised_from(GLOO_CLOSED, RuntimeError("[Stage 1] failed to run forward:\n args: (...)"))
    assert collective_cause(wrapped) is GLOO_CLOSED
    assert collective_cause(_raised_from(GLOO_CLOSED, ValueError("bad"), explicit=False)) is GLOO_CLOSED
    assert collective_cause(GLOO_CLOSED) is GLOO_CLOSED


def test_collective_cause_is_none_for_the_scripts_own_errors():
    assert collective_cause(None) is None
    assert collective_cause(ValueError("shape mismatch")) is None
    assert collective_cause(_raised_from(KeyError("x"), RuntimeError("failed to run forward"))) is None
    e = RuntimeError("loop")
    e.__cause__ = e                       # a cycle ends the walk
    assert collective_cause(e) is None


def test_collective_cause_takes_the_callers_own_kinds():
    own = _Own("quiesced")
    assert collective_cause(_raised_from(own, RuntimeError("wrapper")), (_Own,)) is own

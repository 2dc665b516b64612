"""protocol/reports.py: every report kind an agent sends survives encode -> decode unchanged, and a malformed
report is refused whole with a MessageError naming the field (never another exception)."""
from __future__ import annotations

import pytest

from phoenixrun.faults import Signal, SignalKind
from phoenixrun.protocol import reports as r
from phoenixrun.protocol.messages import Job, MessageError
from phoenixrun.protocol.names import REPORT_KINDS, ReportKind
from phoenixrun.protocol.timings import Timings
from phoenixrun.redundancy import Mesh, PeerSet

JOB = Job(nnodes=2, nproc_per_node=2, world_size=4)
HEAD = {"node_id": "n1", "generation": 3, "slot": 1, "t": 50.0}
PEERS = PeerSet(Mesh(("dp", "tp"), (2, 2), (0, 1, 2, 3)), frozenset({"tp"}))

EVERY_KIND = [
    r.Left(**HEAD, detail="agent got signal 15"),
    r.WorkersDone(**HEAD),
    r.WorkerExit(**HEAD, rank=2, returncode=-9, detail="killed", text="tb"),
    r.WorkerExit(**HEAD, rank=None, returncode=1),
    r.WorkerHang(**HEAD, rank=3, detail="no progress"),
    r.CommError(**HEAD, rank=0, text="gloo", step=7),
    r.NanLoss(**HEAD, rank=1, text="loss=nan", step=9),
    r.WorkerError(**HEAD, rank=1, text="ValueError"),
    r.RestoreFailed(**HEAD, reason="checksum", integrity=True),
    r.RestoreFailed(**HEAD, rank=2, reason="2 tensors", mismatch=True, persist_step=40),
    r.RestoreRefused(**HEAD, rank=1, part="shared", addr="h:7", source_rank=0, reason="x", integrity=True),
    r.Resumed(**HEAD, timings=Timings(rebuild_s=0.2, fetch_s=1.5)),
    r.Resumed(**HEAD),
    r.Quiesced(**HEAD, snapshots={0: [4, 5], 1: [5]}, replicas={2: [5]}, next_step=6),
    r.ProtectionMode(**HEAD, rank=0, every=4, step=12),
    r.Health(**HEAD, detail="fell off", signal=Signal(kind=SignalKind.XID, rank=1, code=79, detail="fell off",
                                                      timestamp=49.0)),
    r.Layout(**HEAD, peers=PEERS),
    r.Layout(**HEAD, peers=None),
    r.Drain(**HEAD, reason="agent got SIGTERM"),
    r.Suspect(**HEAD, suspect="n2", silent_for=0.612),
]


def test_every_kind_an_agent_sends_is_covered():
    assert {type(ev).KIND for ev in EVERY_KIND} == set(REPORT_KINDS) == set(r.KINDS)


@pytest.mark.parametrize("ev", EVERY_KIND, ids=lambda ev: type(ev).__name__)
def test_encode_then_decode_is_the_identity(ev):
    sent = r.parse_report({**ev.to_wire(), "token": "tok"}, JOB, now=50.0)
    assert sent.report == ev and sent.token == "tok"
    assert type(sent.report) is type(ev)


def test_the_sender_header_is_filled_in_and_an_own_time_kept():
    ev = r.WorkerHang(rank=0, t=7.0).sent_by("n2", 4, 0, now=9.0)
    assert (ev.node_id, ev.generation, ev.slot, ev.t) == ("n2", 4, 0, 7.0)
    assert r.WorkersDone().sent_by("n2", None, None, now=9.0).t == 9.0


@pytest.mark.parametrize("kind", [ReportKind.JOINED, ReportKind.NODE_LOST, ReportKind.ATTEMPT_CHECK, "heartbeat",
                                  7, None, ["left"]])
def test_the_masters_own_kinds_and_unknown_ones_are_refused(kind):
    with pytest.raises(MessageError, match="unknown report kind"):
        r.parse_report({"node_id": "n1", "kind": kind}, JOB, now=1.0)


@pytest.mark.parametrize("patch, error", [
    ({"node_id": None}, "node_id must be a string"),
    ({"generation": "3"}, "generation must be an integer"),
    ({"slot": 2}, "outside the job's slots"),
    ({"t": float("nan")}, "t must be a finite number"),
    ({"rank": True}, "rank must be an integer"),
    ({"step": -1}, "out of range"),
    ({"detail": 5}, "detail must be a string"),
])
def test_a_bad_header_field_is_refused(patch, error):
    with pytest.raises(MessageError, match=error):
        r.parse_report({**r.CommError(**HEAD, rank=0).to_wire(), **patch}, JOB, now=50.0)


@pytest.mark.parametrize("ev, patch, error", [
    (r.WorkerExit(**HEAD, rank=0, returncode=1), {"returncode": None}, "returncode must be an integer"),
    (r.WorkerExit(**HEAD, rank=0, returncode=1), {"returncode": 300}, "out of range"),
    (r.RestoreFailed(**HEAD), {"mismatch": "yes"}, "mismatch must be true or false"),
    (r.RestoreFailed(**HEAD), {"persist_step": 1.5}, "persist_step must be an integer"),
    (r.RestoreRefused(**HEAD, rank=1, part="shared", addr="h:7", source_rank=0), {"part": "x"}, "part must be"),
    (r.RestoreRefused(**HEAD, rank=1, part="shared", addr="h:7", source_rank=0), {"rank": None}, "rank must be"),
    (r.Resumed(**HEAD), {"timings": [1]}, "timings must be an object"),
    (r.Quiesced(**HEAD), {"replicas": {"9": [1]}}, "outside the job"),
    (r.Quiesced(**HEAD), {"next_step": -2}, "out of range"),
    (r.ProtectionMode(**HEAD, every=2), {"every": "2"}, "every must be an integer"),
    (r.Health(**HEAD, signal=Signal(kind=SignalKind.XID, code=1)), {"signal": "xid"}, "signal must be an object"),
    (r.Health(**HEAD, signal=Signal(kind=SignalKind.XID, code=1)), {"signal": {"kind": "bogus"}}, "not a valid"),
    (r.Layout(**HEAD), {"peers": [1]}, "peers must be an object"),
    (r.Layout(**HEAD), {"peers": {"names": ["dp"], "shape": [2], "varies": []}}, "a mesh of 2 ranks"),
    (r.Suspect(**HEAD, suspect="n2", silent_for=1.0), {"silent_for": -1}, "silent_for must be seconds"),
    (r.Suspect(**HEAD, suspect="n2", silent_for=1.0), {"suspect": ""}, "suspect"),
])
def test_a_bad_field_of_a_kind_is_refused(ev, patch, error):
    with pytest.raises(MessageError, match=error):
        r.parse_report({**ev.to_wire(), **patch}, JOB, now=50.0)


def test_a_clock_far_from_the_masters_is_replaced():
    wire = r.Left(**{**HEAD, "t": 1e15}).to_wire()
    assert r.parse_report(wire, JOB, now=100.0).report.t == 100.0


def test_the_body_must_be_an_object():
    with pytest.raises(MessageError, match="must be a JSON object"):
        r.parse_report(["left"], JOB, now=1.0)

"""JobState's three parts (control/membership.py, control/course.py, control/telemetry.py), each on its own, and
JobState composing them (control/jobstate.py): the master's data, split with its behaviour unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest

from phoenixrun.protocol.figures import Figures
from phoenixrun.config import MasterConfig
from phoenixrun.control.course import Course
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.membership import Membership
from phoenixrun.control.state import NodeRecord, Phase, PhaseError, Role
from phoenixrun.control.telemetry import Telemetry
from phoenixrun.topology import Layout


def node(nid: str, slot: int | None, role: Role = Role.ACTIVE, **kw: object) -> NodeRecord:
    return NodeRecord(node_id=nid, host="h", agent_pid=1, peer_addr="h:1", fault_domain="", role=role, slot=slot,
                      **kw)  # type: ignore[arg-type]


def test_membership_tracks_who_holds_what() -> None:
    m = Membership(2)
    m.add_node(node("a", 0, api=True, snapshots={0: [3, 5]}))
    m.add_node(node("b", 1, snapshots={1: [4]}, replicas={0: [6]}))
    m.add_node(node("s", None, Role.SPARE, snapshots={1: [9]}))
    assert dict(m.slots) == {0: "a", 1: "b"} and m.api_nodes == {"a"} and list(m.heard) == ["a", "b", "s"]
    assert [n.node_id for n in m.actives()] == ["a", "b"]
    assert m.newest_snapshots() == {0: 5, 1: 4}      # a spare's snapshots do not count; a replica is not a snapshot


def test_course_refuses_an_illegal_phase_move_and_relayouts() -> None:
    c = Course(Layout(3, 2), replicas=2, fault_domains={})
    assert c.phase is Phase.WAITING and not c.over
    with pytest.raises(PhaseError):
        c.phase = Phase.QUIESCE
    c.phase = Phase.RUNNING
    c.phase = Phase.FINISHED
    assert c.over
    c.relayout(Layout(2, 2), replicas=1)
    assert c.layout.nnodes == 2 and set(c.slot_placement) == {0, 1}
    assert all(holders for holders in c.placement.values())


def test_telemetry_samples_one_step_once_and_restarts_after_a_recovery() -> None:
    t = Telemetry()
    n = node("a", 0, protection={0: Figures(compute_s=0.2, committed_step=1)})
    t.note_compute(n, generation=0, window=2)         # the first step seen: warming up, no sample
    n.protection = {0: Figures(compute_s=0.3, committed_step=2)}
    t.note_compute(n, generation=0, window=2)
    t.note_compute(n, generation=0, window=2)         # the same step again: no second sample
    assert list(t.compute["a"]) == [0.3]
    n.protection = {0: Figures(compute_s=0.4, committed_step=3)}
    t.note_compute(n, generation=1, window=2)         # a recovery: every window starts again
    assert t.compute == {} and t.compute_step == {"a": 3}


def test_jobstate_composes_the_parts(tmp_path: Path) -> None:
    job = JobState(MasterConfig.build(run_dir=tmp_path, nnodes=2, nproc_per_node=1, replicas=1))
    assert job.course.layout.world_size == 2 and job.course.placement and not job.shrunk
    job.members.add_node(node("a", 0, api=True, snapshots={0: [7]}))
    job.members.add_node(node("b", 1, api=True, snapshots={1: [8]}))
    assert job.committed_step() == 7 and job.hot_swap_capable() and job.course.api_mode
    job.relayout(Layout(1, 1))
    assert job.shrunk and job.course.placement == {0: []}   # one node: no copies (MasterConfig.shape.replicas_on)

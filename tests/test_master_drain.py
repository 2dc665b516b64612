"""Planned drains as pure decisions (control/decide.py): admissibility, the step boundary, the restore plan."""
import pytest

from phoenixrun.protocol.figures import Figures
from phoenixrun.control.decide import drain_refusal, drain_step, plan_drain
from phoenixrun.control.state import NodeRecord, PlanError, RankSource, Role
from phoenixrun.status import refusal_text, role_text
from phoenixrun.protocol.client import ControlError
from phoenixrun.topology import Layout


def _node(nid: str, role: Role = Role.ACTIVE, slot: int | None = 0, draining: str | None = None, **kw) -> NodeRecord:
    return NodeRecord(node_id=nid, host="h", agent_pid=1, peer_addr=f"{nid}:1", fault_domain=nid, role=role,
                      slot=slot, draining=draining, **kw)


OK = dict(slot=1, nnodes=2, node=_node("n1", slot=1), spares=1, running=True, hot_swap_capable=True, committed=4)


@pytest.mark.parametrize("change, words", [
    ({}, None),
    ({"slot": 5}, ["no node slot 5", "0..1", "phoenixrun status"]),
    ({"node": None}, ["no active node holds slot 1"]),
    ({"node": _node("n1", role=Role.FAILED, slot=None)}, ["no active node holds slot 1"]),
    ({"node": _node("n1", slot=1, draining="maintenance")}, ["already being drained", "maintenance"]),
    ({"running": False}, ["not running", "drain again"]),
    ({"hot_swap_capable": False}, ["phoenixrun API", "no snapshots to move"]),
    ({"spares": 0}, ["no spare node", "slot 1", "--spares", "then drain again"]),
    ({"committed": None}, ["no step is committed by every rank"]),
    ({"spares": 0, "running": False}, ["not running"]),        # the first problem is named
    ({"warm_spares": 0}, ["no spare is warm yet", "1 spare(s) still starting", "spare (warm)"]),
    ({"warm_spares": 1}, None),
    ({"warm_spares": None}, None),                              # not known (a master that never heard): as before
])
def test_drain_refusal(change, words):
    why = drain_refusal(**{**OK, **change})
    if words is None:
        assert why is None
    else:
        assert why is not None
        for w in words:
            assert w in why, why


@pytest.mark.parametrize("newest, rate, lead, step", [
    (10, None, 1.0, 15),         # rate unknown: 5 steps ahead
    (10, 0.5, 1.0, 12),          # slow job: at least 2 ahead
    (10, 5.0, 1.0, 16),          # 5 steps/s, 1 s stale view + delivery: 6 ahead
    (10, 10.0, 1.0, 18),         # 11 ahead wanted: at most 8
    (10, 10.0, 0.25, 14),
    (0, 4.0, 0.6, 4),            # ceil(2.4) + 1
])
def test_drain_step(newest, rate, lead, step):
    assert drain_step(newest, rate, lead) == step


def _job(snapshots: dict[int, dict[int, list[int]]], spare: bool = True):
    layout = Layout(3, 2)
    nodes = {f"n{s}": _node(f"n{s}", slot=s, snapshots=inv) for s, inv in snapshots.items()}
    if spare:
        nodes["sp"] = _node("sp", role=Role.SPARE, slot=None)
    return layout, nodes, {s: f"n{s}" for s in snapshots}


def test_plan_drain_fetches_from_the_drained_node_at_the_common_step():
    layout, nodes, slots = _job({0: {0: [6, 7], 1: [6, 7]}, 1: {2: [6, 7], 3: [6, 7]}, 2: {4: [6, 7], 5: [6, 7]}})
    plan = plan_drain(layout, nodes, slots, 1, "sp")
    assert plan.restore_step == 7
    assert plan.fetch == {r: RankSource(private=("n1:1",), shared=(("n1:1", r),)) for r in (2, 3)}
    assert plan.slots == {0: "n0", 1: "sp", 2: "n2"} and plan.replaced_slots == {1: "sp"}


def test_plan_drain_takes_the_newest_step_every_rank_has():
    # rank 4 has not committed 8 (it stopped later than the others would have): 7 is the step every rank holds
    layout, nodes, slots = _job({0: {0: [7, 8], 1: [7, 8]}, 1: {2: [7, 8], 3: [7, 8]}, 2: {4: [6, 7], 5: [7, 8]}})
    assert plan_drain(layout, nodes, slots, 0, "sp").restore_step == 7


def test_plan_drain_without_a_spare_resumes_in_place():
    layout, nodes, slots = _job({0: {0: [3], 1: [3]}, 1: {2: [3], 3: [3]}, 2: {4: [3], 5: [3]}}, spare=False)
    plan = plan_drain(layout, nodes, slots, 2, None)
    assert (plan.restore_step, plan.fetch, plan.replaced_slots, plan.slots) == (3, {}, {}, slots)


def test_plan_drain_without_a_common_step():
    layout, nodes, slots = _job({0: {0: [3], 1: [3]}, 1: {2: [4], 3: [4]}, 2: {4: [3], 5: [3]}})
    with pytest.raises(PlanError, match="no snapshot step"):
        plan_drain(layout, nodes, slots, 1, "sp")


@pytest.mark.parametrize("node, text", [
    ({"role": "active"}, "active"),
    ({"role": "active", "draining": "maintenance"}, "draining"),
    ({"role": "drained", "draining": "maintenance"}, "drained"),
    ({"role": "spare", "draining": None}, "spare"),
])
def test_role_text(node, text):
    assert role_text(node) == text


@pytest.mark.parametrize("err, text", [
    (ControlError('master refused /v1/drain: HTTP 409 {"error":"refused: cannot drain slot 1: no spare","reason":"x"}',
                  409), "cannot drain slot 1: no spare"),
    (ControlError("cannot reach master at http://h:1: refused"), "cannot reach master at http://h:1: refused"),
    (ControlError("master refused /v1/drain: HTTP 500 oops", 500), "master refused /v1/drain: HTTP 500 oops"),
])
def test_refusal_text(err, text):
    assert refusal_text(err) == text


# ---------------------------------------------------------------- the master's answers, wired as in a job
from phoenixrun import auth  # noqa: E402
from phoenixrun.control.events import read_events  # noqa: E402
from phoenixrun.control.master import Master, MasterConfig  # noqa: E402
from phoenixrun.control.state import Phase  # noqa: E402
from phoenixrun.protocol.messages import MessageError  # noqa: E402
from phoenixrun.protocol.directives import Stop  # noqa: E402


def _running(tmp_path, spares: int = 0, warm: bool = True) -> Master:
    """A master whose 2 nodes (1 rank each) run an API job with a committed step, and `spares` spares (their
    pre-started workers up, as their heartbeats say, unless `warm` is False)."""
    m = Master(MasterConfig.build(run_dir=tmp_path, nnodes=2, nproc_per_node=1, node_timeout=1e6), auth.new_secret())
    m.store_port = 0
    for nid in ("a", "b", *(f"s{i}" for i in range(spares))):
        m.register({"node_id": nid, "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:1"})
    with m.cv:
        m.job.course.phase = Phase.RUNNING
        m.job.course.api_mode = True
        for r, nid in enumerate(("a", "b")):
            m.nodes[nid].snapshots = {r: [3, 4]}
        for i in range(spares):
            m.nodes[f"s{i}"].warm_ready = warm
    while not m._inbox.empty():
        m._inbox.get_nowait()
    return m


def test_a_drain_onto_a_spare_still_starting_is_refused_until_it_is_warm(tmp_path):
    """Drains were accepted onto a spare whose workers were not up yet: the whole job paused 12.8-22.4 s."""
    m = _running(tmp_path, spares=1, warm=False)
    with pytest.raises(MessageError) as e:
        m.drain({"slot": 1})
    assert e.value.code == 409 and "no spare is warm yet" in str(e.value)
    m.nodes["s0"].warm_ready = True          # its heartbeat says its workers are up
    assert m.drain({"slot": 1})["ok"]
    m.events.close()


@pytest.mark.parametrize("payload, code, words", [
    ({"slot": 1}, 409, ["cannot drain slot 1", "no spare node", "--spares"]),
    ({"slot": 5}, 400, ["slot 5 is outside the job's slots 0..1"]),
    ({"slot": "1"}, 400, ["slot must be a slot number"]),
])
def test_a_drain_the_master_cannot_carry_out_is_refused_with_the_problem(tmp_path, payload, code, words):
    m = _running(tmp_path)
    with pytest.raises(MessageError) as e:
        m.drain(payload)
    assert e.value.code == code
    for w in words:
        assert w in str(e.value)
    assert m._inbox.empty()


def test_an_admissible_drain_is_queued_for_the_controller(tmp_path):
    m = _running(tmp_path, spares=1)
    assert m.drain({"slot": 1, "reason": "kernel update"}) == {"ok": True, "node": "b", "slot": 1}
    ev = m._inbox.get_nowait()
    assert isinstance(ev, reports.Drain)
    assert (ev.node_id, ev.reason, ev.by) == ("b", "kernel update", "operator")


def test_a_sigterm_drain_without_a_spare_leaves_as_before(tmp_path):
    """No spare: the agent that asked is told to stop as on SIGTERM and its slot is handled as a node that left."""
    m = _running(tmp_path)
    m.coordinator._drain(m.nodes["b"], 1, reports.Drain(node_id="b", reason="agent got SIGTERM", t=1.0))
    d = m.directives.get("b").decoded().order
    assert isinstance(d, Stop) and d.exit_code == 143 and d.reason is not None and "no spare node" in d.reason
    left = m._inbox.get_nowait()
    assert isinstance(left, reports.Left) and left.node_id == "b" and "drain refused" in left.detail
    m.events.close()
    req = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "drain_requested"]
    assert [(e["node"], e["slot"], e["by"], e["accepted"]) for e in req] == [("b", 1, "agent", False)]
    assert "no spare node" in req[0]["refusal"]


# ---------------------------------------------------------------- stragglers (decide.stragglers)
from phoenixrun.control.decide import stragglers  # noqa: E402
from phoenixrun.protocol import reports


@pytest.mark.parametrize("samples, ratio, window, found", [
    ({0: [1.0] * 4, 1: [1.0] * 4, 2: [3.0] * 4}, 2.0, 4, {2: 3.0}),          # 3x its peers' median
    ({0: [1.0] * 4, 1: [1.0] * 4, 2: [1.9] * 4}, 2.0, 4, {}),                # under the threshold
    ({0: [1.0] * 4, 1: [3.0] * 4}, 2.0, 4, {1: 3.0}),                        # two nodes: the other is the peer
    ({0: [1.0] * 4, 1: [1.0, 1.0, 9.0, 1.0]}, 2.0, 4, {}),                  # one slow step is no straggler
    ({0: [1.0] * 4, 1: [1.0, 9.0, 9.0, 9.0]}, 2.0, 4, {1: 9.0}),            # persistently slow
    ({0: [1.0] * 4, 1: [9.0] * 3}, 2.0, 4, {}),                              # not judged before `window` samples
    ({0: [1.0] * 4}, 2.0, 4, {}),                                            # no peer
    ({0: [0.0] * 4, 1: [1.0] * 4}, 2.0, 4, {}),                              # peers measuring 0: no base
    ({0: [9.0] * 4 + [1.0] * 4, 1: [1.0] * 8}, 2.0, 4, {}),                 # only the last `window` count
    ({0: [1.0] * 4, 1: [1.0] * 4, 2: [2.0] * 4, 3: [2.0] * 4}, 2.5, 4, {}),   # half the job 2x slower, threshold 2.5
])
def test_stragglers(samples, ratio, window, found):
    # one window: the ratio and margin rules alone (persistence over windows: tests/test_straggler_decision.py)
    assert stragglers(samples, ratio, window, windows=1) == found


def test_compute_samples_one_per_step_and_start_again_after_a_recovery(tmp_path):
    m = _running(tmp_path)
    node = m.nodes["b"]

    def beat(step, *compute):
        node.protection = {r: Figures(committed_step=step, compute_s=c) for r, c in enumerate(compute)}
        m.job.note_compute(node)
    beat(1, 0.5, 0.5)                       # the first step seen: skipped (warm-up)
    beat(2, 0.1, 0.3)
    beat(2, 0.1, 0.9)                       # the same committed step again: not a new sample
    beat(3, 0.2, 0.1)
    assert list(m.job.telemetry.compute["b"]) == [0.3, 0.2]          # one per step, the node's slowest rank
    m.job.course.generation += 1                   # a recovery
    beat(4, 0.7, 0.7)
    beat(5, 0.4, 0.4)
    assert list(m.job.telemetry.compute["b"]) == [0.4]


def test_a_drain_whose_restore_fails_its_checksum_becomes_a_hot_swap(tmp_path, monkeypatch):
    """The spare's fetch from the drained node fails the checksum (`restore_failed` with integrity): the drain
    is interrupted and the slot hot-swapped from the other sources (a PlanError crashed the master, exit 70)."""
    m = _running(tmp_path, spares=1)
    swaps = []
    monkeypatch.setattr(m.recovery, "hot_swap", lambda lost, node, ev, action, code, fresh=None:
                        swaps.append((set(lost), node.node_id, dict(fresh or {}))))
    g = m.job.course.generation + 1
    for r, nid in enumerate(("a", "b")):
        m._inbox.put(reports.Quiesced(node_id=nid, generation=g, next_step=5, snapshots={r: [3, 4]}))
    m._inbox.put(reports.RestoreFailed(node_id="s0", generation=g, reason="checksum mismatch", integrity=True))
    m.recovery.drain(m.nodes["b"], 1, "kernel update", 1.0)
    assert swaps == [(set(), "b", {1: "s0"})]
    assert m.directives.get("b").command == "stop"
    m.events.close()

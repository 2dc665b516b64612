"""The measured recovery curve (phoenixrun/sim/recovery_curve.py): composed from benchmark results only, a point
exactly where the control plane was measured, each result file read or refused with a line that names it; and
`phoenixrun simulate --scale-result ... --rank-result ...` on top of it."""
import json

import pytest
from click.testing import CliRunner

from phoenixrun.sim.cli import simulate
from phoenixrun.sim.recovery_curve import (ControlPoint, CurveError, RankPhases, compose, efficiency, load_control,
                                           load_ranks)

RANKS = RankPhases(gpus=8, trials=3, quiesce_s=0.2, restore_s=0.5, fetch_s=0.1, rebuild_s=0.3, state_s=0.05,
                   source="r.json")


def cp(gpus: int, detect: float, control: float, fault: str = "kill", source: str = "s.json") -> ControlPoint:
    return ControlPoint(gpus // 4, gpus, detect, control, fault, source)


def test_a_point_is_detection_plus_control_plane_plus_what_ranks_add():
    [p] = compose([cp(4096, 0.12, 1.3)], RANKS)
    assert (p.gpus, p.nodes, p.fault) == (4096, 1024, "kill")
    assert p.ranks_s == pytest.approx(0.7)                       # quiesce + restore; the restore's parts not again
    assert p.total_s == pytest.approx(0.12 + 1.3 + 0.7)
    assert p.sources == ("s.json", "r.json")


@pytest.mark.parametrize("runs, expected_control", [
    ([1.0], 1.0),
    ([3.0, 1.0, 2.0], 2.0),              # the median run
    ([4.0, 1.0], 1.0),                   # an even count: the lower of the two middle runs, a run that happened
])
def test_repeated_runs_at_one_size_give_the_median_run_not_a_blend(runs, expected_control):
    [p] = compose([cp(1024, 0.1, c, source=f"{c}.json") for c in runs], RANKS)
    assert p.control_s == expected_control and p.sources[0] == f"{expected_control}.json"


def test_points_only_where_measured_smallest_first_per_fault():
    points = compose([cp(65536, 0.1, 3.0), cp(1024, 0.1, 0.05), cp(1024, 5.2, 0.05, "silent"), cp(4096, 0.1, 0.2)],
                     RANKS)
    assert [(p.gpus, p.fault) for p in points] == [(1024, "kill"), (1024, "silent"), (4096, "kill"), (65536, "kill")]
    assert all(p.ranks_s == RANKS.total_s for p in points)        # per rank: the same at every size
    with pytest.raises(CurveError, match="no control-plane measurement"):
        compose([], RANKS)


def test_efficiency_is_the_papers_first_order_model():
    assert efficiency(1080, 30, 20, 0.5) == pytest.approx(1080 / 1120)   # docs/simulate.md's worked example


def _scale_result(path, nodes=1024, **recovery):
    rec = {"detect_s": 0.5, "detect_after_fault_s": 0.12, "fault_to_all_resumed_s": 1.4, "fault": "kill", **recovery}
    path.write_text(json.dumps({"config": {"nodes": nodes, "nproc_per_node": 4}, "recovery": rec}))
    return path


def test_control_point_from_a_master_scale_result(tmp_path):
    c = load_control(_scale_result(tmp_path / "s.json"))
    assert (c.nodes, c.gpus, c.detect_s, c.control_s, c.fault, c.source) == (1024, 4096, 0.12, 1.4, "kill", "s.json")
    old = tmp_path / "old.json"      # written before detect_after_fault_s: a stopped node, found by the timeout
    old.write_text(json.dumps({"config": {"nodes": 256, "nproc_per_node": 4},
                               "recovery": {"detect_s": 5.2, "fault_to_all_resumed_s": 0.05}}))
    c = load_control(old)
    assert (c.detect_s, c.fault) == (5.2, "silent, timeout")


@pytest.mark.parametrize("content, match", [
    (None, "no such file"),
    ("not json", "not readable JSON"),
    ("[1, 2]", "a JSON object expected"),
    (json.dumps({"config": {"nodes": 4, "nproc_per_node": 4}}), "did not complete has no `recovery`"),
    (json.dumps({"config": {"nodes": 4, "nproc_per_node": 4}, "recovery": {"detect_s": 1}}),
     "`fault_to_all_resumed_s` is missing"),
    (json.dumps({"config": {"nodes": 4, "nproc_per_node": 4},
                 "recovery": {"detect_s": -1, "fault_to_all_resumed_s": 1}}), "`detect_s` is missing or not"),
])
def test_a_file_that_is_not_a_scale_result_is_refused_by_name(tmp_path, content, match):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CurveError, match=match) as e:
        load_control(path)
    assert str(path) in str(e.value)


def test_rank_phases_from_recovery_py_medians_and_old_names(tmp_path):
    trials = [{"exit_code": 0, "phases": {"quiesce_s": q, "restore_s": r, "rebuild_s": r - 0.1, "fetch_s": 0.02,
                                          "optimizer_s": 0.01}} for q, r in ((0.1, 0.4), (0.3, 0.6), (0.2, 0.5))]
    trials.append({"exit_code": 1, "phases": {"quiesce_s": 99, "restore_s": 99}})     # a failed trial: not counted
    path = tmp_path / "recovery.json"
    path.write_text(json.dumps({"config": {"nodes": 4, "nproc": 2}, "phoenixrun": trials}))
    r = load_ranks(path)
    assert (r.gpus, r.trials, r.quiesce_s, r.restore_s) == (8, 3, 0.2, 0.5)
    assert r.rebuild_s == pytest.approx(0.4) and r.state_s == 0.01 and r.fetch_s == 0.02
    assert r.total_s == pytest.approx(0.7)


def test_rank_phases_from_detection_py_node_loss_rows(tmp_path):
    rows = [{"phases": {"quiesce_s": 0.2, "restore_s": 0.9}}, {"phases": {"quiesce_s": 0.4, "restore_s": 1.1}}]
    path = tmp_path / "detection.json"
    path.write_text(json.dumps({"config": {"size": "d256"}, "classes": {"node-loss": {"rows": rows}}}))
    r = load_ranks(path)
    assert (r.gpus, r.trials, r.quiesce_s, r.restore_s, r.state_s) == (4, 2, pytest.approx(0.3), 1.0, None)


@pytest.mark.parametrize("doc, match", [
    ({"classes": {"hang": {"rows": []}}}, "not a recovery.py or detection.py result"),
    ({"config": {"nodes": 2}, "phoenixrun": [{"exit_code": 1, "phases": {}}]}, "no completed node-loss trial"),
    ({"config": {"nodes": 2}, "phoenixrun": [{"exit_code": 0, "phases": {"restore_s": 1}}]}, "`quiesce_s` phase"),
])
def test_a_file_without_node_loss_phases_is_refused(tmp_path, doc, match):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CurveError, match=match):
        load_ranks(path)


def test_simulate_prints_the_measured_curve_and_refuses_half_of_it(tmp_path):
    ranks = tmp_path / "r.json"
    ranks.write_text(json.dumps({"config": {"nodes": 4, "nproc": 2}, "phoenixrun": [
        {"exit_code": 0, "phases": {"quiesce_s": 0.2, "restore_s": 0.5}}]}))
    a, b = _scale_result(tmp_path / "a.json", 256), _scale_result(tmp_path / "b.json", 4096, fault_to_all_resumed_s=2.5)
    run = CliRunner().invoke
    r = run(simulate, ["--example", "paper-18.8x", "--trials", "200", "--json", "--scale-result", str(a),
                       "--scale-result", str(b), "--rank-result", str(ranks)])
    assert r.exit_code == 0, r.output
    curve = json.loads(r.output)["curve"]
    assert [row["gpus"] for row in curve] == [1024, 16384]
    assert curve[1]["total_s"] == pytest.approx(0.12 + 2.5 + 0.7)
    mc = curve[0]["monte_carlo"]
    assert mc["hot_swap_eta"]["lo"] <= curve[0]["eta_exact"]["hot_swap"] <= mc["hot_swap_eta"]["hi"] + 1e-4
    r = run(simulate, ["--scale-result", str(a)])
    assert r.exit_code == 2 and "needs both --scale-result" in r.output
    r = run(simulate, ["--scale-result", str(tmp_path / "missing.json"), "--rank-result", str(ranks)])
    assert r.exit_code == 2 and "missing.json: no such file" in r.output and "Traceback" not in r.output

"""Monte Carlo simulator and the `simulate` command."""

import json
import sys

import pytest
from click.testing import CliRunner

from phoenixrun.sim import model as m
from phoenixrun.sim import montecarlo as mc
from phoenixrun.sim.cli import simulate

# t 1 s, 10 steps, checkpoint every 5 steps costing 1 s, restart 3 s, hot swap 2 s, phi 0.5
SMALL = m.Scenario(mttf_s=100.0, t_step_s=1.0, steps=10, ckpt_interval=5, ckpt_overhead_s=1.0,
                   t_restart_s=3.0, t_hotswap_s=2.0, phi=0.5)

# Rare failures (MTTF >> restart, checkpoint interval): the paper's closed form is accurate here.
RARE = m.Scenario(mttf_s=1e6, t_step_s=0.1, steps=10**8, ckpt_interval=1000, ckpt_overhead_s=0.0,
                  t_restart_s=200.0, t_hotswap_s=20.0, phi=0.5)


def test_no_failures_costs_only_checkpoint_writes():
    c = mc.simulate_ckpt(SMALL, iter([]))
    h = mc.simulate_hotswap(SMALL, iter([]))
    assert (c.failures, c.lost_s, c.overhead_s) == (0, 1.0, 1.0)  # one write: none after the last step
    assert (h.failures, h.lost_s) == (0, 0.0)


def test_one_failure_by_hand():
    # ckpt: segment 1 (5 s + write) ends at 6; failure at 7.5 loses 1.5 s of segment 2,
    # restart to 10.5, redo 5 s -> wall 15.5, lost 5.5 = write 1 + restart 3 + rework 1.5
    c = mc.simulate_ckpt(SMALL, iter([7.5]))
    assert (c.failures, c.overhead_s, c.recovery_s, c.rework_s) == (1, 1.0, 3.0, 1.5)
    # hot swap: keep 7.5 s of progress, window 2 + 0.5 s -> lost 2.5
    h = mc.simulate_hotswap(SMALL, iter([7.5]))
    assert (h.failures, h.recovery_s, h.rework_s) == (1, 2.0, 0.5)


def test_failure_during_recovery_restarts_it():
    # ckpt: second failure at 9 hits the restart (7.5..10.5): restart again 9..12, redo -> wall 17
    c = mc.simulate_ckpt(SMALL, iter([7.5, 9.0]))
    assert (c.failures, c.recovery_s, c.rework_s, c.lost_s) == (2, 4.5, 1.5, 7.0)
    # hot swap: the window 7.5..10 is hit at 9, runs again 9..11.5, then 2.5 s of work -> wall 14
    h = mc.simulate_hotswap(SMALL, iter([7.5, 9.0]))
    assert (h.failures, h.lost_s) == (2, pytest.approx(4.0))
    # failures after the job ends do not count
    assert mc.simulate_hotswap(SMALL, iter([100.0])).failures == 0


def test_seeded_runs_are_reproducible():
    s = mc.PRESETS["paper"]
    assert mc.run(s, trials=200, seed=7) == mc.run(s, trials=200, seed=7)
    assert mc.run(s, trials=200, seed=7) != mc.run(s, trials=200, seed=8)


def test_matches_paper_closed_form_where_it_is_accurate():
    r = mc.run(RARE, trials=1000, seed=0)
    p = m.paper_prediction(RARE)
    assert 5 < r.ckpt.failures < 15  # the scenario really exercises failures
    assert r.ckpt.efficiency.contains(p.eta_ckpt)
    assert r.hotswap.efficiency.contains(p.eta_phoenix)
    assert r.speedup.contains(p.speedup)


@pytest.mark.parametrize("name", sorted(mc.PRESETS))
def test_matches_exact_expectation_on_presets(name):
    # The presets break the paper's assumptions (paper: MTTF < restart + checkpoint interval),
    # but the simulator must still agree with its own exact expectation.
    s = mc.PRESETS[name]
    r = mc.run(s, seed=0)
    assert r.ckpt.lost_s.contains(m.expected_lost_ckpt(s))
    assert r.hotswap.lost_s.contains(m.expected_lost_hotswap(s))
    assert r.ckpt.lost_s.lo > 50 * r.hotswap.lost_s.hi  # hot swap wins by far on both


def test_trace_file(tmp_path):
    path = tmp_path / "failures.txt"
    path.write_text("# seconds since start\n7.5\n\n9\n")
    assert mc.load_trace(path) == [7.5, 9.0]
    r = mc.run(SMALL, trace=mc.load_trace(path))
    assert r.trials == 1 and r.seed is None
    assert r.ckpt.lost_s.mean == 7.0 and r.ckpt.failures == 2


def test_runaway_scenario_is_refused():
    with pytest.raises(ValueError, match="too many to simulate"):
        mc.run(m.Scenario(mttf_s=10, t_step_s=20, steps=1000, ckpt_interval=1000, ckpt_overhead_s=0,
                          t_restart_s=0, t_hotswap_s=0))


# --- CLI ---------------------------------------------------------------------


def invoke(*args):
    return CliRunner().invoke(simulate, list(args))


def test_cli_table_shows_the_worked_example():
    r = invoke("--example", "paper", "--trials", "300")
    assert r.exit_code == 0, r.output
    assert "0.4037" in r.output and "0.9643" in r.output
    assert "MC lost s [95% CI]" in r.output and "speed-up" in r.output


def test_cli_json_parses_and_overrides_apply():
    r = invoke("--example", "paper-18.8x", "--mttf", "50000", "--trials", "200", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["scenario"]["mttf_s"] == 50000 and out["scenario"]["steps"] == 100_000
    assert out["monte_carlo"]["trials"] == 200 and out["monte_carlo"]["seed"] == 3
    lo, hi = out["monte_carlo"]["checkpoint_restart"]["lost_s"]["ci95"]
    assert lo <= out["monte_carlo"]["checkpoint_restart"]["lost_s"]["mean"] <= hi
    assert out["closed_form"]["paper"]["efficiency"]["hot_swap"] == pytest.approx(50000 / 50031.04)


def test_cli_trace(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("7.5\n9\n")
    r = invoke("--steps", "10", "--t-step", "1", "--ckpt-every", "5", "--ckpt-cost", "1", "--restart", "3",
               "--hotswap", "2", "--trace", str(path), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["monte_carlo"]["checkpoint_restart"]["lost_s"]["mean"] == 7.0


@pytest.mark.parametrize("args, message", [
    (["--restart", "-5"], "Invalid value for '--restart'"),
    (["--ckpt-every", "0"], "Invalid value for '--ckpt-every'"),
    (["--phi", "1"], "Invalid value for '--phi'"),
    (["--mttf", "0"], "Invalid value for '--mttf'"),
    (["--trials", "0"], "Invalid value for '--trials'"),
    (["--example", "nope"], "Invalid value for '--example'"),
    (["--mttf", "10", "--ckpt-every", "1000"], "too many to simulate"),
])
def test_cli_bad_input_exits_2(args, message):
    r = invoke(*args)
    assert r.exit_code == 2
    assert message in r.output
    assert "Traceback" not in r.output


def test_cli_bad_trace_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("5\nsoon\n")
    r = invoke("--trace", str(path))
    assert r.exit_code == 2 and "line 2: 'soon' is not a number" in r.output


def test_cli_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    r = invoke("--plot", str(tmp_path / "x.png"))
    assert r.exit_code == 2
    assert "pip install 'phoenixrun[plot]'" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.png").exists()


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "x.png"
    r = invoke("--trials", "100", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

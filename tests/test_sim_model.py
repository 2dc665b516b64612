"""The closed-form cost model pinned to hand-computed values (docs/simulate.md, "The model")."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phoenixrun.sim import model as m
from phoenixrun.sim.montecarlo import PRESETS


def test_replay_steps_is_half_the_interval_minus_one():
    assert m.expected_replay_steps(100) == 49.5
    assert m.expected_replay_steps(1) == 0.0


def test_costs_per_failure():
    # 5 + 600 + 20 * 49.5
    assert m.expected_cost_ckpt(5, 600, 20, 100) == 1595.0
    # 30 + 20 * 0.5, no per-step overhead by default
    assert m.expected_cost_phoenix(30, 20, 0.5) == 40.0
    assert m.expected_cost_phoenix(30, 20, 0.5, c_overhead_s=5) == 45.0


def test_paper_worked_example_gives_0404_and_0964():
    p = m.paper_prediction(PRESETS["paper"])
    assert p.cost_ckpt_s == 1595.0 and p.cost_phoenix_s == 40.0
    assert p.eta_ckpt == pytest.approx(1080 / 2675) and round(p.eta_ckpt, 3) == 0.404
    assert p.eta_phoenix == pytest.approx(1080 / 1120) and round(p.eta_phoenix, 3) == 0.964
    assert p.speedup == pytest.approx(1595 / 40)


def test_phoenix_must_not_be_charged_the_checkpoint_overhead():
    # With the 5 s overhead PHOENIX would get 1080/1125 = 0.960, not the paper's 0.964.
    assert round(m.efficiency(1080, m.expected_cost_phoenix(30, 20, 0.5, c_overhead_s=5)), 3) == 0.960
    # checkpoint-restart's 0.404 holds whatever the overhead convention: lump 5 s, none, or amortised 2.7 s
    for overhead in (5.0, 0.0, 5.0 * 1080 / 2000):
        assert round(m.efficiency(1080, m.expected_cost_ckpt(overhead, 600, 20, 100)), 3) == 0.404


def test_rates_and_system_mttf():
    assert m.failure_rate(1080) == pytest.approx(1 / 1080)
    assert m.system_mttf(6_656_000, 64) == 104_000
    assert PRESETS["paper-18.8x"].mttf_s == 104_000


def test_loss_probability_bounds():
    assert m.p_loss_independent(64, 1e-3, 1) == pytest.approx(64e-6)
    assert m.p_loss_independent(64, 1e-3, 2) == pytest.approx(64e-9)
    assert m.p_loss_fault_domains(8, 0.01, 1) == pytest.approx(8e-4)
    assert m.p_loss_independent(1000, 0.5, 0) == 1.0  # a bound, clipped to a probability


def test_exposed_time_hand_values():
    # lambda W = 1, no restart: 1000 (e - 1)
    assert m.expected_exposed_time(1000, 0, 1e-3) == pytest.approx(1000 * (math.e - 1))
    # restart scales it by e^(lambda R)
    assert m.expected_exposed_time(1000, 500, 1e-3) == pytest.approx(1000 * (math.e - 1) * math.exp(0.5))
    assert m.expected_exposed_time(1e6, 0, 1.0) == math.inf


def test_checkpoint_segments():
    s = PRESETS["paper"]  # 1000 steps, K 100: 9 writes, the last segment has none
    assert m.ckpt_segments(s) == [(2005.0, 9), (2000.0, 1)]
    assert m.ckpt_segments(dataclasses.replace(s, steps=250)) == [(2005.0, 2), (1000.0, 1)]
    assert m.ckpt_segments(dataclasses.replace(s, steps=50)) == [(2005.0, 0), (1000.0, 1)]


def test_exact_lost_time_hand_values():
    s = PRESETS["paper"]
    assert m.expected_lost_hotswap(s) == pytest.approx(20000 * math.expm1(40 / 1080))
    seg = lambda w: math.exp(600 / 1080) * math.expm1(w / 1080) * 1080  # noqa: E731
    assert m.expected_lost_ckpt(s) == pytest.approx(9 * seg(2005) + seg(2000) - 20000)
    e = m.exact_prediction(s)
    assert round(e.eta_ckpt, 3) == 0.197  # failures during restart and replay: far below 0.404
    assert round(e.eta_phoenix, 3) == 0.964


def test_exact_matches_first_order_when_failures_are_rare():
    # MTTF >> restart and checkpoint interval: exact lost time per failure ->
    # restart + K/2 steps (the paper's (K-1)/2 plus the interrupted half step), hot swap -> T + phi t
    s = m.Scenario(mttf_s=1e7, t_step_s=0.1, steps=10**9, ckpt_interval=1000, ckpt_overhead_s=0.0,
                   t_restart_s=200.0, t_hotswap_s=20.0, phi=0.5)
    failures = s.fault_free_s / s.mttf_s
    assert m.expected_lost_ckpt(s) / failures == pytest.approx(200 + 50, rel=1e-3)
    assert m.expected_lost_hotswap(s) / failures == pytest.approx(20.05, rel=1e-3)
    assert m.exact_prediction(s).eta_ckpt == pytest.approx(m.paper_prediction(s).eta_ckpt, rel=1e-4)


@pytest.mark.parametrize("field, value", [
    ("mttf_s", 0.0), ("t_step_s", -1.0), ("t_restart_s", -5.0), ("t_hotswap_s", math.inf),
    ("ckpt_overhead_s", -0.1), ("ckpt_interval", 0), ("steps", 0), ("phi", 1.0), ("phi", -0.01),
])
def test_scenario_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(PRESETS["paper"], **{field: value})


def test_scenario_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["paper"].mttf_s = 1.0


@given(mttf=st.floats(1, 1e9), c1=st.floats(0, 1e6), c2=st.floats(0, 1e6))
def test_efficiency_is_a_fraction_decreasing_in_cost(mttf, c1, c2):
    lo, hi = sorted((c1, c2))
    assert 0 < m.efficiency(mttf, hi) <= m.efficiency(mttf, lo) <= 1

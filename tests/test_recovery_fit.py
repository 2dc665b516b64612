"""The recovery-time scaling fit, on synthetic data with known answers."""
import json
import math
import random

import pytest

from phoenixrun.sim.recovery_fit import (FitError, PowerLaw, efficiency, fit_phases, fit_power_law, load_samples,
                                         predict_total, scale_table, t975)


def test_exact_power_law_is_recovered_with_zero_width():
    pts = [(n, 0.02 * n ** 0.5) for n in (2, 4, 8, 16, 64)]
    f = fit_power_law("q", pts)
    assert f.a == pytest.approx(0.02) and f.b == pytest.approx(0.5)
    assert f.s == pytest.approx(0.0, abs=1e-12)
    lo, hi = f.interval(100_000)
    assert lo == pytest.approx(0.02 * 100_000 ** 0.5) == pytest.approx(hi)


def test_noisy_fit_interval_covers_truth_and_widens_away_from_data():
    rng = random.Random(1)
    truth = lambda n: 0.5 * n ** 0.3  # noqa: E731
    pts = [(n, truth(n) * math.exp(rng.gauss(0, 0.2))) for n in (2, 3, 4, 6, 8, 12) for _ in range(3)]
    f = fit_power_law("r", pts)
    assert abs(f.b - 0.3) < 0.15
    assert f.s == pytest.approx(0.2, abs=0.08)
    for n in (4, 1000, 100_000):
        lo, hi = f.interval(n)
        assert lo < truth(n) < hi
    width = lambda n: math.log(f.interval(n)[1] / f.interval(n)[0])  # noqa: E731
    assert width(5) < width(1000) < width(100_000)
    assert not f.extrapolated(6) and f.extrapolated(100_000)


def test_zero_times_are_floored_and_bad_input_refused():
    f = fit_power_law("p", [(2, 0.0), (4, 0.0), (8, 0.0)])
    assert f.median(1000) == pytest.approx(1e-4)
    with pytest.raises(FitError, match="at least 3"):
        fit_power_law("p", [(2, 1.0), (4, 1.0)])
    with pytest.raises(FitError, match="at least 3"):
        fit_power_law("p", [(4, 1.0), (4, 2.0), (4, 3.0)])     # one size: no slope
    with pytest.raises(FitError, match="positive"):
        fit_power_law("p", [(0, 1.0), (4, 2.0), (8, 3.0)])


def test_t_quantiles():
    assert t975(1) == pytest.approx(12.706) and t975(10) == pytest.approx(2.228)
    assert t975(11) == pytest.approx(2.228) and t975(1000) == 1.96   # conservative between table rows


def test_total_sums_phases_and_its_interval():
    exact = {"a_s": fit_power_law("a_s", [(n, 1.0) for n in (2, 4, 8)]),
             "b_s": fit_power_law("b_s", [(n, 0.001 * n) for n in (2, 4, 8)])}
    p = predict_total(exact, ("a_s", "b_s"), 10_000)
    assert p.median_s == pytest.approx(11.0) and p.lo_s == pytest.approx(11.0) and p.extrapolated
    noisy = PowerLaw("c_s", a=1.0, b=0.0, s=0.5, n=10, mean_lx=1.0, sxx=4.0, n_min=2, n_max=8)
    q = predict_total({"c_s": noisy}, ("c_s",), 4, draws=20000)
    half = t975(8) * noisy.log_sd(4)
    assert q.lo_s == pytest.approx(math.exp(-half), rel=0.05) and q.hi_s == pytest.approx(math.exp(half), rel=0.05)
    with pytest.raises(FitError, match="no samples"):
        predict_total(exact, ("a_s", "zzz"), 10)


def test_samples_file_round_trip_and_scale_table(tmp_path):
    samples = [{"gpus": n, "phases": {"x_s": 0.1 * n, "y_s": 2.0}, "source": "synthetic"} for n in (2, 4, 8, 16)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"samples": samples}))
    fits = fit_phases(load_samples(path))
    assert set(fits) == {"x_s", "y_s"} and fits["x_s"].b == pytest.approx(1.0)
    rows = scale_table(fits, ("x_s", "y_s"), [1000, 100_000], gpu_mttf_s=1e8, t_step_s=2.0, phi=0.5)
    r = rows[1]
    assert r["recovery_s"] == pytest.approx(10_002.0) and r["mttf_s"] == pytest.approx(1000.0)
    assert r["eta"] == pytest.approx(efficiency(1000.0, 10_002.0, 2.0, 0.5)) == pytest.approx(1000 / 11_003)
    assert rows[0]["eta"] > rows[1]["eta"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(FitError, match="not a samples file"):
        load_samples(bad)

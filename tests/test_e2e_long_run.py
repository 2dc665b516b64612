"""benchmarks/long_run.py at a small size: a protected run's steps at its end are as fast as at its start, and the
state dict the example snapshots does not grow with the run (issue 31 item 6: the example kept a loss and a time
per step in `state`, encoded whole with every snapshot; the median step went from 30 ms to 148 ms over 8,000
steps). The 10,000-step figure is in docs/benchmarks.md."""
import pytest

from benchmarks.long_run import run

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(900)
def test_steps_do_not_slow_down_and_state_does_not_grow(tmp_path):
    small = run(tmp_path / "a", steps=40, span=10, warmup=5)
    r = run(tmp_path / "b", steps=400, span=100, warmup=20)
    # the state the snapshot encodes is the same size after 40 and 400 steps (before: ~55 bytes more a step)
    assert abs(r["state_bytes"] - small["state_bytes"]) <= 8 and r["state_bytes"] < 400, (small, r)   # pids' digits
    assert r["ratio"] < 1.5, r      # a loose bound: 2 loaded cores; the 10,000-step run measures it

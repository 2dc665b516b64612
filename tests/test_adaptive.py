from phoenixrun.runtime.adaptive import Sample, choose_interval


def test_hidden_transfer_keeps_every_step():
    assert choose_interval([Sample(d2h_s=0.01, h2h_s=0.02, window_s=0.3, step_s=0.4)] * 5) == 1
    assert choose_interval([]) == 1


def test_slow_replication_spreads_over_steps():
    # 0.05 s copy + 0.9 s replication against a 0.3 s window of a 0.4 s step -> 0.65 s left over
    assert choose_interval([Sample(0.05, 0.9, 0.3, 0.4)] * 5) == 1 + 2


def test_interval_is_capped_and_uses_medians():
    assert choose_interval([Sample(0.0, 100.0, 0.1, 0.2)] * 3, max_every=8) == 8
    noisy = [Sample(0.01, 0.02, 0.3, 0.4)] * 4 + [Sample(0.01, 50.0, 0.3, 0.4)]
    assert choose_interval(noisy) == 1

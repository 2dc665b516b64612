"""decide.stragglers: evidence that survives noise (issue 31 item 7). A node is flagged only when it is slower than
its peers by the ratio AND by more than `margin` median absolute deviations, in each of `windows` consecutive
disjoint windows. Measured before: a fault-free 2-node run on a loaded machine flagged both nodes in turn (45
events, ratio 2.0-2.5), each a drain under --replace-stragglers."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.control.decide import stragglers

W, N, R = 4, 3, 2.0          # window, windows, ratio


def flagged(samples, **kw):
    return stragglers(samples, R, W, windows=N, **kw)


@pytest.mark.parametrize("samples, found", [
    ({0: [1.0] * 12, 1: [3.0] * 12}, {1: 3.0}),                               # slow in all 3 windows
    ({0: [1.0] * 12, 1: [1.0] * 4 + [3.0] * 8}, {}),                          # slow in the newest 2 of 3 only
    ({0: [1.0] * 12, 1: [3.0] * 11}, {}),                                     # not judged before N x W samples
    # in turn, as measured on a loaded machine: each node slow for a window or two, never three running
    ({0: [2.5] * 4 + [1.0] * 4 + [2.5] * 4, 1: [1.0] * 4 + [2.5] * 4 + [1.0] * 4}, {}),
    ({0: [1.0] * 8 + [2.5] * 4, 1: [2.5] * 8 + [1.0] * 4}, {}),
    # a ratio of 2.5 on samples scattered over 1-4 (a loaded node), against peers scattered as much: in the noise
    ({0: [1.0, 4.0, 1.5, 3.0] * 3, 1: [2.0, 3.5, 4.0, 1.0] * 3, 2: [1.2, 1.0, 3.8, 1.4] * 3}, {}),
    # the same ratio from a steady node is a straggler
    ({0: [1.0, 1.1, 0.9, 1.0] * 3, 1: [2.5, 2.6, 2.4, 2.5] * 3, 2: [1.0, 0.9, 1.1, 1.0] * 3}, {1: 2.5}),
    ({0: [1.0] * 12, 1: [1.0] * 12, 2: [1.9] * 12}, {}),                      # under the ratio
    ({0: [0.0] * 12, 1: [1.0] * 12}, {}),                                     # peers measuring 0: no base
    ({0: [1.0] * 12}, {}),                                                    # no peer
    ({0: [9.0] * 12 + [1.0] * 12, 1: [1.0] * 24}, {}),                        # only the newest N x W samples count
])
def test_table(samples, found):
    assert flagged(samples) == found


def test_margin_rule_alone():
    """Ratio met in every window, but within 3 MADs of the spread: not flagged; without the margin it would be."""
    noisy = {0: [1.0, 3.0, 1.0, 3.0] * 3, 1: [4.0, 6.0, 5.0, 2.0] * 3}
    assert flagged(noisy) == {}
    assert flagged(noisy, margin=0.0) == {1: 2.25}


nodes = st.integers(min_value=2, max_value=5)
jitter = st.floats(min_value=-0.1, max_value=0.1)   # +-10%: (1.1 / 0.9) < R, so jitter alone never meets the ratio


@settings(max_examples=300, deadline=None)
@given(st.data(), nodes, st.floats(min_value=0.01, max_value=10.0))
def test_noise_alone_never_flags(data, n, base):
    """Every node jitters around the same base, and any node may be loaded (any factor up to 10x) for episodes of
    fewer than (N - 1) x W samples, the same node's episodes at least W + 1 samples apart - one node after another,
    as on a loaded machine. Judged after every sample, nobody is ever flagged."""
    total = data.draw(st.integers(min_value=N * W, max_value=8 * N * W))
    series = {}
    for s in range(n):
        xs, t = [], 0
        while t < total:
            gap = data.draw(st.integers(min_value=W + 1, max_value=3 * N * W))
            length = data.draw(st.integers(min_value=1, max_value=(N - 1) * W - 1))
            load = data.draw(st.floats(min_value=1.0, max_value=10.0))
            xs += [1.0] * gap + [load] * length
            t += gap + length
        start = data.draw(st.integers(min_value=0, max_value=len(xs) - total))   # episodes not aligned to windows
        series[s] = [base * f * (1 + data.draw(jitter)) for f in xs[start:start + total]]
    for t in range(N * W, total + 1):
        assert flagged({s: v[:t] for s, v in series.items()}) == {}, t


@settings(max_examples=300, deadline=None)
@given(st.data(), nodes, st.floats(min_value=0.01, max_value=10.0), st.floats(min_value=2.5, max_value=20.0))
def test_a_steady_slow_node_is_flagged_within_n_windows(data, n, base, factor):
    """One node becomes `factor` (>= 2.5) times slower and stays so, every node jittering by up to 10%: flagged as
    soon as N windows of its samples are slow - at most N x W samples after it slowed down - and from then on."""
    before = data.draw(st.integers(min_value=0, max_value=3 * N * W))
    slow = data.draw(st.integers(min_value=0, max_value=n - 1))
    after = N * W + data.draw(st.integers(min_value=0, max_value=2 * N * W))
    series = {s: [base * (factor if s == slow and i >= before else 1.0) * (1 + data.draw(jitter))
                  for i in range(before + after)] for s in range(n)}
    got = flagged(series)
    assert list(got) == [slow] and got[slow] >= R
    # and not before it had been slow for N windows' worth of samples (persistence)
    if before:
        assert flagged({s: v[:before + N * W - (W // 2) - 1] for s, v in series.items()}) == {}


# ------------------------------------------------------------------ the peers' median, without O(nodes^2)
from phoenixrun.control.decide import median_without  # noqa: E402
import statistics  # noqa: E402


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=2, max_size=40), st.data())
def test_the_median_of_the_others_is_the_median_of_the_list_without_one(values, data):
    x = data.draw(st.sampled_from(values))
    others = list(values)
    others.remove(x)
    assert median_without(sorted(values), x) == pytest.approx(statistics.median(others))


def _naive(samples, ratio, window, windows=N, margin=3.0):
    """The definition (the docstring of decide.stragglers), each node's peers taken afresh: O(nodes^2)."""
    need = window * windows
    judged = {s: list(v[-need:]) for s, v in samples.items() if len(v) >= need}
    slow, newest = {s: 0 for s in judged}, {}
    for w in range(windows):
        lo = need - (w + 1) * window
        med = {s: statistics.median(v[lo:lo + window]) for s, v in judged.items()}
        mad = {s: statistics.median(abs(x - med[s]) for x in v[lo:lo + window]) for s, v in judged.items()}
        for s in judged:
            peers = [t for t in judged if t != s]
            if slow[s] != w or not peers:
                continue
            base = statistics.median(med[t] for t in peers)
            spread = max(mad[s], statistics.median(mad[t] for t in peers))
            if base > 0 and med[s] / base >= ratio and med[s] - base > margin * spread:
                slow[s] += 1
                if w == 0:
                    newest[s] = round(med[s] / base, 2)
    return {s: newest[s] for s, n in slow.items() if n == windows}


@settings(max_examples=200)
@given(st.dictionaries(st.integers(0, 12), st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.1, 2.0, 2.5, 3.0, 9.0]),
                                                    min_size=10, max_size=14), max_size=8))
def test_the_fast_decision_is_the_definition(samples):
    assert stragglers(samples, R, W, windows=N) == _naive(samples, R, W)

"""Silent-node detection by ring neighbours (control/ring_watch.py): who watches whom, when a watcher suspects, when
the master confirms - tables and properties - and the report's validation (protocol/suspect.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.control.ring_watch import (CONTRADICT_S, PING_S, SOLO_SILENCE_S, SUSPECT_AFTER_S, RingMember,
                                           Suspicion, Verdict, confirm, is_suspect, neighbours, ring, watched_by,
                                           watchers_of)
from phoenixrun.protocol.messages import MessageError
from phoenixrun.protocol.suspect import parse_suspect


def test_ring_is_slot_order_then_spares_by_id() -> None:
    ms = [RingMember("c", 2), RingMember("s2", None), RingMember("a", 0), RingMember("s1", None), RingMember("b", 1)]
    assert ring(ms) == ["a", "b", "c", "s1", "s2"]


@pytest.mark.parametrize("n, k, node, watches", [
    (1, 2, "n0", ()),                        # alone: nobody to watch
    (2, 2, "n0", ("n1",)),                   # two: each watches the other, once
    (3, 2, "n2", ("n0", "n1")),              # wraps around
    (5, 2, "n1", ("n2", "n3")),
    (5, 1, "n4", ("n0",)),
])
def test_who_watches_whom(n: int, k: int, node: str, watches: tuple[str, ...]) -> None:
    order = [f"n{i}" for i in range(n)]
    assert watched_by(order, k)[node] == watches


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(0, 4))
def test_every_member_is_watched_by_as_many_as_it_watches_and_never_by_itself(n: int, k: int) -> None:
    order = [f"n{i}" for i in range(n)]
    fwd, back = watched_by(order, k), watchers_of(order, k)
    want = max(0, min(k, n - 1))
    for node in order:
        assert node not in fwd[node] and len(set(fwd[node])) == len(fwd[node]) == want
        assert len(back[node]) == want
        for w in back[node]:                       # the two maps agree
            assert node in fwd[w]
    for i, node in enumerate(order):               # and one member's view (what the master answers per heartbeat)
        assert neighbours(order, i, k) == fwd[node] and neighbours(order, i, k, step=-1) == back[node]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(3, 200), gone=st.integers(0, 199))
def test_a_membership_change_moves_only_the_neighbours_of_the_change(n: int, gone: int) -> None:
    # N-independent cost of a change: only the k predecessors of the removed member watch someone new
    order = [f"n{i}" for i in range(n)]
    gone %= n
    before, after = watched_by(order), watched_by(order[:gone] + order[gone + 1:])
    changed = {w for w in after if after[w] != before[w]}
    assert changed <= set(watchers_of(order)[order[gone]])


@pytest.mark.parametrize("last, since, now, lag, want", [
    (10.0, 0.0, 10.0 + SUSPECT_AFTER_S - 0.01, 0.0, False),     # not yet
    (10.0, 0.0, 10.0 + SUSPECT_AFTER_S, 0.0, True),             # silent for the window: suspect
    (10.0, 0.0, 10.0 + 0.3, 0.0, False),                         # a 0.3 s GC pause of the neighbour: not suspected
    (0.0, 10.0, 10.0 + SUSPECT_AFTER_S - 0.01, 0.0, False),     # a new neighbour: silent only since the watch began
    (10.0, 0.0, 12.0, SUSPECT_AFTER_S, False),                   # the watcher itself stalled: its clocks do not count
])
def test_when_a_watcher_suspects(last: float, since: float, now: float, lag: float, want: bool) -> None:
    assert is_suspect(last, since, now, lag) is want


W = ("w1", "w2")


def s(watcher: str, since: float, at: float) -> Suspicion:
    return Suspicion(watcher, since, at)


@pytest.mark.parametrize("suspicions, last_heard, now, want", [
    ([], 0.0, 10.0, Verdict.WAIT),
    ([s("w1", 9.0, 9.7)], 8.5, 9.7, Verdict.WAIT),                       # one watcher: the master's silence is short
    ([s("w1", 9.0, 9.7), s("w2", 9.05, 9.75)], 8.5, 9.75, Verdict.LOST),  # two agree, the master heard nothing since
    ([s("w1", 9.0, 9.7), s("x", 9.0, 9.7)], 8.5, 9.7, Verdict.WAIT),      # x is not its watcher (the ring moved)
    ([s("w1", 9.0, 9.7), s("w2", 9.0, 9.7)], 9.0 + CONTRADICT_S + 0.01, 9.7, Verdict.ALIVE),   # the master hears it
    ([s("w1", 9.0, 9.7), s("w2", 9.0, 9.7)], 9.1, 9.7, Verdict.LOST),     # a heartbeat in flight at the hang
    ([s("w1", 9.0, 9.7)], 8.0, 8.0 + SOLO_SILENCE_S, Verdict.LOST),       # a lone watcher + the master's silence
    ([s("w1", 1.0, 1.5), s("w2", 1.0, 1.5)], 0.5, 9.0, Verdict.WAIT),     # reports too old: the backstop judges
])
def test_when_the_master_confirms(suspicions: list[Suspicion], last_heard: float, now: float, want: Verdict) -> None:
    assert confirm(suspicions, W, last_heard, now) is want


def test_a_lone_watcher_suffices_when_it_is_the_only_one() -> None:
    assert confirm([s("w1", 9.0, 9.7)], ("w1",), 8.5, 9.7) is Verdict.LOST


@settings(max_examples=300, deadline=None)
@given(hb=st.floats(0.5, 2.0), phase=st.floats(0, 1), stall=st.floats(0, SUSPECT_AFTER_S - PING_S),
       pings=st.floats(0, 1))
def test_a_node_stalled_for_less_than_the_window_is_never_declared_lost(hb: float, phase: float, stall: float,
                                                                        pings: float) -> None:
    # a live node pauses for `stall` (< SUSPECT_AFTER_S - one ping period) and then answers again: at no ping round
    # during the pause does either watcher suspect it, so no report reaches the master at all
    start = 100.0 + phase
    last_answer = start - pings * PING_S
    t = start
    while t <= start + stall:
        assert not is_suspect(last_answer, 0.0, t, 0.0)
        t += PING_S


@settings(max_examples=300, deadline=None)
@given(hang=st.floats(100, 200), hb_phase=st.floats(0, 1), ping_phase=st.floats(0, 1))
def test_a_hung_node_is_confirmed_within_a_second(hang: float, hb_phase: float, ping_phase: float) -> None:
    # the node hangs at `hang`: its last heartbeat reached the master up to a period before, its watchers' last
    # answered ping up to PING_S before; each watcher suspects it at its first round past the window
    last_hb = hang - hb_phase * 1.0
    last_answer = hang - ping_phase * PING_S
    t = last_answer
    while not is_suspect(last_answer, 0.0, t, 0.0):
        t += PING_S
    reports = [Suspicion(w, last_answer, t) for w in W]
    assert confirm(reports, W, last_hb, t) is Verdict.LOST
    assert t - hang < 1.0


@pytest.mark.parametrize("payload, error", [
    ({"node_id": "a", "suspect": "b", "silent_for": 0.7}, None),
    ({"node_id": "a", "suspect": "a", "silent_for": 0.7}, "itself"),
    ({"node_id": "a", "suspect": "b c", "silent_for": 0.7}, "suspect"),
    ({"node_id": "a", "suspect": "b", "silent_for": -1}, "silent_for"),
    ({"node_id": "a", "suspect": "b", "silent_for": float("nan")}, "silent_for"),
    ({"node_id": "a", "suspect": "b", "silent_for": True}, "silent_for"),
    ({"node_id": "a", "suspect": "b", "silent_for": 1, "token": 5}, "token"),
])
def test_the_suspect_report_is_validated(payload: dict[str, object], error: str | None) -> None:
    if error is None:
        r = parse_suspect(payload)
        assert (r.watcher, r.suspect, r.silent_for) == ("a", "b", 0.7)
    else:
        with pytest.raises(MessageError, match=error):
            parse_suspect(payload)

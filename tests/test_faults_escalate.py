"""The no-loop rule (faults/escalate.py): table tests and properties."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phoenixrun.faults.escalate import LADDER, Attempt, Limits, committed_step, escalate, rung, settle
from phoenixrun.faults.taxonomy import Action, Classification, FaultClass

LR, NR, XF = Action.LOCAL_RESET, Action.NODE_REPLACE, Action.EXTERNAL_FALLBACK
TRANSIENT = Classification(FaultClass.TRANSIENT_COMM, LR, False, "collective error")
HARDWARE = Classification(FaultClass.HOST_PCIE, NR, True, "agent heartbeat lost")
USER = Classification(FaultClass.SOFTWARE_UNKNOWN, XF, True, "exception in user code")


def at(step, *actions):
    return [Attempt(step, a) for a in actions]


# (fault, committed step, history, action expected; None = stop)
TABLE = [
    # nothing before: the fault's own action
    (TRANSIENT, 10, [], LR),
    (HARDWARE, 10, [], NR),
    (USER, 10, [], XF),
    # repeats at the same step climb the ladder whatever the fault's own action
    (TRANSIENT, 10, at(10, LR, LR), LR),
    (TRANSIENT, 10, at(10, LR, LR, LR), NR),
    (TRANSIENT, 10, at(10, LR, LR, LR, NR), XF),
    (TRANSIENT, 10, at(10, LR, LR, LR, NR, XF), None),
    (HARDWARE, 10, at(10, NR, NR, NR, NR), XF),
    (HARDWARE, 10, at(10, NR, NR, NR, NR, XF), None),
    (USER, 10, at(10, XF, XF, XF, XF, XF), None),
    # attempts more than one step away: the job progressed in between, they do not count
    (TRANSIENT, 12, at(10, LR, LR, LR, NR, XF), LR),
    (TRANSIENT, 10, at(8, LR, LR) + at(12, LR, LR) + at(10, LR), LR),
    # one step either side is the snapshot race (the crash came before or after the last commit): a repeat
    (TRANSIENT, 11, at(10, LR, LR, LR), NR),
    (TRANSIENT, 10, at(9, LR) + at(11, LR) + at(10, LR), NR),
    (TRANSIENT, 5, at(5, LR, LR, LR) + at(4, NR) + at(6, XF), None),
    # a fallback went back to an older checkpoint and the job failed again at the same step: still a repeat
    (TRANSIENT, 10, at(10, LR, LR, LR, NR) + at(5, LR) + at(10, XF), None),
    # nothing committed yet is a step like any other
    (TRANSIENT, None, at(None, LR, LR, LR), NR),
    (TRANSIENT, None, at(1, LR, LR, LR), LR),
    (TRANSIENT, 0, at(None, LR, LR, LR), NR),     # None is step -1: one step before step 0
]


@pytest.mark.parametrize("fault,step,history,expected", TABLE)
def test_table(fault, step, history, expected):
    e = escalate(fault, step, history)
    assert e.action is expected, e.reason
    assert e.stop == (expected is None)
    assert e.reason.startswith(fault.reason)
    if expected is not fault.action:
        assert "no progress" in e.reason
        assert (f"step {step}" if step is not None else "nothing committed yet") in e.reason


def test_stop_reason_says_what_was_tried():
    e = escalate(TRANSIENT, 1281, at(1281, LR, LR, LR, NR, XF))
    assert e.reason == ("collective error; the job stops: 5 attempts at step 1281 made no progress "
                        "(local_reset x3, node_replace x1, external_fallback x1)")


def test_limits_shape_the_ladder():
    lim = Limits(local_resets=0, node_replaces=0, fallbacks=2)
    assert [rung(n, lim) for n in range(4)] == [XF, XF, None, None]
    assert [rung(n, Limits()) for n in range(7)] == [LR, LR, LR, NR, XF, None, None]
    with pytest.raises(ValueError, match="local_resets"):
        Limits(local_resets=-1)


actions = st.sampled_from(LADDER)
faults = st.sampled_from([TRANSIENT, HARDWARE, USER])
limits = st.builds(Limits, st.integers(0, 4), st.integers(0, 3), st.integers(0, 3))


@given(faults, st.lists(st.tuples(st.sampled_from([None, 0, 1, 2, 3, 4, 5]), actions), max_size=30), limits)
def test_never_weaker_than_the_fault_and_never_weaker_for_more_repeats(fault, hist, lim):
    history = [Attempt(s, a) for s, a in hist]
    e = escalate(fault, 2, history, lim)
    more = escalate(fault, 2, history + [Attempt(2, LR)], lim)
    if not e.stop:
        assert LADDER.index(e.action) >= LADDER.index(fault.action)
        assert more.stop or LADDER.index(more.action) >= LADDER.index(e.action)


@given(faults, limits, st.lists(faults, max_size=40), st.lists(st.sampled_from([6, 7]), min_size=60, max_size=60))
def test_a_fault_repeating_at_one_step_stops_within_the_bound(first, lim, later, steps):
    """Feed the decisions back as the master does: the job ends after at most limits.attempts attempts, also
    when the committed step the repeats are seen at flips between two neighbours (the snapshot race)."""
    history: list[Attempt] = []
    for fault, step in zip([first, *later, *[TRANSIENT] * (lim.attempts + 1)], steps):
        e = escalate(fault, step, history, lim)
        if e.stop:
            break
        history.append(Attempt(step, e.action))
    assert e.stop
    assert len(history) == lim.attempts


@pytest.mark.parametrize("newest, restored, expected", [
    ({0: 7, 1: 6, 2: 7, 3: 7}, None, 6),     # every rank reported: the oldest newest snapshot
    ({0: 7, 1: 6, 2: 7}, None, None),        # a rank never reported, no recovery yet: unknown
    ({1: 6, 2: 6, 3: 6}, 5, 5),              # a fresh replacement not heard from yet is at the restored step
    ({0: 9, 1: 9, 2: 9, 3: 9}, 5, 9),        # progress since the recovery counts
    ({0: 3, 1: 9, 2: 9, 3: 9}, 5, 5),        # a report from before the restore is not older than it
    ({}, 5, 5),
])
def test_committed_step(newest, restored, expected):
    assert committed_step(newest, 4, restored) == expected


@pytest.mark.parametrize("attempts, restored, expected", [
    ([], 5, []),
    ([Attempt(3, Action.LOCAL_RESET)], 5, [Attempt(5, Action.LOCAL_RESET)]),     # a stale view moves up
    ([Attempt(None, Action.LOCAL_RESET)], 5, [Attempt(5, Action.LOCAL_RESET)]),    # unknown then: now known
    ([Attempt(6, Action.LOCAL_RESET)], 5, [Attempt(6, Action.LOCAL_RESET)]),     # never moved down
    ([Attempt(1, Action.NODE_REPLACE), Attempt(2, Action.LOCAL_RESET)], 4,
     [Attempt(1, Action.NODE_REPLACE), Attempt(4, Action.LOCAL_RESET)]),         # only the newest one
])
def test_settle_records_the_step_the_recovery_restored(attempts, restored, expected):
    assert settle(attempts, restored) == expected


def test_a_settled_stale_attempt_counts_as_a_repeat():
    """The CI case: the first attempt was recorded at a stale step 3 while the recovery restored step 5;
    settled, the repeats at step 5 climb past node replace instead of stalling there."""
    stale = at(3, LR)
    lim = Limits(local_resets=1)
    assert escalate(TRANSIENT, 5, stale + at(5, NR), lim).action == NR         # unsettled: the first is missed
    assert escalate(TRANSIENT, 5, settle(stale, 5) + at(5, NR), lim).action == XF

"""The hang watchdog's decision (agents/watchdog.py) as a table and as properties, and the progress block it reads
(phoenixrun/protocol/progress_block.py) between real processes."""
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phoenixrun.agents.watchdog import (PING_AFTER_S, PING_GRACE_MIN_S, Hang, Watched, answer_grace, hang_check,
                                        ping_after)
from phoenixrun.protocol import progress_block
from phoenixrun.protocol.progress_block import ProgressBlock

T = 3.0                 # hang timeout
S = 100.0               # the step's start
EARLY = ping_after(T)   # 1.0: first question
GRACE = answer_grace(T)  # 2.0: what it has to answer


def w(armed=S - 5, step=S, pinged=None, answered=None) -> Watched:
    return Watched(armed=armed, step_start=step, pinged=pinged, answered=answered)


@pytest.mark.parametrize("now, seen, recovering, expected", [
    # a step within its time: nothing asked
    (S + EARLY, w(), False, Hang.OK),
    (S + EARLY + 0.01, w(), False, Hang.PING),                         # late: ask, inside the timeout
    (S + 2.0, w(pinged=S + EARLY + 0.01), False, Hang.WAIT),           # asked, within the timeout
    (S + T, w(pinged=S + EARLY), False, Hang.WAIT),                    # exactly the timeout: still fine
    (S + T + 0.01, w(pinged=S + EARLY), False, Hang.HUNG),             # past it, never answered: hung AT the timeout
    # slow but alive (or blocked on a peer's hang): never hung, asked again now and then
    (S + T + 5, w(pinged=S + T + 4.5, answered=S + T + 4.6), False, Hang.OK),
    (S + T + 5, w(pinged=S + T + 4.0, answered=S + T + 4.1), False, Hang.PING),
    # asked again and silent: the same grace as the first question (a starved worker answers late)
    (S + T + 5, w(pinged=S + T + 5 - GRACE + 0.01, answered=S + 1.5), False, Hang.WAIT),
    (S + T + 5, w(pinged=S + T + 5 - GRACE - 0.01, answered=S + 1.5), False, Hang.HUNG),
    # a question asked in an earlier step does not count for this one
    (S + 2.0, w(pinged=S - 1.0), False, Hang.PING),
    # a worker still starting (no sign of progress yet), or out of the loop (finished, exiting): not watched
    (S + 60, w(armed=None), False, Hang.OK),
    (S + 60, w(armed=None, step=None), False, Hang.OK),
    # inside a recovery: waiting is legitimate
    (S + 60, w(pinged=S + EARLY), True, Hang.OK),
    # the first step after a restore: the record is the abandoned step's, the clock starts at the resume
    (S + 60 + EARLY, w(armed=S + 60, step=S), False, Hang.OK),
    (S + 60 + T + 0.01, w(armed=S + 60, step=S, pinged=S + 60 + EARLY), False, Hang.HUNG),
    # no record (no progress block: the messages alone)
    (S + EARLY + 0.01, w(armed=S, step=None), False, Hang.PING),
])
def test_hang_check(now, seen, recovering, expected):
    assert hang_check(now, seen, T, recovering) is expected


def test_a_short_timeout_still_gives_a_question_the_floor():
    t = 0.5
    assert ping_after(t) == 0.25 and answer_grace(t) == PING_GRACE_MIN_S
    asked = S + 0.3
    assert hang_check(asked + PING_GRACE_MIN_S - 0.01, w(pinged=asked), t) is Hang.WAIT
    assert hang_check(asked + PING_GRACE_MIN_S + 0.01, w(pinged=asked), t) is Hang.HUNG


def test_a_long_timeout_asks_early_and_gives_the_rest_to_answer():
    assert ping_after(20.0) == PING_AFTER_S and answer_grace(20.0) == 20.0 - PING_AFTER_S


times = st.floats(0, 1000, allow_nan=False)


@given(now=times, armed=times, step=times | st.none(), pinged=times | st.none(), answered=times | st.none(),
       timeout=st.floats(0.1, 100, allow_nan=False))
def test_never_hung_within_the_timeout_or_with_an_answer_to_the_last_question(now, armed, step, pinged, answered,
                                                                               timeout):
    seen = Watched(armed=armed, step_start=step, pinged=pinged, answered=answered)
    verdict = hang_check(now, seen, timeout)
    started = armed if step is None else max(armed, step)
    if verdict is Hang.HUNG:
        assert now - started > timeout                          # never before the step exceeds the timeout
        assert pinged is not None and pinged >= started          # asked in this step ...
        assert answered is None or answered < pinged             # ... and not answered
        assert now - pinged >= max(PING_GRACE_MIN_S, timeout - ping_after(timeout))


@given(timeout=st.floats(0.1, 100, allow_nan=False), start=times)
def test_a_silent_worker_asked_when_told_is_hung_at_the_timeout_or_the_grace(timeout, start):
    """Following the watchdog's own questions, a worker that never answers is called hung at its step's start +
    max(timeout, first question + grace) - at the timeout itself whenever the timeout is at least 2 x the floor."""
    seen = w(armed=start - 1, step=start)
    asked = start + ping_after(timeout) + 1e-6
    assert hang_check(asked, seen, timeout) is Hang.PING
    hung_at = start + max(timeout, ping_after(timeout) + answer_grace(timeout)) + 1e-3
    asked_seen = w(armed=start - 1, step=start, pinged=asked)
    assert hang_check(hung_at - 2e-3, asked_seen, timeout) is Hang.WAIT
    assert hang_check(hung_at, asked_seen, timeout) is Hang.HUNG


WRITER = """
import os, sys, time
from phoenixrun.protocol.progress_block import ProgressBlock
b = ProgressBlock.attach(os.environ)
assert b is not None
b.write(int(sys.argv[1]), 41, time.monotonic())
print(time.monotonic(), flush=True)
"""


def test_a_worker_records_its_step_where_its_agent_reads_it():
    """The block crosses a real process boundary the way workers get it (an inherited descriptor named in the
    environment), on the monotonic clock both sides read."""
    block = ProgressBlock.create()
    try:
        assert block.read(3) is None                            # never written
        env = {**os.environ, progress_block.ENV: str(block.fd)}
        out = subprocess.run([sys.executable, "-c", WRITER, "3"], env=env, pass_fds=(block.fd,), capture_output=True,
                             text=True, timeout=120, check=True).stdout
        got = block.read(3)
        assert got is not None and got[0] == 41 and got[1] <= float(out)
        assert block.read(2) is None and block.read(progress_block.SLOTS) is None
        block.clear(3)
        assert block.read(3) is None
    finally:
        block.close()


@pytest.mark.parametrize("env", [{}, {progress_block.ENV: ""}, {progress_block.ENV: "x"}, {progress_block.ENV: "99999"}])
def test_a_worker_without_a_usable_block_has_none(env):
    assert ProgressBlock.attach(env) is None

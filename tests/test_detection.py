"""The master's failure-detection decisions (phoenixrun/control/detection.py): table tests."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phoenixrun.control.detection import MAX_READ_LAG_S, Link, Probe, closed_link, judged_at

NOW = 1000.0


@pytest.mark.parametrize("horizon,expected", [
    (None, NOW),                              # the transport has not said yet: the clock
    (NOW - 0.1, NOW - 0.1),                   # caught up but for its last turns
    (NOW - 3.0, NOW - 3.0),                   # 3 s behind reading: silence counted to what it has read
    (NOW + 1.0, NOW),                         # never past the clock
    (NOW - 2 * MAX_READ_LAG_S, NOW - MAX_READ_LAG_S),   # a listen queue that never empties delays, never stops it
])
def test_silence_is_judged_up_to_what_the_master_has_read(horizon, expected):
    assert judged_at(NOW, horizon) == expected


# closed_link(closed_at, now, last_heard, probe): the connection closed at t=10
@pytest.mark.parametrize("now,last_heard,probe,expected", [
    (10.01, 9.5, None, Link.WAIT),             # just closed: let a dying process finish its exit
    (10.2, 9.5, None, Link.PROBE),             # nothing heard since: ask its peer port
    (10.2, 9.5, Probe.REFUSED, Link.LOST),     # nobody listens there any more: the agent is gone
    (10.2, 9.5, Probe.ANSWERED, Link.ALIVE),   # its process is there: a transient close, it will redial
    (10.2, 9.5, Probe.SILENT, Link.UNKNOWN),   # a hung or cut-off host: the heartbeat timeout judges
    (10.01, 10.005, None, Link.ALIVE),         # a new poll or heartbeat since the close: alive, whatever else
    (10.3, 10.25, Probe.REFUSED, Link.ALIVE),  # heard after the close: its port may be moving, it is not dead
    (20.0, 10.0, Probe.REFUSED, Link.LOST),    # heard exactly at the close is not "since"
])
def test_a_closed_control_connection_is_confirmed_before_the_node_is_lost(now, last_heard, probe, expected):
    assert closed_link(10.0, now, last_heard, probe) == expected


@given(st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.sampled_from([None, *Probe]))
def test_a_node_heard_from_since_the_close_is_never_lost(closed_at, dt, heard_after, probe):
    assert closed_link(closed_at, closed_at + dt, closed_at + heard_after + 1e-6, probe) == Link.ALIVE
    # and one not heard from is lost only on a refusal
    verdict = closed_link(closed_at, closed_at + dt, closed_at - 1.0, probe)
    assert (verdict == Link.LOST) == (probe == Probe.REFUSED)

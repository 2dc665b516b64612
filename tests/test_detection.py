"""The master's failure-detection decisions (phoenixrun/control/detection.py): table tests."""
import pytest

from phoenixrun.control.detection import MAX_READ_LAG_S, judged_at

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

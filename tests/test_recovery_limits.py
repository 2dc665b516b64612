"""Recovery limits as pure functions: how many checkpoint restarts one fallback may try."""
import pytest

from phoenixrun.control.decide import fallback_attempts


@pytest.mark.parametrize("used,limit,counted,expected", [
    (0, 3, True, 3),
    (2, 3, True, 1),
    (3, 3, True, 0),       # used up: no fallback, the caller restarts or stops
    (5, 3, True, 0),
    (0, 0, True, 0),       # --max-fallbacks 0: never
    (0, 8, True, 8),       # more than the 5 tries the loop used to stop at, whatever the flag said
    (0, 0, False, 1),      # resuming a job from its run directory: the first try is free
    (0, 2, False, 3),
    (3, 3, False, 1),
])
def test_fallback_attempts_honour_max_fallbacks(used, limit, counted, expected):
    assert fallback_attempts(used, limit, counted) == expected

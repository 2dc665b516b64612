"""The agent main loop's wake-up interval: an idle warm spare wakes less often than a node with ranks."""
import pytest

from agents.agent import IDLE_SPARE_WATCH_INTERVAL_S, WATCH_INTERVAL_S, watch_interval


@pytest.mark.parametrize("role, warm_only, expected", [
    ("spare", True, IDLE_SPARE_WATCH_INTERVAL_S),    # only warm workers: nothing to watch for hangs
    ("spare", False, WATCH_INTERVAL_S),              # still starting its workers (or none yet)
    ("active", False, WATCH_INTERVAL_S),
    ("active", True, WATCH_INTERVAL_S),              # an active node never slows its watch
    (None, True, WATCH_INTERVAL_S),                  # not registered yet
])
def test_watch_interval(role, warm_only, expected):
    assert watch_interval(role, warm_only) == expected


def test_idle_spare_still_polls_health_as_often_as_health_is_sampled():
    # _poll_health samples every 0.2 s; a slower loop would delay a spare's health reports
    assert WATCH_INTERVAL_S < IDLE_SPARE_WATCH_INTERVAL_S <= 0.2

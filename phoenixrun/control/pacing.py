"""How often the master may redo an O(nodes) walk that follows the membership (the relay tree, the watch ring).

Each walk is timed, and the next one waits until the walk's cost is at most `share` of the time in between: at
16,384 simulated nodes registering, the two refreshes at their fixed 0.25 s took ~27% of the master's samples
(py-spy) while heartbeats went unanswered for 5 s. A membership that settles is followed
within the floor again."""
from __future__ import annotations

import time
from typing import Callable

SHARE = 0.1     # the most of the master's time one such walk may take
CEILING_S = 5.0  # ... but never longer between walks (a walk timed across a long wait for the lock is no guide)


def paced(cost_s: float, floor_s: float, share: float = SHARE, ceiling_s: float = CEILING_S) -> float:
    """Seconds until the next walk, after one that took cost_s: at least floor_s and cost_s / share, at most
    ceiling_s (and never below floor_s)."""
    return max(floor_s, min(cost_s / share, ceiling_s))


class Pacer:
    """Runs a walk when it is due (paced by the last one's cost, from `floor_s` up)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._at = 0.0
        self._every = floor_s

    def run(self, walk: Callable[[], None], now: float) -> None:
        """walk() if due at `now` (monotonic seconds), timed for the next."""
        if now - self._at < self._every:
            return
        self._at = now
        t0 = time.perf_counter()
        try:
            walk()
        finally:
            self._every = paced(time.perf_counter() - t0, self.floor_s)

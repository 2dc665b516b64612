"""How often the master may redo an O(nodes) walk that follows the membership (the relay tree, the watch ring).

Each walk is timed, and the next one waits until the walk's cost is at most `share` of the time in between: at
16,384 simulated nodes registering, the two refreshes at their fixed 0.25 s took most of the master's loop
(py-spy: ~27% of its samples), and heartbeats went unanswered for 5 s. A membership that settles is followed
within the floor again."""
from __future__ import annotations

SHARE = 0.1     # the most of the master's time one such walk may take
CEILING_S = 5.0  # ... but never longer between walks (a walk timed across a long wait for the lock is no guide)


def paced(cost_s: float, floor_s: float, share: float = SHARE, ceiling_s: float = CEILING_S) -> float:
    """Seconds until the next walk, after one that took cost_s: at least floor_s and cost_s / share, at most
    ceiling_s (and never below floor_s)."""
    return max(floor_s, min(cost_s / share, ceiling_s))

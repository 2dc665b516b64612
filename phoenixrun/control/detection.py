"""When a node counts as lost: pure decisions for the master's failure detection (control/monitor.py).

Silence: a node not heard from for --node-timeout, judged at the time up to which the master has read what
reached it (`judged_at`), not at the wall clock: heartbeats queued in the kernel while the master's loop is
behind are the master's delay, not the nodes' silence.
"""
from __future__ import annotations

# The most the read horizon may lag the clock and still be believed: a master that has not caught up with its
# sockets for this long is broken, and a flood of connections that keeps the listen queue from ever being empty
# must not stop detection - it delays it by at most this much.
MAX_READ_LAG_S = 30.0


def judged_at(now: float, horizon: float | None, max_lag: float = MAX_READ_LAG_S) -> float:
    """The time silence is measured to: now, or the transport's read horizon when that is earlier (None: the
    transport has not said yet), but never more than `max_lag` before now."""
    return now if horizon is None else max(min(now, horizon), now - max_lag)

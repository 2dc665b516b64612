"""When a node counts as lost: pure decisions for the master's failure detection (control/monitor.py).

A closed control connection: see `closed_link` below. Silence: a node not heard from for --node-timeout, judged at the time up to which the master has read what
reached it (`judged_at`), not at the wall clock: heartbeats queued in the kernel while the master's loop is
behind are the master's delay, not the nodes' silence.
"""
from __future__ import annotations

from enum import Enum

# The most the read horizon may lag the clock and still be believed: a master that has not caught up with its
# sockets for this long is broken, and a flood of connections that keeps the listen queue from ever being empty
# must not stop detection - it delays it by at most this much.
MAX_READ_LAG_S = 30.0


def judged_at(now: float, horizon: float | None, max_lag: float = MAX_READ_LAG_S) -> float:
    """The time silence is measured to: now, or the transport's read horizon when that is earlier (None: the
    transport has not said yet), but never more than `max_lag` before now."""
    return now if horizon is None else max(min(now, horizon), now - max_lag)


# A registered agent's control connection (its directive long-poll link) closed by the agent's side: a process that
# died closes its connections at once (the kernel does), which the master sees long before --node-timeout of
# silence. It is evidence, not proof - the agent's client also closes and redials a connection after a transient
# error (agents/master_link.py: poll again 0.2 s later) - so the master confirms it: heard from since (a new poll or
# a heartbeat) -> alive; else, after CONFIRM_AFTER_S, it probes the agent's peer port: refused -> lost (the process
# that listened there is gone); accepted -> alive; no answer -> not evidence either way (a hung or cut-off host: the
# heartbeat timeout judges it, as before).
CONFIRM_AFTER_S = 0.05     # a dying process closes its listener with its connections; let the exit finish
PROBE_TIMEOUT_S = 0.5


class Probe(str, Enum):
    REFUSED = "refused"        # nothing listens on the agent's peer port
    ANSWERED = "answered"      # it accepted the connection
    SILENT = "silent"          # no answer within the probe's timeout


class Link(str, Enum):
    LOST = "lost"              # report the node lost now
    ALIVE = "alive"            # a transient close: forget it
    WAIT = "wait"              # too early to tell: look again
    PROBE = "probe"            # probe the agent's peer port, then decide with its result
    UNKNOWN = "unknown"        # no evidence: the heartbeat timeout decides


def closed_link(closed_at: float, now: float, last_heard: float, probe: Probe | None,
                confirm_after: float = CONFIRM_AFTER_S) -> Link:
    """Is the node whose control connection closed at `closed_at` lost? last_heard: the latest time it was heard
    from (a heartbeat or a directive poll); probe: its peer port's answer (None: not probed yet)."""
    if last_heard > closed_at:
        return Link.ALIVE
    if probe is None:
        return Link.WAIT if now - closed_at < confirm_after else Link.PROBE
    return {Probe.REFUSED: Link.LOST, Probe.ANSWERED: Link.ALIVE, Probe.SILENT: Link.UNKNOWN}[probe]

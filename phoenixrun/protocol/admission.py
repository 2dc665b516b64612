"""Who gets in when a server's room for unauthenticated connections is full, and how often a refusal is logged.

Pure decisions shared by the agent's peer server (agents/peer.py) and the master's control server
(control/server.py). Measured on main at a4bd7af (issue 31 items 3 and 4): 64 idle connections to a surviving
agent's peer port filled its cap, the cap closed the spare's restore connection at accept, and the job stopped;
4,097 idle connections locked `phoenixrun status` and `phoenixrun drain` out of the master; the agent logged one
line per refused connection (76,115 lines, 11.5 MB in 45 s).

Now a new connection, when the room is full, takes the place of the oldest waiting connection that is idle: one
open for at least `grace`, whose server is waiting on it (not holding bytes it has read but not yet checked) and
with no bytes in the kernel its server has not read yet. A caller that holds the secret sends its frame as soon
as it connects, so it is never idle while it waits: however many strangers connect, it gets in. Strangers that
connect faster than `grace` (50 ms) lets them age can still fill the room; the new connection is refused then.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)

# A connection this new is never closed to make room: its caller may not have sent yet. Short, because the rule
# that protects a job's peer is "bytes unread", not age: at 0.5 s, strangers reconnecting as fast as they were
# closed (~530 a second in tests/test_e2e_idle_strangers.py on a loaded machine) kept every waiting connection
# younger than the grace, and the spare's restore connection was refused until the job stopped. A peer closed in
# the instant between its connect and its send is refused once and retried by the next recovery cycle.
GRACE_S = 0.05
LOG_INTERVAL_S = 10.0


def pick_eviction(waiting: Iterable[tuple[K, float, bool]], now: float, grace: float = GRACE_S,
                  unread: Callable[[K], bool] = lambda k: False, scan: int = 256) -> K | None:
    """The waiting (unauthenticated) connection to close so that a new one fits, or None (refuse the new one).

    waiting: (key, opened_at, busy) in the order the connections were accepted; busy: its server holds bytes of
    it that it has not finished checking. unread(key): bytes of it wait in the kernel (asked only of connections
    that are otherwise idle). The first (oldest) connection open for at least `grace`, not busy and with nothing
    unread; only the first `scan` are looked at (a bound on the work per accept). Pure but for `unread`."""
    for i, (key, opened_at, busy) in enumerate(waiting):
        if i >= scan or now - opened_at < grace:
            return None          # accepted in order: every later one is newer still
        if not busy and not unread(key):
            return key
    return None


class Throttle:
    """One log line per interval: note(now) -> None while lines are held back, else how many were held back since
    the last line written (the caller writes one line carrying that count). Thread-safe."""

    def __init__(self, interval: float = LOG_INTERVAL_S):
        self.interval = interval
        self.total = 0
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def note(self, now: float) -> int | None:
        with self._lock:
            self.total += 1
            if self._last is not None and now - self._last < self.interval:
                self._held += 1
                return None
            held, self._held, self._last = self._held, 0, now
            return held

"""The ranks whose state a restore is fetching from peers, and the workers' requests for their slots that wait for it.

A replacement's agent hands its workers their ranks as the restore order arrives and fetches their state meanwhile:
a warm spare's worker returns from `phoenixrun.init()` and builds the script's model and optimizer while the bytes
arrive, instead of after (they were one after the other on the replacement's critical path: docs/benchmarks.md,
"Node loss: the replacement's critical path"). Its restore asks for its slots (`slots`); that request waits here
until the fetch is over and is answered then: the slots' paths, or why there are none (the fetch failed, or a new
recovery began: the worker waits for the master's next order).

No I/O: a waiting request is a callable that sends its reply, called outside the lock.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterable

from phoenixrun.protocol.worker_orders import Paths as Reply

Answer = Callable[[Reply], None]      # sends the reply to one waiting request
Paths = Callable[[int], Reply]        # rank -> the reply for its slots once they are in (paths, or an error)


def unavailable(reason: str) -> Reply:
    """The reply to a request whose state will not come from this fetch (runtime/agent_link.py: StateUnavailable)."""
    return Reply(error=reason, unavailable=True)


class FetchGate:
    """One fetch at a time: `close` starts one (ending any before it), `open` ends it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._token = 0                                  # the fetch in progress (0: none)
        self._ranks: frozenset[int] = frozenset()        # the ranks it installs
        self._waiting: list[tuple[int, Answer]] = []     # (rank, answer) of the requests waiting for it

    def close(self, ranks: Iterable[int]) -> int:
        """A fetch of `ranks` begins: requests for their slots wait from now on; returns its token. Requests still
        waiting for an earlier fetch (abandoned: a new plan replaces it) are answered `unavailable` now."""
        with self._lock:
            self._token = next(self._tokens)
            self._ranks = frozenset(ranks)
            stale, self._waiting = self._waiting, []
            token = self._token
        for _, answer in stale:
            answer(unavailable("the restore was planned again"))
        return token

    def defer(self, rank: int, answer: Answer) -> bool:
        """A request for the slots of `rank`: True if it waits (its rank is being fetched), False to answer it now."""
        with self._lock:
            if rank not in self._ranks:
                return False
            self._waiting.append((rank, answer))
            return True

    def open(self, token: int, paths: Paths | None = None, error: str | None = None) -> bool:
        """The fetch `token` is over: each waiting request gets `paths(rank)`, or `unavailable(error)`. A token that
        is not the current fetch's (one abandoned for a newer) changes nothing: False."""
        with self._lock:
            if token != self._token:
                return False
            waiting, self._waiting = self._waiting, []
            self._token, self._ranks = 0, frozenset()
        for rank, answer in waiting:
            if error is not None or paths is None:
                answer(unavailable(error or "its state was not fetched"))
            else:
                answer(paths(rank))
        return True

    def abandon(self, reason: str) -> None:
        """No fetch is awaited any more (a new recovery quiesces this node): waiting requests are answered
        `unavailable`, so that their workers can acknowledge the quiesce instead of waiting for bytes."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self._token, self._ranks = 0, frozenset()
        for _, answer in waiting:
            answer(unavailable(reason))

    def waiting(self) -> int:
        """How many requests wait (tests, logs)."""
        with self._lock:
            return len(self._waiting)

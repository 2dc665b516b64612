"""The lease's side effects for a master (the decision is control/lease.py's `decide`).

- `await_lease`: a standby master waits here, before it opens any port, until it may take over (it claims the
  next epoch) or the job finished. It sleeps until the record could be stale (about one ttl per look): a
  waiting standby costs a file read every few seconds, nothing else.
- `LeaseKeeper`: the holder's thread; renews lease.json every ttl/3 and calls `on_lost` once a newer epoch was
  claimed (this master must stop acting); `release` marks the job finished (a standby then exits with its code).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from phoenixrun.control.lease import Lease, LeaseDir, Verdict, decide, renew_every

log = logging.getLogger("phoenixrun.master")


@dataclass(frozen=True)
class Acquired:
    """What await_lease ends with: the epoch this master holds (0: none, the job finished), the record it
    replaced (None: it is the first holder) and why it could take over."""
    epoch: int
    previous: Lease | None
    reason: str
    waited_s: float


def await_lease(leases: LeaseDir, me: str, endpoint: str, ttl: float, max_skew: float,
                stop: threading.Event, on_wait: Callable[[Lease | None, str], None] = lambda rec, why: None) -> Acquired:
    """Block until this master holds an epoch, or the job finished (Acquired.epoch 0), or `stop` is set (epoch 0).
    `on_wait` is called once, when this master first has to wait (it is the standby); while it waits, it is
    listed in the lease directory (`phoenixrun status` shows it)."""
    try:
        return _await(leases, me, endpoint, ttl, max_skew, stop, on_wait)
    finally:
        leases.withdraw(me)


def _await(leases: LeaseDir, me: str, endpoint: str, ttl: float, max_skew: float, stop: threading.Event,
           on_wait: Callable[[Lease | None, str], None]) -> Acquired:
    t0 = time.monotonic()
    seen: tuple[Lease | None, int] | None = None
    since = t0
    waiting = False
    while not stop.is_set():
        rec, claimed = leases.read()
        if (rec, claimed) != seen:
            seen, since = (rec, claimed), time.monotonic()
        d = decide(rec, claimed, me, 0, time.time(), time.monotonic() - since, ttl, max_skew)
        if d.verdict == Verdict.DONE:
            return Acquired(0, rec, d.reason, time.monotonic() - t0)
        if d.verdict == Verdict.TAKE_OVER:
            epoch = max(claimed, rec.epoch if rec is not None else 0) + 1
            if leases.claim(epoch, me, endpoint):
                leases.write(Lease(epoch, me, endpoint, time.time()))
                return Acquired(epoch, rec, d.reason, time.monotonic() - t0)
            continue      # another master claimed it first: look again at once
        if not waiting:
            waiting = True
            leases.announce(me, {"endpoint": endpoint, "pid": os.getpid(), "since": time.time()})
            on_wait(rec, d.reason)
        stop.wait(min(d.wait_s, ttl))
    return Acquired(0, None, "stopped", time.monotonic() - t0)


class LeaseKeeper:
    """The holder's renewals (a daemon thread) and its release at the end of the job."""

    def __init__(self, leases: LeaseDir, me: str, epoch: int, endpoint: str, ttl: float, max_skew: float,
                 on_lost: Callable[[str], None]):
        self.leases, self.me, self.epoch, self.endpoint = leases, me, epoch, endpoint
        self.ttl, self.max_skew, self.on_lost = ttl, max_skew, on_lost
        self.stopped = threading.Event()
        self.lost: str | None = None

    def start(self) -> None:
        self.renew()
        threading.Thread(target=self._run, daemon=True, name="_lease").start()

    def renew(self) -> bool:
        """Renew if this master still holds its epoch; False (and on_lost, once) if a newer one was claimed."""
        if self.lost is not None:
            return False
        rec, claimed = self.leases.read()
        d = decide(rec, claimed, self.me, self.epoch, time.time(), 0.0, self.ttl, self.max_skew)
        if d.verdict == Verdict.LOST:
            self.lost = d.reason
            self.stopped.set()
            self.on_lost(d.reason)
            return False
        if d.verdict == Verdict.HOLD:
            self.leases.write(Lease(self.epoch, self.me, self.endpoint, time.time()))
        return True

    def release(self, exit_code: int) -> None:
        """The job ended under this master: mark the lease finished (a waiting standby exits with exit_code)."""
        self.stopped.set()
        if self.lost is None and self.leases.read()[1] <= self.epoch:
            self.leases.write(Lease(self.epoch, self.me, self.endpoint, time.time(), finished=True,
                                    exit_code=exit_code))

    def _run(self) -> None:
        while not self.stopped.wait(renew_every(self.ttl)):
            try:
                self.renew()
            except OSError as e:      # the shared file system hiccuped: the lease lives ttl, try again
                log.warning("lease renewal failed: %s", e)

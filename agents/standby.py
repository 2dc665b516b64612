"""A node's standby worker: one pre-started worker process waiting in phoenixrun.init() without a rank, as a warm
spare's workers do, so that a local reset after a worker death hands the dead rank to a process that is already
up - it restores from the node's own slots - instead of starting a Python interpreter and importing torch on the
critical path (3.2 s idle, 12-30 s loaded: docs/benchmarks.md, "Worker death").

Only for jobs whose workers use the phoenixrun API (a torchrun-semantics script reruns from its start and never
calls init(): it gets no standby), only on an active node, and off with `--no-standby-worker`. It is started once
the node trains again after a recovery (never while one is under way: its start-up is CPU the recovery needs), its
idle cost is checked against `IdleBudget`, and one that dies before it reaches init() turns standbys off for the
run (the script cannot have one: it reads LOCAL_RANK, or fails, before init()).

The decisions are pure (`tend`, `usable`, `after_exit`, `over_budget`); `StandbyWorker` carries them out. Call its
methods with the node's lock held.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from enum import Enum

import psutil

from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.workers import Worker

log = logging.getLogger("phoenixrun.agent")

# A standby that died while waiting (OOM-killed, killed by hand) is replaced; after this many, the node stops
# trying: something on it kills them, and each start costs a worker's start-up CPU.
MAX_IDLE_DEATHS = 3
BUDGET_LOOK_S = 10.0     # how often (and over what window) a connected standby's idle CPU and memory are read


@dataclass(frozen=True)
class IdleBudget:
    """What a standby may cost while it waits (connected, so past its start-up). Measured on this project's
    example (docs/benchmarks.md, "Worker death"): 0.000 CPU s/s and ~300 MB RSS with torch imported. More CPU means
    the script works before init() (a standby would take a core from training); more memory, that it builds large
    state there (a second copy on every node)."""
    cpu_fraction: float = 0.02           # CPU seconds per second, averaged over BUDGET_LOOK_S
    rss_bytes: int = 2 << 30


class Tend(Enum):
    NOTHING = "nothing"
    SPAWN = "spawn"       # start one (off the critical path: the node trains)
    RETIRE = "retire"     # kill the one there is: not wanted any more


@dataclass(frozen=True)
class NodeView:
    """What `tend` looks at."""
    enabled: bool         # not turned off (--no-standby-worker, or for this run: `after_exit`, `over_budget`)
    api: bool             # the node's workers use the phoenixrun API
    active: bool          # the node holds ranks (a spare's warm workers wait already)
    have: bool            # a standby process runs
    current: bool         # ... started for this restart attempt (a full restart gives its workers new environments)
    settled: bool         # no recovery under way, and every local rank runs and stepped since the last one
    finishing: bool       # a worker finished the script: the job is ending


def tend(v: NodeView) -> Tend:
    """Start a standby, retire it, or leave things as they are. Pure."""
    wanted = v.enabled and v.api and v.active and not v.finishing
    if v.have:
        return Tend.NOTHING if wanted and v.current else Tend.RETIRE
    return Tend.SPAWN if wanted and v.settled else Tend.NOTHING


def usable(*, alive: bool, connected: bool, current: bool) -> bool:
    """Can the standby take a dead worker's rank now? Only once it waits in init() (connected: torch imported,
    nothing of the script left before init() to run) - one still starting would cost the start-up it exists to
    save, and a new process for the rank is no slower - and only a standby of this restart attempt. Any local rank:
    it learns its LOCAL_RANK at init(). Pure."""
    return alive and connected and current


def after_exit(*, connected: bool, returncode: int, idle_deaths: int) -> str | None:
    """A standby exited unused (not killed by the agent): why standbys are off for the rest of the run, or None to
    start another. `idle_deaths`: those that died while waiting, before this one. Pure."""
    how = f"signal {-returncode}" if returncode < 0 else f"code {returncode}"
    if not connected:
        return (f"the standby worker exited ({how}) before it reached phoenixrun.init(): a script that needs "
                "LOCAL_RANK, or fails, before init() cannot have one")
    if idle_deaths + 1 >= MAX_IDLE_DEATHS:
        return f"{idle_deaths + 1} standby workers died while waiting (the last with {how})"
    return None


def over_budget(*, cpu_s: float, wall_s: float, rss_bytes: int, budget: IdleBudget) -> str | None:
    """A connected standby's cost over the last `wall_s` seconds: why it is too much, or None. Pure."""
    if wall_s > 0 and cpu_s / wall_s > budget.cpu_fraction:
        return (f"the standby worker used {cpu_s / wall_s:.1%} of a core while waiting in init() (budget "
                f"{budget.cpu_fraction:.0%}): the script works before init()")
    if rss_bytes > budget.rss_bytes:
        return (f"the standby worker holds {rss_bytes / 2**20:.0f} MiB while waiting in init() (budget "
                f"{budget.rss_bytes / 2**20:.0f} MiB): the script builds large state before init()")
    return None


class StandbyWorker:
    """The node's standby process, its channel once it said hello, and whether standbys are off for this run."""

    def __init__(self, enabled: bool, budget: IdleBudget = IdleBudget()):
        self.worker: Worker | None = None
        self.conn: WorkerConn | None = None
        self.started_for = 0                 # the restart attempt it was started in
        self.off: str | None = None if enabled else "--no-standby-worker"
        self.idle_deaths = 0
        # the last standbys started: one retired or dead may still have a hello on its way (the last few only: a
        # pid is reused in time)
        self.former: deque[int] = deque(maxlen=4)
        self.budget = budget
        self._look: tuple[float, float] | None = None    # (time, CPU seconds) at the last budget look

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.poll() is None

    def start(self, worker: Worker, restart_count: int) -> None:
        self.worker, self.conn, self.started_for, self._look = worker, None, restart_count, None
        self.former.append(worker.pid)
        log.info("standby worker started (pid %d)", worker.pid)

    def claims(self, pid: int | None) -> bool:
        """Is this hello's process the standby (or a process it started: a --no-python wrapper's)?"""
        if self.worker is None or pid is None:
            return False
        if pid == self.worker.pid:
            return True
        try:
            return pid in {c.pid for c in psutil.Process(self.worker.pid).children(recursive=True)}
        except psutil.Error:
            return False

    def was_standby(self, pid: int | None) -> bool:
        """A hello from a standby that is gone (retired, or dead, with its hello still unread): it must not be taken
        for a rank's worker (with no LOCAL_RANK it would say local rank 0)."""
        return pid in self.former and (self.worker is None or pid != self.worker.pid)

    def connected(self, conn: WorkerConn) -> None:
        self.conn = conn
        self._look = None
        log.info("standby worker (pid %s) is ready: waiting in phoenixrun.init()", conn.pid)

    def usable(self, restart_count: int) -> bool:
        return usable(alive=self.alive, connected=self.conn is not None and not self.conn.closed,
                      current=self.started_for == restart_count)

    def take(self) -> tuple[Worker, WorkerConn]:
        """Hand the standby over (call `usable` first); the node has none until the next is started."""
        worker, conn = self.worker, self.conn
        assert worker is not None and conn is not None
        self.worker, self.conn = None, None
        return worker, conn

    def retire(self) -> None:
        """Kill the standby, if any (the agent's doing: not an exit that counts against standbys)."""
        worker, self.worker, self.conn = self.worker, None, None
        if worker is not None:
            worker.kill_tree(grace=0.1)

    def check(self, now: float) -> None:
        """An exited standby is forgotten (and may turn standbys off); a connected one's idle cost is read every
        BUDGET_LOOK_S and one over budget is retired, with standbys off for the run."""
        w = self.worker
        if w is None:
            return
        rc = w.poll()
        if rc is not None:
            why = after_exit(connected=self.conn is not None, returncode=rc, idle_deaths=self.idle_deaths)
            self.idle_deaths += self.conn is not None
            self.worker, self.conn = None, None
            log.warning("standby worker (pid %d) exited with %s", w.pid, rc)
            self.turn_off(why)
            return
        if self.conn is None or (self._look is not None and now - self._look[0] < BUDGET_LOOK_S):
            return
        try:
            p = psutil.Process(w.pid)
            cpu = sum(p.cpu_times()[:2])
            rss = p.memory_info().rss
        except psutil.Error:
            return
        if self._look is None:
            self._look = (now, cpu)
            return
        t0, cpu0 = self._look
        self._look = (now, cpu)
        why = over_budget(cpu_s=cpu - cpu0, wall_s=now - t0, rss_bytes=rss, budget=self.budget)
        if why is not None:
            self.retire()
            self.turn_off(why)

    def turn_off(self, why: str | None) -> None:
        if why is not None and self.off is None:
            self.off = why
            log.warning("%s; standby workers are off for this run: a worker death starts a new process "
                        "(--no-standby-worker turns them off from the start)", why)

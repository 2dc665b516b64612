"""The agent's worker supervisor: spawns this node's workers, hands them their assignment, reaps them, reports
their exits, and kills those that hang (the hang watchdog) or do not quiesce in time.

What a worker's state means is decided by pure functions (`hang_check` in agents/watchdog.py, `exit_outcome`,
`exit_detail`); the
supervisor carries out the decision. Call its methods with the node's lock held unless they say otherwise.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

from phoenixrun.config import AgentConfig
from phoenixrun.faults.mismatch import state_mismatch
from phoenixrun.protocol import reports, worker_orders
from phoenixrun.protocol.constants import STACK_DUMP_WAIT_S
from phoenixrun.agents.failure_text import failure_text
from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.node import NodeState
from phoenixrun.agents.phases import QUIESCE_GRACE_FLOOR_S, QUIESCE_GRACE_STEPS, REPORTED, PhaseAcks, StepTimes
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.slots import LocalSlots
from phoenixrun.agents.standby import NodeView, StandbyWorker, Tend, tend
from phoenixrun.agents.watchdog import Hang, Watched, hang_check
from phoenixrun.agents.workers import Placement, Worker, standby_env, worker_env
from phoenixrun.protocol import progress_block

log = logging.getLogger("phoenixrun.agent")


# A worker that left the protected loop (its link closed) is not watched for hangs: its results and teardown may
# take as long as the script needs, as under torchrun. One still running this long after is named in the log.
EXIT_WAIT_WARN_MIN_S = 60.0
# how long a worker that exited with a code gets for its last stderr to reach the agent (the pipe closes at its
# exit unless a child of its own still holds it: then its report goes out without waiting longer)
STDERR_GRACE_S = 0.2


def exit_overdue(now: float, left_loop: float, hang_timeout: float) -> bool:
    """A worker that left the protected loop at `left_loop` and still runs: time to say so (once). Pure."""
    return now - left_loop > max(EXIT_WAIT_WARN_MIN_S, 3 * hang_timeout)


class Exit(Enum):
    RUNNING = "running"
    WARM = "warm"        # a warm spare's worker (no rank): logged, not a fault of the job
    DONE = "done"        # the script finished
    FAILED = "failed"    # reported to the master as a worker exit


def exit_outcome(rank: int | None, returncode: int | None) -> Exit:
    """What a worker's exit status means. Pure."""
    if returncode is None:
        return Exit.RUNNING
    if rank is None:
        return Exit.WARM
    return Exit.DONE if returncode == 0 else Exit.FAILED


def exit_detail(rank: int | None, returncode: int) -> str:
    """How a failed worker's exit reads in logs and reports (a negative code is a signal, as from Popen). Pure."""
    return f"rank {rank} exited with {'signal ' + str(-returncode) if returncode < 0 else 'code ' + str(returncode)}"


class WorkerSupervisor:
    def __init__(self, cfg: AgentConfig, node: NodeState, slots: LocalSlots, phases: PhaseAcks,
                 reporter: Reporter, sock_path: str, gloo_ifname: str | None):
        self.cfg, self.node, self.slots, self.phases, self.reporter = cfg, node, slots, phases, reporter
        self.sock_path, self.gloo_ifname = sock_path, gloo_ifname
        self.workers: dict[int, Worker] = {}
        self.conns: dict[int, WorkerConn] = {}
        self.waiting_hello: dict[int, WorkerConn] = {}   # warm spare workers: their assignment comes with a restore
        self.done: set[int] = set()
        self.reported_exit: set[int] = set()             # exits already accounted for (or caused by us)
        self.last_progress: dict[int, float] = {}        # the last sign of progress in a message (monotonic)
        self.step_times = StepTimes()                    # what the quiesce grace follows (phases.quiesce_grace)
        self.pinged: dict[int, float] = {}               # the hang watchdog's last question (monotonic) ...
        self.answered: dict[int, float] = {}             # ... and the last answer (agents/watchdog.py)
        # where each worker records the step it is in, for the hang watchdog (inherited by every worker)
        self.board = progress_block.ProgressBlock.create()
        self.left_loop: dict[int, float] = {}            # when a live worker closed its link (until named)
        self.error_text: dict[int, str] = {}             # a worker's own exception, sent before it exits
        self.standby = StandbyWorker(cfg.standby_worker)  # the pre-started process a dead worker's rank goes to

    # ------------------------------------------------------------------ spawning
    def placement(self, local_rank: int, rank_known: bool, name: str | None = None) -> Placement:
        node, job = self.node, self.node.terms()
        return Placement(
            local_rank=local_rank, nproc_per_node=node.nproc_per_node, nnodes=job.nnodes,
            slot=node.slot if rank_known else None, rank=node.rank(local_rank) if rank_known else None,
            master_addr=node.store_host(), master_port=node.job_store_port(),
            run_id=job.run_id, restart_count=node.restart_count, max_restarts=job.max_restarts,
            generation=node.generation, agent_sock=self.sock_path, gloo_ifname=self.gloo_ifname,
            error_file=str(Path(self.cfg.log_dir or "/tmp") / f"error-{node.node_id}-{name or local_rank}.json"))

    def _env(self, p: Placement) -> dict[str, str]:
        env = worker_env(dict(os.environ), p)
        job = self.node.terms()
        env["PHOENIXRUN_TP"], env["PHOENIXRUN_PP"] = str(job.tp), str(job.pp)
        env[progress_block.ENV] = str(self.board.fd)
        return env

    def _shown(self, local_rank: int) -> bool:
        return self.cfg.local_ranks_filter is None or local_rank in self.cfg.local_ranks_filter

    def spawn(self, local_rank: int, rank_known: bool) -> None:
        p = self.placement(local_rank, rank_known)
        self.workers[local_rank] = Worker(self.cfg.spec, p, self._env(p), sys.stdout, self.cfg.log_dir, self.cfg.tee,
                                          show=self._shown(local_rank), err=sys.stderr, pass_fds=(self.board.fd,),
                                          on_exit=self._exited)
        self._fresh(local_rank)

    def _fresh(self, local_rank: int) -> None:
        """A new process holds `local_rank`: nothing of its predecessor's exit is pending."""
        self.done.discard(local_rank)
        self.reported_exit.discard(local_rank)
        self.left_loop.pop(local_rank, None)

    def spawn_all(self, rank_known: bool) -> None:
        with self.node.lock:
            for lr in self.node.local_ranks():
                self.spawn(lr, rank_known)

    def kill_all(self) -> None:
        """Every worker, and the standby (a restart's workers get a new environment; the next is started once the
        node trains again)."""
        for w in list(self.workers.values()):
            w.kill_tree(grace=self.cfg.shutdown_timeout)
        self.workers.clear()
        self.conns.clear()
        self.waiting_hello.clear()
        self.standby.retire()

    def kill_unanswering(self, local_ranks: list[int]) -> None:
        """Kill workers that did not acknowledge a quiesce within its grace, each first asked for its threads' stacks
        (to its stderr, so the job log shows where it was blocked); the next recovery step respawns them."""
        # connected: its runtime said hello, after installing the handler (runtime/api.py init)
        asked = [lr for lr in local_ranks
                 if lr in self.conns and (w := self.workers.get(lr)) is not None and w.ask_stacks()]
        if asked:
            log.warning("rank(s) %s: their threads' stacks follow in their output", ", ".join(
                str(self.workers[lr].rank) for lr in asked))
            time.sleep(STACK_DUMP_WAIT_S)
        for lr in local_ranks:
            self.kill(lr)

    def kill(self, local_rank: int) -> None:
        """Kill a worker on purpose (our doing, not a fault to report); the next recovery step respawns it."""
        w = self.workers.get(local_rank)
        self.reported_exit.add(local_rank)
        self.conns.pop(local_rank, None)
        if w is not None:
            w.kill_tree(grace=0.1)

    # ------------------------------------------------------------------ what the workers are
    def warm_workers(self) -> bool:
        """Pre-started workers with no rank yet (a warm spare's) are all alive."""
        with self.node.lock:
            return bool(self.workers) and all(w.rank is None and w.poll() is None for w in self.workers.values())

    def warm_connected(self) -> bool:
        """Every warm worker has connected (torch imported): promoting this spare costs no start-up."""
        with self.node.lock:
            return self.warm_workers() and len(self.waiting_hello) == self.node.nproc_per_node

    def live_pids(self) -> list[int]:
        return [w.pid for w in self.workers.values() if w.poll() is None]

    def live_connected(self) -> set[int]:
        """Local ranks whose worker runs and is connected (it can be told to quiesce)."""
        return {lr for lr, w in self.workers.items() if w.poll() is None and lr in self.conns}

    def live_ranked(self) -> set[int]:
        """Local ranks whose worker runs with a rank and is connected (it can be rebuilt in place)."""
        return {lr for lr, w in self.workers.items() if w.rank is not None and w.poll() is None and lr in self.conns}

    def running(self) -> tuple[list[Worker], list[WorkerConn]]:
        """Running workers and their connections, lowest local rank first (fault drills act on the first)."""
        with self.node.lock:
            workers = [w for w in self.workers.values() if w.poll() is None]
            conns = [self.conns[lr] for lr in sorted(self.conns) if self.workers.get(lr) in workers]
        return workers, conns

    # ------------------------------------------------------------------ the channel
    def assignment(self, local_rank: int) -> worker_orders.Assign:
        node, job = self.node, self.node.terms()
        slot = node.slot
        assert slot is not None, "an assignment for a node without a slot"   # a spare's workers get one as it joins
        return worker_orders.Assign(
            rank=node.rank(local_rank), local_rank=local_rank, slot=slot, nnodes=job.nnodes,
            nproc_per_node=node.nproc_per_node, world_size=job.nnodes * node.nproc_per_node,
            generation=node.generation, store_prefix=node.store_prefix, restart_count=node.restart_count,
            restore_step=node.restore_step, master_addr=node.store_host(), master_port=node.job_store_port(),
            tp=job.tp, pp=job.pp, run_id=job.run_id, reshard=node.reshard_of(local_rank))

    def hello(self, conn: WorkerConn, local_rank: int) -> None:
        """A worker connected: a ranked one gets its assignment, a warm spare's waits for its rank, and so does the
        standby (for whichever local rank needs it first)."""
        if self.standby.claims(conn.pid):
            conn.local_rank = None      # none yet: nothing it sends counts as a rank's until it has one
            self.standby.connected(conn)
            return
        if self.standby.was_standby(conn.pid):
            conn.local_rank = None      # a retired standby's late hello: it is dead or dying
            return
        w = self.workers.get(local_rank)
        if w is not None and w.rank is None:
            self.waiting_hello[local_rank] = conn
        else:
            self.conns[local_rank] = conn
            conn.send(self.assignment(local_rank))

    def send_all(self, local_ranks: set[int], msg: dict[str, Any] | worker_orders.WorkerOrder) -> None:
        for lr in local_ranks:
            self.conns[lr].send(msg)

    def resume(self, step: int) -> None:
        """Every local rank carries on from `step`, whose snapshot is in its slot: a dead worker is respawned
        (it restores from the slot as it starts), a warm spare's worker gets its assignment (now, or with its
        hello), a live one rebuilds its groups in place."""
        for lr in self.node.local_ranks():
            w = self.workers.get(lr)
            if w is None or w.poll() is not None:
                if not self._hand_to_standby(lr):
                    self.spawn(lr, rank_known=True)
            elif w.rank is None:
                w.rank = self.node.rank(lr)
                conn = self.waiting_hello.pop(lr, None)
                if conn is not None:
                    self.conns[lr] = conn
                    conn.send(self.assignment(lr))
            elif lr in self.conns:
                # the store moves with the master (a standby took over on its own host)
                self.conns[lr].send(worker_orders.Rebuild(
                    generation=self.node.generation, restore_step=step, store_prefix=self.node.store_prefix,
                    master_addr=self.node.store_host(), master_port=self.node.job_store_port()))

    # ------------------------------------------------------------------ the standby worker (agents/standby.py)
    def _hand_to_standby(self, local_rank: int) -> bool:
        """A dead worker's rank goes to the standby waiting in init(), if there is a usable one: it restores from
        this node's slot as a new process would, without starting."""
        if not self.standby.usable(self.node.restart_count):
            return False
        w, conn = self.standby.take()
        w.rank, w.local_rank, w.show = self.node.rank(local_rank), local_rank, self._shown(local_rank)
        conn.local_rank = local_rank
        self.workers[local_rank], self.conns[local_rank] = w, conn
        self._fresh(local_rank)
        conn.send(self.assignment(local_rank))
        log.info("rank %d handed to the standby worker (pid %d)", w.rank, w.pid)
        return True

    def settled(self) -> bool:
        """No recovery under way, and every local rank runs and made progress since the last one."""
        ranks = set(self.node.local_ranks())
        return (not self.slots.frozen and not (self.phases.pending_resume - {REPORTED})
                and self.live_ranked() == ranks and ranks <= self.last_progress.keys())

    def tend_standby(self, now: float) -> None:
        """Start the standby (once the node trains: off the critical path), or retire it, as `tend` decides."""
        self.standby.check(now)
        node = self.node
        action = tend(NodeView(enabled=self.standby.off is None, api=node.api, active=node.role == "active",
                               have=self.standby.alive, current=self.standby.started_for == node.restart_count,
                               settled=self.settled(), finishing=bool(self.done)))
        if action is Tend.SPAWN:
            p = self.placement(0, rank_known=False, name="standby")
            self.standby.start(Worker(self.cfg.spec, p, standby_env(self._env(p)), sys.stdout, self.cfg.log_dir,
                                      self.cfg.tee, show=self.cfg.local_ranks_filter is None, err=sys.stderr,
                                      name="standby", pass_fds=(self.board.fd,)), node.restart_count)
        elif action is Tend.RETIRE:
            self.standby.retire()

    # ------------------------------------------------------------------ the hang watchdog
    def progressed(self, local_rank: int) -> None:
        """A message that shows progress (agents/worker_ops.py PROGRESS_OPS): the worker is watched from now on."""
        self.last_progress[local_rank] = time.monotonic()

    def answered_ping(self, local_rank: int) -> None:
        """Its agent-link thread answered the watchdog's question: the process is alive."""
        self.answered[local_rank] = time.monotonic()

    def stepped(self, local_rank: int, seconds: float) -> None:
        """A worker's `progress` carried the longest step it took since its last one (what the grace follows)."""
        try:    # the channel's decode does not check a field's type: a worker's stray value is ignored, not fatal
            self.step_times.record(local_rank, float(seconds))
        except (TypeError, ValueError):
            pass

    def unwatch(self, conn: WorkerConn) -> None:
        """A worker closed its link: it crashed (its exit is what counts: `watch` sees it) or it left the
        protected loop and is exiting. Either way the hang watchdog stops watching it: a worker past its last
        step still writes its results and tears down its groups, seconds on a loaded machine, and pinging its
        closed link took it for hung (fault-matrix runs killed every rank at the final step)."""
        lr = conn.local_rank
        if lr is None:
            return
        with self.node.lock:
            if self.conns.get(lr) is conn:   # (the conn stays: a quiesce still counts a live one that never acks)
                self.last_progress.pop(lr, None)
                self.left_loop[lr] = time.time()

    def watch(self) -> None:
        """One look at the workers: kill those that did not quiesce in time or hang, report those that exited."""
        now = time.time()
        with self.node.lock:
            if self.slots.frozen and self.phases.quiesce_overdue(now):
                for lr in self.phases.unacked_quiesce():
                    w = self.workers.get(lr)
                    log.warning("rank %s did not quiesce within %.1fs (its grace: %g x this node's longest recent "
                                "step, at least %gs; blocked in a collective): killing it; it restarts from this "
                                "node's snapshot", w.rank if w else lr, self.phases.quiesce_grace_s,
                                QUIESCE_GRACE_STEPS, QUIESCE_GRACE_FLOOR_S)
                self.kill_unanswering(self.phases.unacked_quiesce())
                self.phases.drop_quiesce()
            if not self.slots.frozen:   # waiting is legitimate during a recovery
                self._watch_hangs(now)
        with self.node.lock:
            self._reap()
            self.tend_standby(now)

    def _watch_hangs(self, now: float) -> None:
        for lr, left in list(self.left_loop.items()):
            w = self.workers.get(lr)
            if w is None or w.poll() is not None or not exit_overdue(now, left, self.cfg.hang_timeout):
                continue
            log.warning("rank %s (pid %d) left the training loop %.0fs ago and has not exited (writing its results, "
                        "tearing its groups down, or stuck there): waiting for it, as torchrun would; "
                        "`py-spy dump --pid %d` shows where it is", w.rank, w.pid, now - left, w.pid)
            del self.left_loop[lr]
        mono = time.monotonic()
        for lr, w in list(self.workers.items()):
            conn = self.conns.get(lr)
            if w.rank is None or w.poll() is not None or conn is None:
                continue
            record = self.board.read(lr)
            seen = Watched(armed=self.last_progress.get(lr), step_start=record[1] if record else None,
                           pinged=self.pinged.get(lr), answered=self.answered.get(lr))
            verdict = hang_check(mono, seen, self.cfg.hang_timeout)
            if verdict is Hang.PING:
                self.pinged[lr] = mono
                conn.send(worker_orders.Ping())
            elif verdict is Hang.HUNG:
                self._hung(lr, w, seen, mono, now)

    def _hung(self, lr: int, w: Worker, seen: Watched, mono: float, now: float) -> None:
        """Kill a hung worker at once (a stopped process cannot act on a SIGTERM) and report the hang."""
        started = max(seen.armed or mono, seen.step_start or 0.0)
        detail = f"rank {w.rank} made no progress for {mono - started:.1f}s and does not answer"
        log.warning("%s: killing it", detail)
        self.reported_exit.add(lr)      # reported as a hang, not as the exit we cause
        self.last_progress.pop(lr, None)
        self.pinged.pop(lr, None)
        self.reporter.report(reports.WorkerHang(rank=w.rank, detail=detail, t=now))
        w.kill_now()

    def _exited(self, w: Worker) -> None:
        """A worker's process exited (its own thread calls this at once): its exit is reported now, not at the next
        watch - a worker death's detection is the time to the agent's report, not a poll interval."""
        with self.node.lock:
            if self.workers.get(w.local_rank) is w:
                self._reap()

    def _refused_state(self, w: Worker, rc: int) -> None:
        """A worker that failed while its node restored a snapshot or checkpoint: if its error says the state's
        layout is not its model's, tell the master first - no retry can succeed (faults/mismatch.py)."""
        if self.node.restore_step is None or rc < 0:    # killed: no error of its own to read
            return
        mismatch = state_mismatch(w.err_tail(wait=0.5))
        if mismatch is not None:
            log.error("rank %s refused the restored state of step %s: %s", w.rank, self.node.restore_step, mismatch)
            self.reporter.report(reports.RestoreFailed(rank=w.rank, reason=mismatch, mismatch=True,
                                                       persist_step=self.node.restore_step))

    def _own_words(self, w: Worker, local_rank: int, rc: int) -> str:
        """What a failed worker said about its failure: the exception it sent (the API), else, for an exit code
        (not a signal), its error file or its stderr's last traceback (agents/failure_text.py) - so a peer whose
        collective failed is told from the rank that raised."""
        sent = self.error_text.pop(local_rank, "")
        if sent or rc <= 0:
            return sent
        raw: str | None = None
        try:
            f = Path(w.placement.error_file)
            if f.stat().st_mtime >= w.started - 1.0:    # written by this worker, not left by an earlier attempt
                raw = f.read_text()
        except OSError:
            pass
        return failure_text(raw, w.err_tail(wait=STDERR_GRACE_S))

    def _reap(self) -> None:
        for lr, w in list(self.workers.items()):
            rc = w.poll()
            outcome = exit_outcome(w.rank, rc)
            if rc is None or outcome is Exit.RUNNING or lr in self.reported_exit:
                continue
            self.reported_exit.add(lr)
            self.conns.pop(lr, None)
            self.phases.gone(lr)
            if outcome is Exit.WARM:
                log.warning("warm spare worker %d exited with %s", lr, rc)
            elif outcome is Exit.DONE:
                self.done.add(lr)
                if self.done >= set(self.node.local_ranks()):
                    self.reporter.report(reports.WorkersDone())
            else:
                detail = exit_detail(w.rank, rc)
                log.warning("%s", detail)
                self._refused_state(w, rc)
                self.reporter.report(reports.WorkerExit(rank=w.rank, returncode=rc, detail=detail,
                                                        text=self._own_words(w, lr, rc), t=time.time()))

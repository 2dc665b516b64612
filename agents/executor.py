"""The agent's directive executor: carries out the master's orders (run, wait, quiesce, restore, restart, stop)
on this node, and reports `quiesced` once all its workers did.

What an order means given the node's state is decided by a pure function (`plan_directive`); the executor
carries the decision out. Orders are applied one at a time, on the agent's main loop; a restore runs on a
thread of its own (it fetches from peers) so that the loop goes on watching the workers.
"""
from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Mapping

from phoenixrun.protocol import reports
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol import worker_orders
from phoenixrun.protocol.directives import Directive
from phoenixrun.protocol.reshard import NodeReshard
from phoenixrun.protocol.restore import RankSource
from phoenixrun.slot_format import SlotHeader
from phoenixrun.testing import pause_point
from phoenixrun.agents.node import Handover, Lifecycle, NodeState
from phoenixrun.agents.peer import PeerError
from phoenixrun.agents.persister import PersistError
from phoenixrun.agents.phases import PhaseAcks
from phoenixrun.agents.replicator import Replicator
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.roles import AgentRole
from phoenixrun.agents.slots import SHM_DIR, IntegrityError, LocalSlots, ReplicaStore, SlotError
from phoenixrun.agents.supervisor import WorkerSupervisor

log = logging.getLogger("phoenixrun.agent")


class Step(Enum):
    NOTHING = "nothing"
    WARM_UP = "warm_up"                      # a spare told to keep warm: pre-start workers without a rank
    START = "start"                          # start ranked workers (a spare's warm ones carry no rank: replaced)
    RESUME = "resume"                        # the recovery is over: snapshots and replicas flow again
    RESTART_IN_PLACE = "restart_in_place"    # from a checkpoint, keeping the live and warm workers it can
    RESTART = "restart"                      # kill every worker, start new ones (from a checkpoint, or not)
    RESHAPE = "reshape"                      # a shrink or grow: new workers in a new world, state from memory
    QUIESCE = "quiesce"
    RESTORE = "restore"
    STOP = "stop"
    FENCED = "fenced"                        # stop, and never rejoin: this node was replaced


def plan_directive(d: Directive, *, has_workers: bool, in_place: bool) -> Step:
    """What directive `d` means for this node: `has_workers` - it has worker processes; `in_place` - its workers
    use the phoenixrun API, or are a warm spare's (they can be given a checkpoint without a new process). Pure."""
    o = d.order
    if isinstance(o, cmd.Wait):
        return Step.WARM_UP if o.warm and not has_workers else Step.NOTHING
    if isinstance(o, cmd.Run):
        return Step.RESUME if o.resume else Step.START
    if isinstance(o, cmd.Restart):
        if d.own.reshard is not None:
            return Step.RESHAPE
        return Step.RESTART_IN_PLACE if o.restore_step is not None and in_place else Step.RESTART
    if isinstance(o, cmd.Quiesce):
        return Step.QUIESCE
    if isinstance(o, cmd.Restore):
        return Step.RESTORE
    if isinstance(o, cmd.Stop):
        return Step.FENCED if o.fenced else Step.STOP
    return Step.NOTHING


def waits_for_io_process(o: cmd.Order) -> bool:
    """Workers start from scratch on this order: the checkpoint I/O process must be up first, or their first
    checkpoints would be skipped while it still imports. (A restart from a checkpoint needs the process to read
    it anyway: it waits for it there, with its workers starting meanwhile.) Pure."""
    return isinstance(o, cmd.Run) or (isinstance(o, cmd.Restart) and o.restore_step is None)


class DirectiveExecutor:
    def __init__(self, node: NodeState, life: Lifecycle, slots: LocalSlots, replicas: ReplicaStore,
                 supervisor: WorkerSupervisor, phases: PhaseAcks, replicator: Replicator, reporter: Reporter):
        self.node, self.life, self.slots, self.replicas = node, life, slots, replicas
        self.supervisor, self.phases, self.replicator, self.reporter = supervisor, phases, replicator, reporter
        self.drain_at: int | None = None     # the step boundary of the drain being quiesced for (None: not a drain)

    def apply(self, d: Directive) -> None:
        o = d.order
        if isinstance(o, cmd.Noop):
            return
        log.debug("directive %s gen %s", d.command, d.generation)
        with self.node.lock:
            self.node.take_directive(d)
            if not isinstance(o, cmd.Quiesce):
                self.drain_at = None
        if waits_for_io_process(o) and self.node.persister is not None:
            # before workers start (not under the lock: heartbeats go on)
            self.node.persister.ready.wait(timeout=60)
        step = plan_directive(d, has_workers=bool(self.supervisor.workers),
                              in_place=self.node.api or self.supervisor.warm_workers())
        if step is Step.WARM_UP:
            self.supervisor.spawn_all(rank_known=False)
        elif step in (Step.START, Step.RESUME):
            with self.node.lock:
                self.node.become(AgentRole.ACTIVE)
                self.replicator.freeze(False)
                self._drop_reshard()
                if step is Step.START:
                    self.node.restore_step = None
                    self.supervisor.kill_all()
                    self.supervisor.spawn_all(rank_known=True)
        elif step is Step.RESTART_IN_PLACE and isinstance(o, cmd.Restart) and o.restore_step is not None:
            self._restart_in_place(o.restore_step)
        elif step is Step.RESTART and isinstance(o, cmd.Restart):
            self._restart(o)
        elif step is Step.RESHAPE and d.own.reshard is not None:
            self._reshape(d.own.reshard)
        elif step is Step.QUIESCE and isinstance(o, cmd.Quiesce):
            self._quiesce(o.at_step)
        elif step is Step.RESTORE and isinstance(o, cmd.Restore):
            threading.Thread(target=self._restore, args=(o.restore_step, d.own.fetch or {}), daemon=True,
                             name="restore").start()
        elif step is Step.FENCED and isinstance(o, cmd.Stop):
            self.life.fenced(o.reason, o.exit_code)
        elif step is Step.STOP and isinstance(o, cmd.Stop):
            if o.reason:    # the job's clean finish is news, not a warning; a node stopped alone (drained,
                clean = o.job_end and not o.exit_code   # fenced) is worth a warning (issue 29 item 3)
                log.log(logging.INFO if clean else logging.WARNING,
                        "stopping (exit code %s): %s", o.exit_code, o.reason)
            self.life.stop(o.exit_code)

    # ------------------------------------------------------------------ quiesce
    def _quiesce(self, at_step: int | None = None) -> None:
        """at_step: a drain's quiesce - the workers run on to that step boundary and stop there once its snapshot
        is committed; the slots are frozen only when they all did (until then their last snapshots still commit,
        and other nodes' replicas of that step still arrive: the replica store is not frozen by a drain)."""
        self.slots.fetching.abandon("a new recovery quiesces this node")   # its workers ack instead of waiting
        with self.node.lock:
            self.drain_at = at_step
            if at_step is None:
                self.replicator.freeze(True)
            live = self.supervisor.live_connected()
            grace = self.supervisor.step_times.grace()      # follows the measured step time (phases.quiesce_grace)
            self.phases.expect_quiesce(live, deadline=time.time() + grace, grace=grace)
            self.supervisor.send_all(live, worker_orders.Quiesce(generation=self.node.generation, at_step=at_step))
        self.maybe_quiesced()

    def maybe_quiesced(self) -> None:
        """Report `quiesced` once every worker did (or is gone)."""
        with self.node.lock:
            if self.drain_at is not None and not self.phases.unacked_quiesce():
                self.slots.frozen = True     # a drain's workers all stopped at the boundary: nothing more to write
            if not self.phases.quiesce_complete(self.slots.frozen):
                return
            ev = reports.Quiesced(snapshots=self.slots.available(), replicas=self.replicas.available(),
                                  next_step=self.phases.quiesced_next_step)
        self.reporter.report(ev)

    def _await_quiesced(self) -> None:
        """Wait until the live workers stopped touching their slots (the checkpoint is staged into them); one
        that does not answer within the quiesce grace (blocked in a collective; `phases.quiesce_grace`: it follows
        the measured step time) is killed and respawned."""
        with self.node.lock:
            deadline = time.time() + self.supervisor.step_times.grace()
        while time.time() < deadline:
            with self.node.lock:
                if not self.phases.unacked_quiesce():
                    return
            time.sleep(0.01)
        with self.node.lock:
            self.supervisor.kill_unanswering(self.phases.unacked_quiesce())
            self.phases.drop_quiesce()

    # ------------------------------------------------------------------ restore from peers
    def _restore(self, step: int, fetch: Mapping[int, RankSource]) -> None:
        pause_point("restore", step)     # tests: a worker that dies while the others rebuild
        if fetch:
            self._restore_fetched(step, fetch)
            return
        try:
            with self.node.lock:
                self.node.become(AgentRole.ACTIVE)
                self.node.restore_step = step
                self.replicator.restore_point(step)
                if self.node.persister is not None:
                    self.node.persister.reset(step)
                self.phases.expect_resume(self.node.local_ranks())
                self.supervisor.last_progress.clear()
                self.supervisor.resume(step)
        except (SlotError, OSError) as e:
            self._restore_failed(e)

    def _restore_fetched(self, step: int, fetch: Mapping[int, RankSource]) -> None:
        """A replacement's restore: its workers get their ranks now and set up (a warm spare's build the script's
        model and optimizer) while their state is fetched; their restore's `slots` request waits for the fetch
        (agents/fetch_gate.py). One after the other, the fetch and the set-up were the recovery's critical path."""
        with self.node.lock:
            self.node.become(AgentRole.ACTIVE)
            self.node.restore_step = step
            token = self.slots.fetching.close(fetch)
            self.phases.expect_resume(self.node.local_ranks())
            self.supervisor.last_progress.clear()
            self.supervisor.resume(step)
        try:
            timings = self.replicator.fetch(fetch, step)
            with self.node.lock:
                self.replicator.restore_point(step)
                if self.node.persister is not None:
                    self.node.persister.reset(step)
                # no worker of a fetched rank can have resumed yet: it waits for this fetch
                self.phases.resume_timings = self.phases.resume_timings.slowest(timings)
        except (PeerError, SlotError, OSError) as e:
            self.slots.fetching.open(token, error=f"its state could not be fetched: {e}")
            self._restore_failed(e)
            return
        self.slots.fetching.open(token, paths=self._slot_paths)
        self.replicator.fill(fetch)     # while the workers restore: their first snapshots need the second slots

    def _slot_paths(self, rank: int) -> worker_orders.Paths:
        """The reply to a worker's `slots` request that waited for the fetch."""
        try:
            return worker_orders.Paths(paths=self.slots.paths(rank))
        except SlotError as e:
            return worker_orders.Paths(error=str(e))

    def _restore_failed(self, e: Exception) -> None:
        log.error("restore failed: %s", e)
        # integrity: the fetched state is not this rank's; retrying the same plan cannot help
        self.reporter.report(reports.RestoreFailed(reason=str(e), integrity=isinstance(e, IntegrityError)))

    # ------------------------------------------------------------------ restart (torchrun's, or from disk)
    def _restart(self, o: cmd.Restart) -> None:
        with self.node.lock:
            self.node.become(AgentRole.ACTIVE)
            if o.store_port is not None:
                self.node.store_port = o.store_port
            self.supervisor.kill_all()
            self.slots.clear()
        step = o.restore_step
        if step is not None and not self._stage_from_disk(step):
            return
        with self.node.lock:
            self.node.restore_step = step
            self.replicator.freeze(False)
            if step is not None:
                self.replicas.restore_point(step)
                self.phases.expect_resume(self.node.local_ranks())
            self.supervisor.spawn_all(rank_known=True)

    def _reshape(self, info: NodeReshard) -> None:
        """A shrink or grow (control/reshape.py): export the old ranks' snapshots the plan gives this node to files
        its new workers read (its own ranks' slots, replicas it holds of lost ranks), then drop every slot and
        replica (they are keyed by the old ranks) and start the new world's workers."""
        step = info.step
        with self.node.lock:
            self.node.become(AgentRole.ACTIVE)
            self.supervisor.kill_all()
            self._drop_reshard()
        # not under the lock (the heartbeats go on): the slots and replicas are frozen since the quiesce
        files: dict[int, tuple[int, str]] = {}
        try:
            for img in info.images:
                old = img.old_rank
                if img.own:
                    idx = self.slots.slot_of(old, step)
                    if idx is None:
                        raise SlotError(f"no snapshot of rank {old} at step {step} in this node's slots")
                    mm = self.slots.view(old, idx)
                    data = bytes(mm[:SlotHeader.unpack(mm).total_len])
                else:
                    data = self.replicas.get(old, step)
                path = SHM_DIR / f"{self.slots.prefix}-reshard-r{old}"
                path.write_bytes(data)
                files[old] = (img.reader, str(path))
        except (SlotError, OSError) as e:
            log.error("cannot hand the snapshots over for the %s: %s", info.kind, e)
            for _, written in files.values():
                Path(written).unlink(missing_ok=True)
            self.reporter.report(reports.RestoreFailed(reason=str(e)))
            return
        with self.node.lock:
            self.slots.clear()
            self.replicas.clear()
            self.node.reshard = Handover(info.old_world, info.predecessor, files)
            self.node.restore_step = step
            self.replicator.freeze(False)
            self.phases.expect_resume(self.node.local_ranks())
            self.supervisor.spawn_all(rank_known=True)
        log.info("%s: %d old rank snapshot(s) handed to the new workers (step %d)", info.kind, len(files), step)

    def _drop_reshard(self) -> None:
        """The reshape's images are read once every worker resumed (call with the lock held)."""
        if self.node.reshard is not None:
            for _, path in self.node.reshard.files.values():
                Path(path).unlink(missing_ok=True)
            self.node.reshard = None

    def _restart_in_place(self, step: int) -> None:
        """Fallback restart of a node whose workers use the phoenixrun API, without starting processes where it
        can: live workers are quiesced and rebuilt from the staged checkpoint (a local reset from disk); a warm
        spare's workers get their rank once it is staged; only dead ones are spawned, while it is read. Done
        one after the other - I/O process ready, read, then kill, spawn and import torch - a restart took over
        13 s on a loaded 2-core machine, and under a kill every 8-15 s no fallback finished."""
        with self.node.lock:
            self.node.become(AgentRole.ACTIVE)
            live = self.supervisor.live_ranked()
            if not live and not self.supervisor.warm_workers():
                self.supervisor.kill_all()
                self.slots.clear()
                self.supervisor.spawn_all(rank_known=False)     # they import torch and wait for their assignment
            self.node.restore_step = None
            if live:
                self.replicator.freeze(True)
                self.phases.expect_quiesce(live)
                self.supervisor.send_all(live, worker_orders.Quiesce(generation=self.node.generation))
        if live:
            self._await_quiesced()
        if not self._stage_from_disk(step):
            return
        with self.node.lock:
            self.node.restore_step = step
            self.replicator.freeze(False)
            self.replicas.restore_point(step)
            self.phases.expect_resume(self.node.local_ranks())
            self.supervisor.last_progress.clear()
            self.supervisor.resume(step)

    def _stage_from_disk(self, step: int) -> bool:
        """Fallback restart: load this node's ranks of persistent checkpoint `step` into their slots."""
        t0 = time.time()
        persister = self.node.persister
        try:
            if persister is None:
                raise PersistError("this job writes no persistent checkpoints")
            persister.reset(step)     # queued writes of the abandoned timeline do not go before the read
            for lr in self.node.local_ranks():
                self.slots.install_image(self.node.rank(lr), persister.read(step, self.node.rank(lr)))
        except (PersistError, SlotError, OSError) as e:
            log.error("cannot restore checkpoint step %d: %s", step, e)
            self.reporter.report(reports.RestoreFailed(reason=str(e), persist_step=step))
            return False
        persister.reset(step)
        log.info("staged checkpoint step %d from %s in %.2fs", step, persister.cfg.dir, time.time() - t0)
        return True

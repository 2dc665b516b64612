"""A rank's side of a recovery: stop, report, wait for the master's rebuild order, rejoin, restore.

Three ways in, one cycle: a survivor whose step was abandoned (a collective error or the master's quiesce order),
a survivor stopping at a drain's step boundary, and a replacement process (a warm spare or a local reset's new
worker) restoring inside protect(). Each ends with the new generation's groups up and the state of the restore
step in model, optimizer and `state`; then `restored(step)` runs (the Job's: its loop and the script's callbacks).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Reducer

from phoenixrun.faults.classify import collective_cause
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol.timings import Timings
from phoenixrun.protocol.reshard import WorkerReshard
from phoenixrun.protocol.worker_orders import Quiesce, Rebuild
from phoenixrun.runtime.agent_link import StateUnavailable
from phoenixrun.runtime.protection import Protection, Quiesced
from phoenixrun.runtime.reshard import reshard

if TYPE_CHECKING:   # api.py builds this client with its runtime; the import would be circular at run time
    from phoenixrun.runtime.api import _Runtime

log = logging.getLogger("phoenixrun.runtime")


def ddp_modules(model: torch.nn.Module) -> list[Any]:   # DistributedDataParallel: its reducer is untyped
    from torch.nn.parallel import DistributedDataParallel as DDP
    return [m for m in model.modules() if isinstance(m, DDP)]


def recoverable_cause(exc: BaseException | None) -> BaseException | None:
    """The collective failure behind `exc`, also one a library wrapped (a pipeline stage that lost its neighbour
    node must recover like any other survivor, not stop as a user error); None: the script's own error."""
    return collective_cause(exc, (Quiesced, dist.DistError))


class RecoveryClient:
    """Drives this rank through a recovery; the runtime (`rt`: agent link, generations) does the I/O."""

    def __init__(self, rt: _Runtime, protection: Protection, next_step: Callable[[], int], restored: Callable[[int], None]):
        self.rt, self.link, self.protection = rt, rt.link, protection
        self.next_step = next_step    # the step the loop runs next (what a quiesced rank reports)
        self.restored = restored

    def recover(self, exc: BaseException | None, current: int) -> None:
        """A survivor's step was abandoned (by `exc`, or a quiesce order): clean up, then rejoin and restore."""
        t0 = time.time()
        if not self.rt.quiesce_pending:
            cause = recoverable_cause(exc) or exc
            self.link.send(wm.CommError(text=f"{type(cause).__name__}: {cause}"[:2000], step=current))
            self.rt.abort()   # let peers blocked on us fail now instead of at their timeout
        self.protection.wait_idle()
        model, optimizer = self.protection.model, self.protection.optimizer
        for ddp in ddp_modules(model):
            try:   # a backward abandoned at a bucket boundary leaves DDP's reducer expecting the rest of it
                Reducer._check_reducer_finalized(ddp.reducer)
            except RuntimeError:   # "Expected to have finished reduction in the prior iteration" at the replay
                Reducer._reset_state(ddp.reducer)   # (what DDP's own _update_process_group does first)
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        self.await_rebuild(t0)

    def stop_for_drain(self) -> None:
        """The drain's step boundary: wait until this step's snapshot is committed, then report quiesced and wait
        for the rebuild, as a quiesce would - without shutting any socket down: every rank stops here, none is
        inside a step with this one, so nothing is abandoned and nothing replays."""
        t0 = time.time()
        assert self.rt.drain_at is not None, "called at the drain's boundary, which the agent set"
        generation = self.rt.drain_at[0]
        self.protection.copier.wait()
        with self.link.cv:
            while (self.link.committed_step < self.protection.awaited_step and self.link.commit_error is None
                   and not self.link.closed and self.link.quiesce_generation < generation):
                self.link.cv.wait(0.5)
            self.link.commit_error = None
            self.link.quiesce_generation = max(self.link.quiesce_generation, generation)
        self.protection.copier.error = None
        self.await_rebuild(t0)

    def await_rebuild(self, t0: float) -> None:
        """Report quiesced, wait for the master's rebuild order, rejoin, restore. Repeats on cascades."""
        reported = -1
        while True:
            g = self.link.quiesce_generation
            if g > self.rt.generation and g > reported:
                self.link.send(wm.Quiesced(generation=g, next_step=self.next_step()))
                reported = g
            order = self.rt.next_order(Rebuild, Quiesce)
            if not isinstance(order, Rebuild) or order.generation < self.link.quiesce_generation:
                continue
            log.warning("rank %d: rejoining as generation %d, restoring step %d", self.rt.rank,
                        order.generation, order.restore_step)
            try:
                t1 = time.time()
                self.rt.connect(order.generation, order.store_prefix, order.master_addr,
                                order.master_port)
                t2 = time.time()
                self.protection.restore(order.restore_step)
                t3 = time.time()
            except (RuntimeError, ValueError) as e:
                log.warning("rejoin of generation %s failed (%s); waiting for the next", order.generation, e)
                continue
            self.restored(order.restore_step)
            self.link.send(wm.Resumed(generation=order.generation, timings=Timings(
                rebuild_s=t2 - t1, state_s=t3 - t2, worker_recovery_s=t3 - t0)))
            return

    def join(self, generation: int, restore_step: int) -> None:
        """A replacement process (spare or local reset): restore from the agent's slot, then rendezvous."""
        t0 = time.time()
        try:
            paths = self.protection.slot_paths()   # waits while its agent fetches the state (agents/fetch_gate.py)
        except StateUnavailable as e:
            log.warning("rank %d: no state to restore from (%s); waiting for the master's next order", self.rt.rank, e)
            self.await_rebuild(t0)
            return
        t_in = time.time()
        self.protection.restore(restore_step, paths)
        t1 = time.time()
        if self.link.quiesce_generation >= generation:
            self.await_rebuild(t0)
            return
        try:
            self.rt.connect(generation)
        except (RuntimeError, ValueError):
            self.await_rebuild(t0)
            return
        self.restored(restore_step)
        t2 = time.time()
        self.link.send(wm.Resumed(generation=generation, timings=Timings(
            setup_s=t0 - self.rt.assigned_at, state_wait_s=t_in - t0, state_s=t1 - t_in, rebuild_s=t2 - t1,
            worker_recovery_s=t2 - t0)))

    def reshape(self, generation: int, step: int, info: WorkerReshard) -> None:
        """A new worker of a shrunk or grown world (control/reshape.py): join the new world, then re-partition the
        old ranks' snapshots this worker's agent handed over (runtime/reshard.py) - collectively, every rank."""
        t0 = time.time()
        self.rt.connect(generation)
        t1 = time.time()
        images = {}
        for old, path in info.images.items():
            with open(path, "rb") as f:
                images[old] = f.read()
        p = self.protection
        extra = reshard(p.model, p.optimizer, images, info.predecessor, info.old_world)
        p.state.clear()
        p.state.update(extra)
        if p.position.stream is not None and self.rt.rank == 0:   # another world partitions the data otherwise
            log.warning("phoenixrun: the world was re-shaped at step %d: the data stream starts its epoch over on "
                        "the new partition of the data (docs/porting.md)", step)
        p.restarted_at(step)
        self.restored(step)
        t2 = time.time()
        self.link.send(wm.Resumed(generation=generation, timings=Timings(
            rebuild_s=t1 - t0, reshard_s=t2 - t1, worker_recovery_s=t2 - t0)))

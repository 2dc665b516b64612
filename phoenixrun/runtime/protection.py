"""The protection pipeline of one rank: every step's state into the node agent's slots, in the background.

After a step ends, `snapshot(step)` encodes the script's `state` and the run's position on the training thread,
then copies model and optimizer tensors into the slot the agent hands out (ping-pong: the non-committed one) on a
background thread while the next step computes. The next step's optimizer step waits, in `before_optimizer_step`,
until that snapshot is committed - locally and at its replica holders - so a rank never changes the only copy of
state that exists nowhere else. `restore(step)` reads a snapshot back from the node's slots.

The interval adapts (runtime/adaptive.py): where the copy and the replication do not hide behind compute, every
rank proposes a longer interval and all take the largest.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from phoenixrun.config import WorkerSettings
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol.figures import Figures
from phoenixrun.runtime.adaptive import Sample, choose_interval
from phoenixrun.runtime.agent_link import AgentLink
from phoenixrun.runtime.data import RunPosition
from phoenixrun.runtime.snapshot import (BackgroundCopier, CudaCopier, SlotMap, SnapshotWriter, StateBinding,
                                         local_optimizer, read_slot, restore_into)
from phoenixrun.runtime.state_codec import SizeWatch, encode_state

log = logging.getLogger("phoenixrun.runtime")

ADAPT_PERIOD = 20   # steps between protection-interval decisions


class Quiesced(RuntimeError):
    """Raised inside a step when the master ordered this generation to stop."""


class Protection:
    """One rank's snapshots: written each `every` steps, committed before the next optimizer step, read back."""

    def __init__(self, link: AgentLink, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], position: RunPosition, every: int, peer_shared: bool, dtensor_shared: bool,
                 quiesce_pending: Callable[[], bool]):
        self.link, self.rank = link, rank
        self.model, self.optimizer, self.state, self.position = model, optimizer, state, position
        self.quiesce_pending = quiesce_pending   # () -> bool: the master ordered this generation to stop
        settings = WorkerSettings.from_env()
        self.every = max(1, settings.protect_every or every)
        self.adaptive = settings.adaptive
        # plain state taken from DP peers on recovery (layout_check.verdict); a replacement takes its snapshot's
        self.peer_shared = peer_shared
        # DTensor local shards in the shared region, taken from a mesh peer (layout_check.dtensor_verdict); likewise
        self.dtensor_shared = dtensor_shared
        self._state_watch = SizeWatch()   # says when `state` grows with the run (state_codec.py)
        self._samples: deque[Sample] = deque(maxlen=20)
        self._iteration_t = 0.0
        self._last_iteration_s = 0.0
        self.binding: StateBinding | None = None
        self.writer: SnapshotWriter | None = None
        self.slots: list[SlotMap] = []
        self._restored_meta_cap = 0     # metadata capacity of the snapshot last restored (a floor for the layout)
        self.copier = BackgroundCopier()
        self.awaited_step = -1          # step of the last snapshot submitted: opt.step waits for its commit
        self.stall_s = 0.0
        self._submit_t = 0.0
        stats_dir = settings.stats_dir   # per-step protection figures (benchmarks)
        self._stats = open(os.path.join(stats_dir, f"rank{rank}.jsonl"), "a", buffering=1) if stats_dir else None
        # ZeRO's optimizer step broadcasts parameters after this pre-hook: no rank ends a step before every rank
        # committed its snapshot. Other optimizer steps are local: a one-element all-reduce there does it.
        self._commit_barrier = local_optimizer(optimizer) is optimizer
        self._barrier_t = torch.zeros(1)

    # ---------------------------------------------------------------- before the optimizer step
    def before_optimizer_step(self, current: int) -> None:
        """Wait until the awaited snapshot is committed everywhere (Quiesced if it cannot be)."""
        if self.adaptive and current > 0 and current % ADAPT_PERIOD == 0:
            self._adapt(current)
        if self.awaited_step < 0:
            return
        t0 = time.perf_counter()
        self.copier.wait()                 # the copy reads live tensors: done before they change
        if self.copier.error is not None:
            err, self.copier.error = self.copier.error, None
            raise Quiesced(f"snapshot of step {self.awaited_step} failed: {err}")
        if current < self.awaited_step + self.every - 1:
            return                         # replication may run on until the step before the next snapshot
        with self.link.cv:
            while (self.link.committed_step < self.awaited_step and not self.quiesce_pending()
                   and self.link.commit_error is None and not self.link.closed):
                self.link.cv.wait(0.5)
            ok = self.link.committed_step >= self.awaited_step
            commit_err, self.link.commit_error = self.link.commit_error, None
        if not ok:
            self.stall_s = time.perf_counter() - t0
            raise Quiesced(f"snapshot of step {self.awaited_step} not committed: "
                           f"{commit_err or 'recovery in progress'}")
        if self._commit_barrier:
            # No rank ends this step - and drops its older snapshot by beginning the next - before every rank's
            # S_awaited is committed. Without it, where the optimizer step holds no collective (DDP with a plain
            # optimizer, FSDP2), a rank lost while its replicas were still landing left the survivors no step in
            # common with its holders, and the job fell back to disk (docs/design.md, "Why two slots are
            # enough"). On a CPU tensor: gloo, also beside NCCL, so the training thread waits for the other ranks'
            # commits, never for the device.
            dist.all_reduce(self._barrier_t)
        self.stall_s = time.perf_counter() - t0
        self._record(t0)

    def _record(self, t0: float) -> None:
        c = self.link.last_commit
        if c is not None and c.step == self.awaited_step and c.h2h_s is not None:
            self._samples.append(Sample(self.copier.last_seconds, c.h2h_s, t0 - self._submit_t,
                                        self._last_iteration_s))
        if self._stats is not None:
            self._stats.write(json.dumps({
                "step": self.awaited_step, "d2h_s": self.copier.last_seconds, "h2h_s": c.h2h_s if c else None,
                "stall_s": self.stall_s, "window_s": t0 - self._submit_t,
                "replicated_bytes": c.replicated_bytes if c else None, "slot_bytes": self.writer.total_len if self.writer else None,
                "private_bytes": self.binding.nbytes()[0] if self.binding else None,
                "shared_bytes": self.binding.nbytes()[1] if self.binding else None}) + "\n")

    def _adapt(self, current: int) -> None:
        """Every rank proposes an interval from its own figures; all take the largest (one tiny allreduce)."""
        proposal = torch.tensor([choose_interval(list(self._samples)) if len(self._samples) >= 5 else self.every])
        dist.all_reduce(proposal, op=dist.ReduceOp.MAX)
        every = int(proposal.item())
        if every != self.every:
            log.warning("rank %d: protecting every %d step(s) from step %d (transfer does not hide behind compute)"
                        if every > 1 else "rank %d: protecting every %d step(s) again from step %d",
                        self.rank, every, current)
            self.every = every
            self._samples.clear()
            self.link.send(wm.ProtectionMode(every=every, step=current))

    # ---------------------------------------------------------------- after a step
    def snapshot(self, step: int, compute_s: float | None) -> None:
        """The state after step `step - 1`: encoded here, copied into a slot in the background."""
        now = time.perf_counter()
        self._last_iteration_s = now - self._iteration_t if self._iteration_t else 0.0
        self._iteration_t = now
        if step % self.every:
            return
        binding, writer = self.binding, self.writer
        if binding is None or writer is None or binding.stale():
            binding, writer = self._bind()  # first snapshot, after a restore, or the optimizer state changed
        binding.refresh_volatile()
        slots, link = self.slots, self.link
        # on this thread: the script mutates its state dict next step
        state_json, encode_s = encode_state(self.state)
        warning = self._state_watch.check(len(state_json), encode_s, step)
        if warning is not None:
            log.warning("rank %d: %s", self.rank, warning)
        meta = writer.encode_meta(step, state_json, binding.param_groups(), self.every,
                                  objects_json=json.dumps(self.position.capture()))
        if writer.fit(len(meta)):
            log.info("rank %d: snapshot %d outgrew its layout (metadata %d bytes): re-laid out for %d bytes of "
                     "metadata, %d bytes a slot", self.rank, step, len(meta), writer.meta_cap, writer.total_len)
        meta_cap, nbytes = writer.meta_cap, writer.total_len
        ready = None
        if isinstance(writer.copier, CudaCopier):   # order the D2H copy after this step's optimizer update
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            ready.record()
        compute_t = time.perf_counter() - self._submit_t if self._submit_t else 0.0
        stats = Figures(d2h_s=round(self.copier.last_seconds, 5), stall_s=round(self.stall_s, 5),
                        step_s=round(compute_t, 5), every=self.every, slot_bytes=writer.total_len,
                        compute_s=None if compute_s is None else round(compute_s, 5))
        self._submit_t = time.perf_counter()

        def copy() -> None:
            # the agent hands out the non-committed slot, grown first if this layout needs more room
            grant = link.request(wm.Write(nbytes=nbytes))
            idx = grant.slot
            if slots[idx].path != grant.path or slots[idx].nbytes < nbytes:   # grown: a new file
                writer.copier.release(slots[idx])
                slots[idx] = SlotMap(grant.path, grant.nbytes)
            writer.write_encoded(slots[idx], step, meta, meta_cap, ready)
            link.send(wm.Written(slot=idx, step=step, stats=stats))
        self.awaited_step = step
        self.copier.submit(copy)

    def _bind(self) -> tuple[StateBinding, SnapshotWriter]:
        """A new binding of the live state and its writer (slots allocated at the first): both, also kept."""
        old = self.writer
        self.binding = StateBinding(self.model, self.optimizer, peer_shared=self.peer_shared,
                                    dtensor_shared=self.dtensor_shared)
        # The metadata capacity only grows: what the last layout (or the restored snapshot) needed, else a
        # first guess. The slots themselves grow when a snapshot needs more (the `write` request).
        meta_cap = max(64 * 1024 + 256 * (len(self.binding.private) + len(self.binding.shared)),
                       old.meta_cap if old is not None else 0, self._restored_meta_cap)
        self.writer = SnapshotWriter(self.binding, meta_cap)
        if old is not None and (old.private_len, old.shared_len) != (self.writer.private_len, self.writer.shared_len):
            log.info("rank %d: optimizer state changed: snapshot tensors now %d + %d bytes", self.rank,
                     self.writer.private_len, self.writer.shared_len)
        if not self.slots:
            paths = self.link.request(wm.Alloc(nbytes=self.writer.total_len)).paths
            self.slots = [SlotMap(p) for p in paths]   # each as large as its file (slots grow one at a time)
        return self.binding, self.writer

    # ---------------------------------------------------------------- recovery
    def wait_idle(self) -> None:
        """The background copy is over, its error (a recovery's cause or consequence) dropped."""
        self.copier.wait()
        self.copier.error = None

    def slot_paths(self) -> list[str]:
        """This rank's snapshot slots on its node. A replacement's request waits while its agent fetches their state
        (StateUnavailable: that fetch will not bring it)."""
        return self.link.request(wm.Slots()).paths

    def restore(self, step: int, paths: list[str] | None = None) -> None:
        """Model, optimizer, `state` and the run's position from this node's snapshot of `step` (in `paths`, this
        rank's slots: asked for when not given)."""
        for p in self.slot_paths() if paths is None else paths:
            slot = SlotMap(p)
            found = read_slot(slot, step)
            if found is None:
                continue
            h, meta = found
            restore_into(slot, h, meta, self.model, self.optimizer)
            self._restored_meta_cap = h.meta_cap   # a fresh process starts with the layout the state needed
            self.state.clear()
            self.state.update(meta["extra"])
            self.position.restore(meta.get("objects") or {}, step)
            self.every = meta.get("every", self.every)   # a replacement takes the job's interval
            self.peer_shared = meta.get("peer_shared", True)   # and the job's sharing decisions (all ranks agree)
            self.dtensor_shared = meta.get("dtensor_shared", False)
            self.restarted_at(step)
            return
        raise RuntimeError(f"no intact snapshot of step {step} in this node's memory")

    def restarted_at(self, step: int) -> None:
        """The state now is that of snapshot `step` (restored, or re-partitioned into a new world)."""
        self.binding = None             # optimizer state tensors were replaced: bind again
        self.slots = []
        self.awaited_step = step        # S_step is committed: nothing to wait for beyond it
        self.link.committed_step = max(self.link.committed_step, step)

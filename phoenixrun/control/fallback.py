"""The persistent-checkpoint fallback as a plan for the recovery cycle (control/cycle.py): restart every worker
from the newest complete persistent checkpoint (spares fill the lost slots).

For what in-memory recovery cannot cover: the owner of a shard and all its replica holders lost together, or a
fault class that must not be hot-swapped around. A checkpoint that fails to load (checksum) is never resumed from:
the next older one is tried, each try counted against --max-fallbacks (decide.fallback_attempts,
decide.after_failure)."""
from __future__ import annotations

import logging
import time

from phoenixrun import persist_layout as persist   # torch-free: the master never reaches the DCP writer
from phoenixrun.control.cycle import Cycle, FromCheckpoint, Quiesced, Restored, Resume
from phoenixrun.control.decide import AfterFailure, Recovery
from phoenixrun.control.inflight import Cascade
from phoenixrun.control.jobstate import JobState
from phoenixrun.protocol.events import CheckpointRejected, FallbackDone
from phoenixrun.protocol.reports import RestoreFailed

log = logging.getLogger("phoenixrun.master")


class NoCheckpoint(Exception):
    """Nothing (left) to fall back to."""


def newest_checkpoint(job: JobState) -> int | None:
    """The newest complete persistent checkpoint not known to be bad (None: none, or no --persist-dir)."""
    if job.cfg.persistence.persist_dir is None:
        return None
    return persist.newest_complete(job.cfg.persistence.persist_dir, job.course.layout.world_size, exclude=job.course.bad_checkpoints)


class Fallback:
    kind = Recovery.FALLBACK

    def __init__(self, cycle: Cycle, lost: set[int], reason: str, counted: bool, tries: int):
        self.cycle, self.job = cycle, cycle.job
        self.lost, self.reason, self.counted, self.tries = lost, reason, counted, tries
        self.started = time.time()
        self.step: int | None = None

    def quiesce(self) -> None:
        return None       # every worker restarts: nothing to keep

    def plan(self, quiesced: Quiesced | None, attempt: int) -> FromCheckpoint:
        self.step = newest_checkpoint(self.job)
        if self.step is None:
            raise NoCheckpoint()
        self.cycle.fill(self.lost)
        self.lost.clear()
        return FromCheckpoint(self.step, self.reason, counted=self.counted or attempt > 1)

    def resume(self, quiesced: Quiesced | None, restore: FromCheckpoint, restored: Restored, attempt: int) -> Resume:
        return Resume(FallbackDone(restore_step=restore.step, duration_s=round(time.time() - self.started, 4)),
                      run=False, count=False)

    def failed(self, error: Exception, after: AfterFailure) -> None:
        """A checkpoint whose load failed (its ranks said so) is never tried again."""
        ev = error.event if isinstance(error, Cascade) else None
        if self.step is not None and isinstance(ev, RestoreFailed) and ev.persist_step == self.step:
            self.job.course.bad_checkpoints.add(self.step)
            self.cycle.events.emit(CheckpointRejected(step=self.step, reason=ev.reason),
                                   self.job.course.generation)
        log.warning("fallback to checkpoint step %d interrupted: %s", self.step, error)

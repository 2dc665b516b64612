"""The progress block: where each worker of a node records the step it is in and when that step began, for its
agent's hang watchdog (agents/watchdog.py) - one store per step, no message and no system call.

The agent creates the block once (an anonymous shared-memory file, memfd) and every worker it starts inherits its
file descriptor, named in PHOENIXRUN_PROGRESS_FD; a worker maps it and writes its local rank's record at each step's
start (runtime/api.py). A record is the step (int64) and the CLOCK_MONOTONIC time it began (float64, system-wide
on Linux: the agent reads it against its own clock). An aligned 8-byte store is atomic on the machines torch runs on;
the reader still reads a record twice and takes it only when both reads agree (a record written between the two is
read again on the next look).

Nothing is left behind: the file has no name, and it is freed when the agent and the last worker holding it exit.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping

ENV = "PHOENIXRUN_PROGRESS_FD"
RECORD = struct.Struct("<qd")        # step, monotonic start of the step
SLOTS = 256                          # local ranks a block holds (one page of 16-byte records)
SIZE = SLOTS * RECORD.size


class ProgressBlock:
    """One node's progress records, one per local rank. The agent creates it (`create`), its workers attach
    (`attach`); a record never written reads as None."""

    def __init__(self, fd: int, owner: bool):
        self.fd, self.owner = fd, owner
        self._map = mmap.mmap(fd, SIZE)

    @classmethod
    def create(cls) -> ProgressBlock:
        """The agent's block: a zeroed anonymous shared-memory file, its descriptor not inherited (workers get it
        through `pass_fds`)."""
        fd = os.memfd_create("phoenixrun-progress", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        return cls(fd, owner=True)

    @classmethod
    def attach(cls, env: Mapping[str, str]) -> ProgressBlock | None:
        """A worker's view of its agent's block, or None when it has none (started by hand, by torchrun, or by an
        agent of another version): the watchdog then has the progress messages alone."""
        raw = env.get(ENV)
        if not raw:
            return None
        try:
            return cls(int(raw), owner=False)
        except (ValueError, OSError):
            return None

    def write(self, local_rank: int, step: int, started: float) -> None:
        """Local rank `local_rank` began `step` at `started` (time.monotonic()). No system call: a store into shared
        memory."""
        if 0 <= local_rank < SLOTS:
            RECORD.pack_into(self._map, local_rank * RECORD.size, step, started)

    def clear(self, local_rank: int) -> None:
        """Forget a local rank's record (its process is gone; the next holds nothing of it)."""
        self.write(local_rank, 0, 0.0)

    def read(self, local_rank: int) -> tuple[int, float] | None:
        """(step, monotonic start) of `local_rank`'s current step, or None: never written, or being written now."""
        if not 0 <= local_rank < SLOTS:
            return None
        off = local_rank * RECORD.size
        first = RECORD.unpack_from(self._map, off)
        if first != RECORD.unpack_from(self._map, off) or first[1] <= 0.0:
            return None
        step, started = first
        return int(step), float(started)

    def close(self) -> None:
        self._map.close()
        if self.owner:
            os.close(self.fd)

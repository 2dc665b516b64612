"""Writes this node's committed snapshots to the persistent checkpoint directory, off the training path.

The agent offers every committed (rank, step); the first step past each multiple of `every` is
copied out of its shm slot at once (a few ms: the ping-pong slot is rewritten two snapshots later)
and handed to the node's checkpoint I/O process (persist_worker.py), which writes it as a DCP
checkpoint. Neither the workers nor the agent's own threads wait on the disk. While `backlog`
images wait for the disk, new ones are skipped (the queued older ones still complete); a step
some rank lacks is not complete and is never resumed from.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from phoenixrun.protocol import persist_io as pio
from phoenixrun.protocol.replies import PersistTerms
from phoenixrun.agents.slots import SHM_DIR

log = logging.getLogger("phoenixrun.agent")


@dataclass(frozen=True)
class PersistConfig:
    dir: Path
    every: int          # steps between checkpoints; 0: only on SIGTERM
    keep: int = 2       # complete checkpoints kept on disk
    world_size: int = 1

    @classmethod
    def from_terms(cls, t: PersistTerms | None) -> "PersistConfig | None":
        """The checkpoint writer's settings, from the registration reply's (None: --persist-every is off)."""
        if t is None or not t.dir:
            return None
        return cls(Path(t.dir), t.every, t.keep, t.world_size)


def due(step: int, last: int, every: int) -> bool:
    """Is a committed step the first one past a multiple of `every` since the last checkpoint?"""
    return every > 0 and step // every > last // every and step >= every


class PersistError(Exception):
    pass


def _pipes(proc: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
    """The I/O child's stdin and stdout (it is started with both piped)."""
    if proc.stdin is None or proc.stdout is None:
        raise PersistError("checkpoint I/O process started without its pipes")
    return proc.stdin, proc.stdout


class _IOProcess:
    """The checkpoint I/O child: one request at a time, restarted if it died."""

    def __init__(self, cfg: PersistConfig):
        self.cfg = cfg
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "phoenixrun.agents.persist_worker", str(self.cfg.dir),
                 str(self.cfg.world_size), str(self.cfg.keep)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            self._reply(self.proc)    # ready
        return self.proc

    def _reply(self, proc: subprocess.Popen[str]) -> pio.Answer:
        line = _pipes(proc)[1].readline()
        if not line:
            raise PersistError(f"checkpoint I/O process exited ({proc.wait()})")
        try:
            return pio.decode_answer(json.loads(line))
        except ValueError as e:
            raise PersistError(f"checkpoint I/O process answered {line[:80]!r}: {e}") from None

    def call(self, req: pio.Request) -> pio.Done:
        with self.lock:
            proc = self._ensure()
            try:
                stdin = _pipes(proc)[0]
                stdin.write(json.dumps(req.to_wire()) + "\n")
                stdin.flush()
            except OSError as e:
                raise PersistError(f"checkpoint I/O process gone: {e}") from None
            reply = self._reply(proc)
        if isinstance(reply, pio.Failed):
            raise PersistError(reply.error)
        if not isinstance(reply, pio.Done):
            raise PersistError(f"checkpoint I/O process answered {reply} to {req}")
        return reply

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _pipes(self.proc)[0].close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Persister:
    def __init__(self, cfg: PersistConfig, copy_image: Callable[[int, int, Path], bool], prefix: str,
                 backlog: int = 4):
        self.cfg = cfg
        self.copy_image = copy_image          # (rank, step, file): copy the sealed snapshot there, False if gone
        self.prefix = prefix                  # names of this node's shm hand-over files
        self.backlog = backlog
        self.io = _IOProcess(cfg)
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int, Path]] = []
        self._last: dict[int, int] = {}       # rank -> last step taken for writing
        self._busy = False
        self._stop = False
        self.ready = threading.Event()        # the I/O process is up (or failed to start)
        self._thread = threading.Thread(target=self._run, daemon=True, name="persister")
        self._thread.start()

    def offer(self, rank: int, step: int) -> None:
        with self._cv:
            if not due(step, self._last.get(rank, 0), self.cfg.every):
                return
            self._last[rank] = step
            if len(self._queue) >= self.backlog:
                # the disk is slower than the interval: skip this one, finish the queued (older) ones
                log.warning("checkpoint of rank %d step %d skipped: writes lag behind --persist-every", rank, step)
                return
        handover = self._handover(rank, step)
        if handover is None:
            return
        with self._cv:
            self._queue.append((rank, step, handover))
            self._cv.notify_all()

    def reset(self, step: int) -> None:
        """The timeline continues from `step` (after a restore): count the next checkpoint from there."""
        with self._cv:
            for _, s, path in self._queue:
                if s > step:
                    path.unlink(missing_ok=True)
            self._queue = [q for q in self._queue if q[1] <= step]
            self._last = {r: min(s, step) for r, s in self._last.items()}

    def write_now(self, items: list[tuple[int, int]]) -> None:
        """Synchronously persist (rank, step) pairs (SIGTERM: whatever is committed, before exiting)."""
        self.drain()
        for rank, step in items:
            handover = self._handover(rank, step)
            if handover is not None:
                self._write(rank, step, handover)

    def read(self, step: int, rank: int) -> bytearray:
        """The slot image of (step, rank) from disk, checksum-verified by the I/O process."""
        out = SHM_DIR / f"{self.prefix}-load-r{rank}"
        try:
            self.io.call(pio.ReadImage(rank, step, str(out)))
            return bytearray(out.read_bytes())
        finally:
            out.unlink(missing_ok=True)

    def drain(self, timeout: float = 60.0) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            for _, _, path in self._queue:
                path.unlink(missing_ok=True)
            self._queue.clear()
            self._cv.notify_all()
        self.io.close()

    def _handover(self, rank: int, step: int) -> Path | None:
        path = SHM_DIR / f"{self.prefix}-persist-r{rank}-{step}"
        if not self.copy_image(rank, step, path):
            log.info("checkpoint of rank %d step %d skipped: the snapshot was already replaced", rank, step)
            return None
        return path

    def _run(self) -> None:
        try:
            self.io.start()     # its imports take seconds: pay them while idle, not at the first checkpoint
        except (PersistError, OSError) as e:
            log.error("checkpoint I/O process did not start: %s", e)
        self.ready.set()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                rank, step, path = self._queue.pop(0)
                self._busy = True
            try:
                self._write(rank, step, path)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, rank: int, step: int, path: Path) -> None:
        try:
            self.io.call(pio.WriteImage(rank, str(path)))
        except (PersistError, OSError) as e:
            log.warning("checkpoint of rank %d step %d not written: %s", rank, step, e)
        finally:
            path.unlink(missing_ok=True)

"""Host memory the agent owns: each local rank's ping-pong snapshot slots (shared memory the
worker writes into) and the replica store for other nodes' ranks.

The agent, not the worker, decides which slot is committed. A slot becomes invalid the moment
a writer is handed it and valid again only once the write is complete (and, for local slots,
replicated), so a crash at any point leaves the previously committed snapshot intact.
"""
from __future__ import annotations

import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from phoenixrun.slot_format import SlotHeader, crc_private, crc_shared

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class SlotError(Exception):
    pass


def _alive(pid: int) -> bool:
    """A zombie is dead: an agent SIGKILLed under a parent that has not reaped it yet (its slot files
    stayed, 23 MB after 20 kills, when pid_exists counted zombies as alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def remove_orphans(host: str) -> list[Path]:
    """Delete the shm files of this host's agents that died without cleaning up (SIGKILL, OOM):
    agent node ids are `<host>-<pid>-<tag>`, so a file whose agent pid is gone is garbage."""
    removed = []
    pattern = re.compile(rf"^phoenixrun-{re.escape(host)}-(\d+)-[0-9a-f]+-")
    for path in SHM_DIR.glob(f"phoenixrun-{host}-*"):
        m = pattern.match(path.name)
        if m and not _alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _prefault(mm: mmap.mmap) -> None:
    # first touch of fresh pages is ~3x slower than a copy into touched ones: do it now, not on step 1
    page = mmap.PAGESIZE
    zero = b"\0"
    for off in range(0, len(mm), page):
        mm[off:off + 1] = zero


@dataclass
class _RankSlots:
    paths: list[Path]
    maps: list[mmap.mmap]
    steps: list[int | None] = field(default_factory=lambda: [None, None])
    committed: int | None = None      # index of the committed slot
    writing: int | None = None


class LocalSlots:
    """Ping-pong snapshot slots per local rank, in /dev/shm files the workers map."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.frozen = False
        self._lock = threading.Lock()
        self._ranks: dict[int, _RankSlots] = {}

    def allocate(self, rank: int, nbytes: int) -> list[str]:
        with self._lock:
            rs = self._ranks.get(rank)
            if rs is not None and len(rs.maps[0]) == nbytes:
                return [str(p) for p in rs.paths]
            if rs is not None:
                self._drop(rank)
            paths = [SHM_DIR / f"{self.prefix}-r{rank}-s{i}" for i in (0, 1)]
            maps = [_map(p, nbytes, create=True) for p in paths]
            for mm in maps:
                _prefault(mm)
            self._ranks[rank] = _RankSlots(paths, maps)
            return [str(p) for p in paths]

    def paths(self, rank: int) -> list[str]:
        with self._lock:
            return [str(p) for p in self._get(rank).paths]

    def begin_write(self, rank: int) -> int:
        """Hand the writer the non-committed slot; it is invalid from now until commit."""
        with self._lock:
            if self.frozen:
                raise SlotError("snapshots are frozen for recovery")
            rs = self._get(rank)
            idx = 0 if rs.committed is None else 1 - rs.committed
            rs.steps[idx] = None
            rs.writing = idx
            return idx

    def finish_write(self, rank: int, idx: int, step: int) -> SlotHeader:
        """Seal a written slot: checksum into its header. Not committed until `commit`."""
        with self._lock:
            rs = self._get(rank)
            if rs.writing != idx:
                raise SlotError(f"rank {rank}: slot {idx} was not handed out for writing")
            mm = rs.maps[idx]
            h = SlotHeader.unpack(mm)
            if h.step != step:
                raise SlotError(f"rank {rank}: slot {idx} holds step {h.step}, worker said {step}")
        h = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len,
                       crc_private(mm, h), crc_shared(mm, h))
        mm[:64] = h.pack()
        return h

    def commit(self, rank: int, idx: int, step: int) -> None:
        with self._lock:
            rs = self._get(rank)
            if rs.writing == idx:
                rs.writing = None
            rs.steps[idx] = step
            rs.committed = idx

    def view(self, rank: int, idx: int) -> mmap.mmap:
        return self._get(rank).maps[idx]

    def slot_of(self, rank: int, step: int) -> int | None:
        rs = self._ranks.get(rank)
        if rs is None:
            return None
        for i in (0, 1):
            if rs.steps[i] == step:
                return i
        return None

    def copy_snapshot(self, rank: int, step: int, dest: Path) -> bool:
        """Copy the sealed S_step of `rank` into the file `dest` (for the persister): one memcpy, done
        without holding the lock. False (and no file) if the snapshot is gone or a writer was handed
        the slot during the copy."""
        with self._lock:
            rs = self._ranks.get(rank)
            idx = None if rs is None else next((i for i in (0, 1) if rs.steps[i] == step), None)
            if idx is None:
                return False
            mm = rs.maps[idx]
        try:
            n = SlotHeader.unpack(mm).total_len
            out = _map(dest, n, create=True)
            try:
                out[:n] = mm[:n]
            finally:
                out.close()
        except ValueError:      # unmapped meanwhile (slots cleared for a restart)
            dest.unlink(missing_ok=True)
            return False
        with self._lock:
            if self._ranks.get(rank) is rs and rs.steps[idx] == step:
                return True
        dest.unlink(missing_ok=True)
        return False

    def install_image(self, rank: int, image: bytearray) -> None:
        """Make a full sealed slot image (read from a persistent checkpoint) the committed snapshot."""
        h = SlotHeader.unpack(image)
        self.install(rank, bytes(memoryview(image)[:h.replicated_len]),
                     bytes(memoryview(image)[h.shared_off:h.shared_off + h.shared_len]), h.step)

    def available(self) -> dict[int, list[int]]:
        with self._lock:
            return {r: sorted(s for s in rs.steps if s is not None) for r, rs in self._ranks.items()}

    def committed_step(self, rank: int) -> int | None:
        rs = self._ranks.get(rank)
        return None if rs is None or rs.committed is None else rs.steps[rs.committed]

    def restore_point(self, rank: int, step: int) -> int:
        """After recovery the timeline continues from `step`: that slot is committed, the other is stale."""
        with self._lock:
            rs = self._get(rank)
            for i in (0, 1):
                if rs.steps[i] == step:
                    rs.committed = i
                    rs.steps[1 - i] = None
                    rs.writing = None
                    return i
        raise SlotError(f"rank {rank} has no snapshot of step {step}")

    def install(self, rank: int, replicated: bytes, shared: bytes, step: int) -> None:
        """Assemble a full snapshot for a rank whose memory was lost (spare taking its slot)."""
        h = SlotHeader.unpack(replicated)
        if h.step != step:
            raise SlotError(f"replica of rank {rank} is step {h.step}, expected {step}")
        if crc_private(replicated, h) != h.crc_private:
            raise SlotError(f"replica of rank {rank} step {step} fails its checksum")
        if len(shared) != h.shared_len:
            raise SlotError(f"rank {rank}: parameters from the DP peer are {len(shared)} bytes, expected {h.shared_len}")
        self.allocate(rank, h.total_len)
        with self._lock:
            rs = self._get(rank)
            mm = rs.maps[0]
            mm[:h.replicated_len] = replicated
            mm[h.shared_off:h.shared_off + h.shared_len] = shared
            h2 = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, h.crc_private,
                            crc_shared(mm, h))
            mm[:64] = h2.pack()
            rs.steps = [step, None]
            rs.committed, rs.writing = 0, None

    def clear(self) -> None:
        with self._lock:
            for r in list(self._ranks):
                self._drop(r)

    def _get(self, rank: int) -> _RankSlots:
        rs = self._ranks.get(rank)
        if rs is None:
            raise SlotError(f"no snapshot slots allocated for rank {rank}")
        return rs

    def _drop(self, rank: int) -> None:
        rs = self._ranks.pop(rank)
        for mm, p in zip(rs.maps, rs.paths):
            mm.close()
            p.unlink(missing_ok=True)


class ReplicaStore:
    """Ping-pong receive buffers per source rank (another node's private state)."""

    def __init__(self):
        self.frozen = False
        self._lock = threading.Lock()
        self._bufs: dict[int, list[bytearray | None]] = {}
        self._steps: dict[int, list[int | None]] = {}

    def put(self, rank: int, step: int, data: bytearray) -> None:
        """Store a received replica (the buffer is kept as is, not copied)."""
        h = SlotHeader.unpack(data)
        if h.step != step or len(data) != h.replicated_len:
            raise SlotError(f"replica of rank {rank}: header says step {h.step}/{h.replicated_len} bytes")
        with self._lock:
            if self.frozen:
                raise SlotError("replicas are frozen for recovery")
            steps = self._steps.setdefault(rank, [None, None])
            bufs = self._bufs.setdefault(rank, [None, None])
            newest = max((i for i in (0, 1) if steps[i] is not None), key=lambda i: steps[i], default=None)
            idx = 0 if newest is None else 1 - newest
            steps[idx] = None  # invalid while being written
        if crc_private(data, h) != h.crc_private:
            raise SlotError(f"replica of rank {rank} step {step} fails its checksum")
        with self._lock:
            bufs[idx] = data if isinstance(data, bytearray) else bytearray(data)
            steps[idx] = step

    def get(self, rank: int, step: int) -> bytes:
        with self._lock:
            for i, s in enumerate(self._steps.get(rank, [])):
                if s == step:
                    return bytes(self._bufs[rank][i])
        raise SlotError(f"no replica of rank {rank} at step {step}")

    def available(self) -> dict[int, list[int]]:
        with self._lock:
            return {r: sorted(s for s in st if s is not None) for r, st in self._steps.items()}

    def restore_point(self, step: int) -> None:
        """Replicas newer than the restore step belong to an abandoned timeline."""
        with self._lock:
            for st in self._steps.values():
                for i in (0, 1):
                    if st[i] is not None and st[i] > step:
                        st[i] = None

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(b) for bs in self._bufs.values() for b in bs if b is not None)

"""Host memory the agent owns: each local rank's ping-pong snapshot slots (shared memory the
worker writes into) and the replica store for other nodes' ranks.

The agent, not the worker, decides which slot is committed. A slot becomes invalid the moment
a writer is handed it and valid again only once the write is complete (and, for local slots,
replicated), so a crash at any point leaves the previously committed snapshot intact.

Slots grow (a snapshot that no longer fits: state that grows every step, optimizer state created late): the
writer asks for the size it needs with `begin_write`, and only the slot handed out for writing is replaced
by a larger file - the committed one is never touched, so it stays restorable until a snapshot in the new
layout is committed; the other slot grows when it is next written. Replicas need nothing: each received
replica is kept in a buffer of its own size.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from phoenixrun.agents.fetch_gate import FetchGate
from phoenixrun.slot_format import SlotHeader, checksum, crc_private, crc_shared

log = logging.getLogger("phoenixrun.agent")

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class SlotError(Exception):
    pass


class IntegrityError(SlotError):
    """Fetched state does not match the checksum its owner recorded: never restored from."""


class FrozenError(SlotError):
    """Snapshots or replicas are frozen while a recovery reads them: a passing state, not a fault. A peer answers
    a put refused for it as busy (agents/peer.py `retry_later`), and the sender tries again."""

    retry_later = True


class SlotSpaceError(SlotError):
    """Snapshot memory cannot be created or grown on this host (shared memory full, a file-size limit)."""
def _alive(pid: int) -> bool:
    """A zombie is dead: an agent SIGKILLed under a parent that has not reaped it yet (its slot files
    stayed, 23 MB after 20 kills, when pid_exists counted zombies as alive)."""
    try:
        status: str = psutil.Process(pid).status()   # psutil has no stubs here: its values are Any
        return bool(status != psutil.STATUS_ZOMBIE)
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
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: past the size of a tmpfs, ftruncate still succeeds (sparse file) and
                # the first write into the mapping kills the writer with SIGBUS. posix_fallocate says ENOSPC.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL) and os.fstat(fd).st_size == size:
                    pass      # a filesystem without fallocate: the sparse file will have to do
                else:
                    os.close(fd)
                    fd = -1
                    path.unlink(missing_ok=True)
                    raise SlotSpaceError(_space_message(path, size, e)) from None
        return mmap.mmap(fd, size)
    finally:
        if fd >= 0:
            os.close(fd)


def _space_message(path: Path, size: int, e: OSError) -> str:
    try:
        st = os.statvfs(path.parent)
        room = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
    except OSError:
        room = "free space unknown"
    return (f"cannot allocate {size} bytes of snapshot memory in {path.parent} ({e.strerror}; {room}). A rank's "
            f"snapshot holds its model, optimizer state and the state dict given to phoenixrun.protect(); it "
            f"grew past what this host can hold. Give {path.parent} more room (e.g. mount -o remount,size=... "
            f"/dev/shm; check `ulimit -f`), keep the state dict small (it is snapshotted every step), or run "
            f"fewer ranks per node")


def _release(mm: mmap.mmap, path: Path) -> None:
    """Drop a slot file (replaced by a larger one, or the rank's slots cleared): a worker may still map it and a
    transfer may still hold a view of it, so unlink it and close it only if nothing else holds it."""
    path.unlink(missing_ok=True)
    try:
        mm.close()
    except BufferError:   # a view of it is still alive (a transfer finishing): freed with the last view
        pass


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
    grown: int = 0                    # slot files replaced by larger ones (names the next one)


@dataclass(frozen=True)
class Replica:
    """A rank's replicated prefix (header, metadata, private state) that passed its own checksum: made only by
    `verify_replica`."""
    rank: int
    step: int
    header: SlotHeader
    data: bytes


@dataclass(frozen=True)
class Params:
    """A shared region (the parameters a data-parallel peer holds too) whose bytes passed the checksum a lost rank
    recorded: made only by `verify_params`. Another lost rank that recorded the same length and checksum with the
    same algorithm takes the same bytes without a second fetch or pass (the second rank of a DDP node)."""
    data: bytes
    algorithm: str
    crc: int

    def fits(self, replica: Replica) -> bool:
        h = replica.header
        return (len(self.data), self.algorithm, self.crc) == (h.shared_len, h.checksum, h.crc_shared)


def verify_params(replica: Replica, shared: bytes) -> Params:
    """The parameters fetched from a peer for `replica`'s rank, once they are the bytes that rank sealed
    (IntegrityError otherwise: the caller may try another peer)."""
    rank, step, h = replica.rank, replica.step, replica.header
    if len(shared) != h.shared_len:
        raise IntegrityError(f"rank {rank}: parameters from the DP peer are {len(shared)} bytes, expected "
                             f"{h.shared_len}")
    # The replica's header carries the checksum the lost rank itself sealed over its shared region: the peer's
    # bytes must be exactly those. Equal length is no evidence (a pipeline stage or an FSDP shard of another
    # rank has the same size and different bytes): a mismatch is a refusal, never a restore.
    got = checksum(shared, h.checksum)
    if got != h.crc_shared:
        raise IntegrityError(
            f"rank {rank} step {step}: the parameters fetched from its DP peer do not match the checksum rank "
            f"{rank} recorded ({h.checksum} {got:#010x}, recorded {h.crc_shared:#010x}): that peer does not hold the "
            "same replicated state (not a plain DDP replica of this rank); refusing to restore from it")
    return Params(shared, h.checksum, got)


def verify_replica(rank: int, replicated: bytes, step: int) -> Replica:
    """The replica of `rank` at `step` as fetched from a holder, checked against the checksum its rank sealed
    (IntegrityError: not those bytes; SlotError: another step)."""
    h = SlotHeader.unpack(replicated)
    if h.step != step:
        raise SlotError(f"replica of rank {rank} is step {h.step}, expected {step}")
    if len(replicated) != h.replicated_len or crc_private(replicated, h) != h.crc_private:
        raise IntegrityError(f"replica of rank {rank} step {step} fails its checksum")
    return Replica(rank, step, h, replicated)


class LocalSlots:
    """Ping-pong snapshot slots per local rank, in /dev/shm files the workers map."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.frozen = False
        self._lock = threading.Lock()
        self._ranks: dict[int, _RankSlots] = {}
        self.fetching = FetchGate()   # ranks a restore is fetching: their workers' `slots` requests wait for it

    def allocate(self, rank: int, nbytes: int) -> list[str]:
        """Both slots of `rank`, at least `nbytes` each - except a committed slot, which is never replaced
        (it grows when it is next written, see `begin_write`). SlotSpaceError: no room on this host."""
        with self._lock:
            rs = self._ranks.get(rank)
            if rs is None:
                paths = [SHM_DIR / f"{self.prefix}-r{rank}-s{i}" for i in (0, 1)]
                maps = []
                try:
                    for p in paths:
                        maps.append(_map(p, nbytes, create=True))
                except SlotError:
                    for mm, p in zip(maps, paths):
                        _release(mm, p)
                    raise
                for mm in maps:
                    _prefault(mm)
                self._ranks[rank] = _RankSlots(paths, maps)
                return [str(p) for p in paths]
            small = [i for i in (0, 1) if len(rs.maps[i]) < nbytes and rs.committed != i]
        for i in small:
            self._grow(rank, rs, i, nbytes)
        return self.paths(rank)

    def _grow(self, rank: int, rs: _RankSlots, idx: int, nbytes: int, only_if_small: bool = False) -> None:
        """Replace slot `idx` (holding no committed snapshot) by a file of `nbytes`. Created and pre-faulted
        without the lock (heartbeats read the inventory meanwhile); the slot is invalid throughout.
        only_if_small: a growth ahead of need (`fill`), dropped if meanwhile the slot grew or was handed out:
        a writer may hold that slot's path by then."""
        with self._lock:
            rs.grown += 1
            rs.steps[idx] = None
            path = SHM_DIR / f"{self.prefix}-r{rank}-s{idx}-g{rs.grown}"
        mm = _map(path, nbytes, create=True)        # SlotSpaceError: the old, smaller slot stays as it was
        _prefault(mm)
        with self._lock:
            if only_if_small and (len(rs.maps[idx]) >= nbytes or rs.writing == idx):
                _release(mm, path)
                return
            if self._ranks.get(rank) is not rs or rs.committed == idx:   # cleared, or restored meanwhile
                _release(mm, path)
                raise SlotError(f"rank {rank}: slot {idx} changed hands while it grew")
            old = rs.maps[idx], rs.paths[idx]
            rs.maps[idx], rs.paths[idx] = mm, path
        _release(*old)

    def forget(self, rank: int) -> None:
        """Drop a rank's slots, if any (its state is about to be installed whole, from its replica)."""
        with self._lock:
            if rank in self._ranks:
                self._drop(rank)

    def paths(self, rank: int) -> list[str]:
        with self._lock:
            return [str(p) for p in self._get(rank).paths]

    def begin_write(self, rank: int, nbytes: int = 0) -> int:
        """Hand the writer the non-committed slot, at least `nbytes` large (a larger layout: that slot is
        replaced by a larger file, see `path`); it is invalid from now until commit. The committed slot is
        never touched. SlotSpaceError: the slot cannot grow on this host."""
        with self._lock:
            if self.frozen:
                raise FrozenError("snapshots are frozen for recovery")
            rs = self._get(rank)
            idx = 0 if rs.committed is None else 1 - rs.committed
            rs.steps[idx] = None
            rs.writing = idx
            if len(rs.maps[idx]) >= nbytes:
                return idx
        self._grow(rank, rs, idx, nbytes)
        return idx

    def path(self, rank: int, idx: int) -> tuple[str, int]:
        """The file of slot `idx` and its size (it changes when the slot grows: the worker maps it anew)."""
        with self._lock:
            rs = self._get(rank)
            return str(rs.paths[idx]), len(rs.maps[idx])

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
                       crc_private(mm, h), crc_shared(mm, h), h.checksum)
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
            if rs is None or idx is None:
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
        replica = verify_replica(rank, replicated, step)
        self.install_replica(replica, verify_params(replica, shared))

    def install_replica(self, replica: Replica, params: Params) -> None:
        """Install a verified replica with its verified parameters as the rank's committed snapshot (slot 0). Slot 1
        is a one-page placeholder until `fill` or the rank's first write grows it: a replacement's fetch is the
        recovery's critical path, and allocating and pre-faulting a second slot of the snapshot's size on it cost
        ~22 ms a rank at d256 (25 MB: fallocate 10 ms, pre-fault 12 ms, measured here on an idle machine)."""
        rank, step, h, replicated = replica.rank, replica.step, replica.header, replica.data
        if not params.fits(replica):
            raise IntegrityError(f"rank {rank} step {step}: the parameters given are not the ones it recorded")
        self.forget(rank)    # its files are about to be made anew under the same names
        paths = [SHM_DIR / f"{self.prefix}-r{rank}-s{i}" for i in (0, 1)]
        mm = _map(paths[0], h.total_len, create=True)   # no pre-fault: the copy below touches every page it needs
        try:
            spare = _map(paths[1], mmap.PAGESIZE, create=True)
        except SlotError:
            _release(mm, paths[0])
            raise
        mm[:h.replicated_len] = replicated
        mm[h.shared_off:h.shared_off + h.shared_len] = params.data
        with self._lock:
            self._ranks[rank] = _RankSlots(paths, [mm, spare], steps=[step, None], committed=0)

    def fill(self, rank: int) -> None:
        """Grow `rank`'s other slot to its committed one's size, off the recovery's critical path (after the
        fetch). Leaves it alone once someone else grew it or it was handed out for writing."""
        with self._lock:
            rs = self._ranks.get(rank)
            if rs is None or rs.committed is None:
                return
            idx, nbytes = 1 - rs.committed, len(rs.maps[rs.committed])
            if len(rs.maps[idx]) >= nbytes or rs.writing == idx:
                return
        try:
            self._grow(rank, rs, idx, nbytes, only_if_small=True)
        except SlotError as e:      # no room: the rank's first write says so, as a fault of its own
            log.info("rank %d: its second snapshot slot was not grown ahead: %s", rank, e)

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
            _release(mm, p)   # a peer's restore may still be sending from it (BufferError on close)


class ReplicaStore:
    """Ping-pong receive buffers per source rank (another node's private state).

    A replica is received straight into the buffer it will live in (`receive_buffer`): the older of the rank's
    two buffers, reused when the size is unchanged - a fresh multi-MB buffer every step cost its page faults and
    zero-fill on top of the copy (benchmarks/replication_cpu.py). As for local slots, that buffer is invalid from the
    moment it is handed out until `put` has checked the bytes; the newer replica is never touched."""

    def __init__(self) -> None:
        self.frozen = False
        self._lock = threading.Lock()
        self._bufs: dict[int, list[bytearray | None]] = {}
        self._steps: dict[int, list[int | None]] = {}

    def _older(self, rank: int) -> tuple[list[int | None], list[bytearray | None], int]:
        """(steps, buffers, index of the buffer the next replica of `rank` goes to: never the newest). Locked."""
        if self.frozen:
            raise FrozenError("replicas are frozen for recovery")
        steps = self._steps.setdefault(rank, [None, None])
        bufs = self._bufs.setdefault(rank, [None, None])
        held = [(s, i) for i, s in enumerate(steps) if s is not None]
        newest = max(held, key=lambda si: si[0], default=None)
        return steps, bufs, 0 if newest is None else 1 - newest[1]

    def receive_buffer(self, rank: int, nbytes: int) -> bytearray | None:
        """The buffer to receive the next replica of `rank` into, if the older one has exactly `nbytes`
        (None: the caller receives into a new one). Invalid from now on, and lent: taken out of the store until
        `put` hands it back, so that no second receive of the same rank (a sender the master has replaced, still
        sending) can write into it too."""
        with self._lock:
            steps, bufs, idx = self._older(rank)
            buf = bufs[idx]
            if buf is None or len(buf) != nbytes:
                return None
            steps[idx], bufs[idx] = None, None
            return buf

    def put(self, rank: int, step: int, data: bytearray) -> None:
        """Store a received replica: kept as is, not copied (`data` may be the buffer `receive_buffer` gave)."""
        h = SlotHeader.unpack(data)
        if h.step != step or len(data) != h.replicated_len:
            raise SlotError(f"replica of rank {rank}: header says step {h.step}/{h.replicated_len} bytes")
        with self._lock:
            steps, bufs, idx = self._older(rank)
            steps[idx] = None  # invalid while being written
        if crc_private(data, h) != h.crc_private:
            raise SlotError(f"replica of rank {rank} step {step} fails its checksum")
        with self._lock:
            bufs[idx] = data if isinstance(data, bytearray) else bytearray(data)
            steps[idx] = step

    def _find(self, rank: int, step: int) -> bytearray | None:
        """The buffer holding the replica of `rank` at `step` (None: not held). Locked."""
        steps = self._steps.get(rank, [])
        return next((self._bufs[rank][i] for i, s in enumerate(steps) if s == step), None)

    def get(self, rank: int, step: int) -> bytes:
        with self._lock:     # copied under the lock: no receive can reuse the buffer meanwhile
            buf = self._find(rank, step)
            if buf is not None:
                return bytes(buf)
        raise SlotError(f"no replica of rank {rank} at step {step}")

    def held(self, rank: int, step: int) -> bytearray | None:
        """The buffer that holds the replica of `rank` at `step` itself, not a copy (None: not held). Read it only
        while no replica of `rank` can arrive: the next one but one is received into it."""
        with self._lock:
            return self._find(rank, step)

    def available(self) -> dict[int, list[int]]:
        with self._lock:
            return {r: sorted(s for s in st if s is not None) for r, st in self._steps.items()}

    def restore_point(self, step: int) -> None:
        """Replicas newer than the restore step belong to an abandoned timeline."""
        with self._lock:
            for st in self._steps.values():
                for i in (0, 1):
                    s = st[i]
                    if s is not None and s > step:
                        st[i] = None

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(b) for bs in self._bufs.values() for b in bs if b is not None)

    def clear(self) -> None:
        """Drop every replica (a shrink or grow renumbered the ranks they are of)."""
        with self._lock:
            self._bufs.clear()
            self._steps.clear()

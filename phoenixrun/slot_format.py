"""Byte layout of one snapshot slot, shared by the worker (writer) and the agent (owner).

    [0, 64)                      header (8 x int64, below)
    [64, 64+meta_cap)            metadata JSON (step, tensor layout, param groups, extra state)
    [private_off, +private_len)  rank-private state: optimizer shard, RNG; replicated to peers
    [shared_off, +shared_len)    DP-shared state: parameters (and a replicated optimizer);
                                 never replicated, any DP peer with the same (tp, pp) has it

The replicated part is the prefix [0, private_off + private_len): header, metadata and
private state travel together in one contiguous copy.

Every slot describes itself: its header names its own metadata capacity and region lengths, so the two
ping-pong slots of a rank (and the replicas of them) may have different layouts. That is how a snapshot
grows: when the state no longer fits, the writer picks a larger layout (`grown_capacity`: geometric
headroom, so growing state re-lays out O(log size) times, not every step), and the agent enlarges the
slot it hands out for writing - never the committed one, which stays restorable until a snapshot in the
new layout is committed (docs/api.md, "Snapshots that grow").

The magic names the checksum algorithm: PHXSNAP2 slots carry CRC32C (hardware, `crc32c` package:
0.6 ms per 13 MB here against zlib CRC32's 3.2 ms, docs/benchmarks.md), PHXSNAP1 slots (written before)
carry zlib CRC32 and are still verified with it. A slot is never checked with the other algorithm.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import crc32c as _crc32c

if TYPE_CHECKING:
    from typing_extensions import Buffer

# checksum name -> incremental function f(data, value) -> int
CHECKSUMS = {"crc32": zlib.crc32, "crc32c": _crc32c.crc32c}
CHECKSUM = "crc32c"                           # what new slots carry
MAGICS = {b"PHXSNAP1": "crc32", b"PHXSNAP2": "crc32c"}
MAGIC_OF = {name: magic for magic, name in MAGICS.items()}
MAGIC = MAGIC_OF[CHECKSUM]
HEADER = struct.Struct("<8s7q")  # magic, step, meta_cap, meta_len, private_len, shared_len, crc_private, crc_shared
HEADER_SIZE = 64
ALIGN = 64
assert HEADER.size == HEADER_SIZE


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def grown_capacity(current: int, needed: int) -> int:
    """The capacity to re-lay out to when `needed` bytes no longer fit in `current`: doubled until it fits
    (at least ALIGN), so a region that keeps growing is re-laid out a logarithmic number of times."""
    if needed < 0 or current < 0:
        raise ValueError(f"capacities are non-negative (current {current}, needed {needed})")
    cap = max(current, ALIGN)
    while cap < needed:
        cap *= 2
    return cap


def slot_bytes(meta_cap: int, private_len: int, shared_len: int) -> int:
    """Size of a slot laid out for these region sizes."""
    return SlotHeader(0, meta_cap, 0, private_len, shared_len).total_len


@dataclass(frozen=True)
class SlotHeader:
    step: int
    meta_cap: int
    meta_len: int
    private_len: int
    shared_len: int
    crc_private: int = 0
    crc_shared: int = 0
    checksum: str = CHECKSUM       # the algorithm of crc_private / crc_shared (the magic records it)

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"unknown snapshot checksum {self.checksum!r} (this phoenixrun knows "
                             f"{', '.join(sorted(CHECKSUMS))}): the snapshot was written by another phoenixrun "
                             "version; restore it with that version")

    @property
    def private_off(self) -> int:
        return HEADER_SIZE + _align(self.meta_cap)

    @property
    def shared_off(self) -> int:
        return self.private_off + _align(self.private_len)

    @property
    def replicated_len(self) -> int:
        return self.private_off + self.private_len

    @property
    def total_len(self) -> int:
        return self.shared_off + _align(self.shared_len)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC_OF[self.checksum], self.step, self.meta_cap, self.meta_len, self.private_len,
                           self.shared_len, self.crc_private, self.crc_shared)

    @classmethod
    def unpack(cls, buf: Buffer) -> "SlotHeader":
        magic, step, meta_cap, meta_len, private_len, shared_len, crc_p, crc_s = HEADER.unpack_from(buf, 0)
        if magic not in MAGICS:
            if bytes(magic[:7]) == b"PHXSNAP":
                raise ValueError(f"snapshot slot format {bytes(magic)!r} is not one this phoenixrun reads "
                                 f"({', '.join(m.decode() for m in MAGICS)}): it was written by another phoenixrun "
                                 "version; restore it with that version")
            raise ValueError("not a phoenixrun snapshot slot (bad magic)")
        return cls(step, meta_cap, meta_len, private_len, shared_len, crc_p, crc_s, checksum=MAGICS[magic])


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a slot: its bytes at `offset` within its region (private or shared), in the
    metadata as a JSON list. `dtype` is the torch dtype's name (str(torch.float32) == "torch.float32");
    runtime/snapshot.py maps it back to the dtype, so this record stays torch-free."""
    name: str            # "model/<state_dict name>", "optim/<param idx>/<key>", "rng/cpu", "rng/cuda<i>"
    dtype: str
    shape: tuple[int, ...]
    offset: int          # within its region
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, j: list[Any]) -> "Entry":
        return cls(j[0], j[1], tuple(j[2]), j[3], j[4])


def checksum(data: Buffer, algorithm: str = CHECKSUM, value: int = 0) -> int:
    """`algorithm` (a CHECKSUMS name) over `data` (any buffer), continuing from `value`."""
    return CHECKSUMS[algorithm](data, value)


def crc_private(buf: Buffer, h: SlotHeader) -> int:
    """Checksum over metadata + private state (what replication must carry intact), in the header's algorithm."""
    mv = memoryview(buf)
    c = checksum(mv[HEADER_SIZE:HEADER_SIZE + h.meta_len], h.checksum)
    return checksum(mv[h.private_off:h.private_off + h.private_len], h.checksum, c)


def crc_shared(buf: Buffer, h: SlotHeader) -> int:
    mv = memoryview(buf)
    return checksum(mv[h.shared_off:h.shared_off + h.shared_len], h.checksum)

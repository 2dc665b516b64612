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
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"PHXSNAP1"
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
        return HEADER.pack(MAGIC, self.step, self.meta_cap, self.meta_len, self.private_len,
                           self.shared_len, self.crc_private, self.crc_shared)

    @classmethod
    def unpack(cls, buf) -> "SlotHeader":
        magic, *fields = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ValueError("not a phoenixrun snapshot slot (bad magic)")
        return cls(*fields)


def crc_private(buf, h: SlotHeader) -> int:
    """Checksum over metadata + private state (what replication must carry intact)."""
    mv = memoryview(buf)
    c = zlib.crc32(mv[HEADER_SIZE:HEADER_SIZE + h.meta_len])
    return zlib.crc32(mv[h.private_off:h.private_off + h.private_len], c)


def crc_shared(buf, h: SlotHeader) -> int:
    mv = memoryview(buf)
    return zlib.crc32(mv[h.shared_off:h.shared_off + h.shared_len])

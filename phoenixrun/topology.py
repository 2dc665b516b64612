"""Rank coordinates and replica placement: pure functions, no processes.

Rank order follows Megatron: tp fastest, then dp, then pp. Node slots host
`nproc_per_node` consecutive ranks. A shard's logical id is its (pp, tp, dp)
coordinate; placement is keyed by logical id and node slot, never by a
physical host, so a spare that adopts a slot inherits its role unchanged.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Mapping


@dataclass(frozen=True)
class Layout:
    nnodes: int
    nproc_per_node: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.tp < 1 or self.pp < 1:
            raise ValueError("nnodes, nproc-per-node, tp and pp must all be >= 1")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {self.world_size} (nnodes x nproc-per-node) is not divisible by "
                f"tp x pp = {self.tp * self.pp}; pick tp/pp that divide it")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> "Coords":
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(pp=pp, tp=tp, dp=dp)

    def rank_of(self, c: "Coords") -> int:
        return c.pp * self.tp * self.dp + c.dp * self.tp + c.tp

    def slot_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def ranks_of_slot(self, slot: int) -> list[int]:
        return list(range(slot * self.nproc_per_node, (slot + 1) * self.nproc_per_node))

    def dp_peers(self, rank: int) -> list[int]:
        """Ranks holding the same (tp, pp) shard, in DP-ring order starting after `rank`."""
        return list(self.iter_dp_peers(rank))

    def iter_dp_peers(self, rank: int) -> Iterator[int]:
        """dp_peers, lazily: callers that need the first match need not build a 16K-long ring."""
        c = self.coords(rank)
        base = c.pp * self.tp * self.dp + c.tp
        return (base + ((c.dp + i) % self.dp) * self.tp for i in range(1, self.dp))


@dataclass(frozen=True)
class Coords:
    pp: int
    tp: int
    dp: int


def place_replicas(layout: Layout, k: int, domains: Mapping[int, str] | None = None) -> dict[int, list[int]]:
    """For each rank, the k node slots that hold a replica of its private state.

    Holders are the nodes of its DP-ring peers (ring order, so load spreads
    evenly), never the owner's node, preferring fault domains not used yet by
    the owner or earlier holders. Falls back to any other node when DP peers
    are all local (dp within one node). Deterministic.
    """
    if k < 0:
        raise ValueError("replicas must be >= 0")
    if k > layout.nnodes - 1:
        raise ValueError(f"--replicas {k} needs at least {k + 1} nodes (have {layout.nnodes})")
    domains = dict(domains or {})
    def dom(slot: int) -> str:
        return domains.get(slot, f"node{slot}")  # unlabelled nodes are their own domain
    out: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        owner = layout.slot_of(rank)
        candidates = _candidates(layout, rank, owner)
        seen: list[int] = []     # candidates scanned so far, for the second pass
        holders: list[int] = []
        used = {dom(owner)}
        for s in candidates:  # first pass: new fault domains only (lazy: stops once k are found)
            seen.append(s)
            if dom(s) not in used:
                holders.append(s)
                used.add(dom(s))
                if len(holders) == k:
                    break
        if len(holders) < k:  # not enough domains: any other node
            for s in seen:
                if len(holders) < k and s not in holders:
                    holders.append(s)
        out[rank] = holders
    return out


def _candidates(layout: Layout, rank: int, owner: int) -> Iterator[int]:
    """Nodes other than the owner's, in preference order: the DP-ring peers' nodes, then every other
    node from the owner on. A generator: at 16K nodes the full list per rank would be quadratic."""
    seen = {owner}
    c = layout.coords(rank)
    ring = (layout.slot_of(layout.rank_of(Coords(c.pp, c.tp, (c.dp + i) % layout.dp))) for i in range(1, layout.dp))
    others = ((owner + i) % layout.nnodes for i in range(1, layout.nnodes))
    for s in itertools.chain(ring, others):
        if s not in seen:
            seen.add(s)
            yield s

"""Shrink and grow: the plan of a change of the job's node count, as pure functions (table-tested).

A shrink (`--on-no-spare shrink`, no spare for a lost node) and a grow-back (a spare registers while shrunk) are
both carried out as one coordinated restart of every worker from memory, with a new world size, like
torchelastic's elastic scaling: the survivors' slots are renumbered 0..n-1 (their order kept), ranks follow the
slots (rank = slot x nproc-per-node + local rank), and the new workers re-partition the ZeRO optimizer state from
the old ranks' snapshots (runtime/reshard.py). This module decides, from the layout and the snapshot inventories
the agents reported as they quiesced:

- whether the change is possible at all (`Refusal`: not a pure data-parallel layout, no node left, a lost
  rank's shard held by no survivor, no common step);
- the step every old rank is read at (the newest one each has: own slot, or a survivor's replica);
- which node reads which old rank's snapshot (an owner its own ranks, a replica holder a lost rank's), and
  which new rank continues which old one (`predecessor`: parameters, RNG, the script's state).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from phoenixrun.protocol.reshard import Image, NodeReshard
from phoenixrun.topology import Layout


@dataclass(frozen=True)
class Refusal:
    """The change cannot be made without losing or mixing state; `reason` says why and what to do."""
    reason: str


@dataclass(frozen=True)
class ReshapePlan:
    kind: str                          # "shrink" | "grow"
    old: Layout
    new: Layout
    restore_step: int
    slot_map: dict[int, int]           # old slot -> new slot, for every node that stays
    new_slots: tuple[int, ...]         # grow: the slots a fresh node fills (it reads no image)
    images: dict[int, tuple[Image, ...]] = field(default_factory=dict)   # new slot -> what its node reads
    predecessor: dict[int, int] = field(default_factory=dict)            # new rank -> the old rank it continues

    def reshard_for(self, new_slot: int) -> NodeReshard:
        """What one node's agent and workers need (the `reshard` of its restart order)."""
        return NodeReshard(self.kind, self.old.world_size, self.restore_step, self.images.get(new_slot, ()),
                           {r: p for r, p in self.predecessor.items() if self.new.slot_of(r) == new_slot})


def _layout_refusal(layout: Layout) -> Refusal | None:
    if layout.tp > 1 or layout.pp > 1:
        return Refusal(f"the job is laid out with --tp {layout.tp} --pp {layout.pp}: a shrink or grow re-partitions "
                       "only a pure data-parallel job (DDP, ZeRO); a tensor- or pipeline-parallel job would need its "
                       "shards re-laid out. Give it a spare (`phoenixrun agent --rdzv-endpoint HOST:PORT`) instead")
    return None


def _newest_common(options: list[set[int]]) -> int | None:
    common = set.intersection(*options) if options else set()
    return max(common) if common else None


def plan_shrink(layout: Layout, lost: set[int], snapshots: Mapping[int, Mapping[int, list[int]]],
                replicas: Mapping[int, Mapping[int, list[int]]],
                placement: Mapping[int, list[int]]) -> ReshapePlan | Refusal:
    """Continue without the nodes in slots `lost`.

    snapshots / replicas: slot -> rank -> steps, of every surviving node (its own slots / the replicas it holds);
    placement: rank -> the slots holding its replica (topology.place_replicas)."""
    refused = _layout_refusal(layout)
    if refused:
        return refused
    survivors = [s for s in range(layout.nnodes) if s not in lost]
    if not survivors:
        return Refusal("every node of the job is lost: nothing to shrink to (the data-parallel degree would be 0)")
    npn = layout.nproc_per_node
    steps: list[set[int]] = []
    holder_of: dict[int, list[int]] = {}
    for s in survivors:
        for r in layout.ranks_of_slot(s):
            steps.append(set(snapshots.get(s, {}).get(r, ())))
    for s in sorted(lost):
        for r in layout.ranks_of_slot(s):
            holders = [h for h in placement.get(r, []) if h not in lost]
            if not holders:
                return Refusal(f"rank {r}'s optimizer shard has no replica on a surviving node (its holders "
                               f"{placement.get(r, [])} are lost too): a shrink would lose it; --replicas 2 "
                               "survives two lost nodes")
            holder_of[r] = holders
            steps.append({st for h in holders for st in replicas.get(h, {}).get(r, ())})
    step = _newest_common(steps)
    if step is None:
        return Refusal("no snapshot step is held for every rank (own slots and surviving replicas): nothing "
                       "consistent to shrink to")
    new = Layout(len(survivors), npn, layout.tp, layout.pp)
    slot_map = {s: i for i, s in enumerate(survivors)}
    images: dict[int, list[Image]] = {slot_map[s]: [Image(r, True, r - s * npn) for r in layout.ranks_of_slot(s)]
                                      for s in survivors}
    predecessor = {slot_map[s] * npn + lr: s * npn + lr for s in survivors for lr in range(npn)}
    for r, holders in sorted(holder_of.items()):
        h = next(h for h in holders if step in replicas.get(h, {}).get(r, ()))
        mine = images[slot_map[h]]
        mine.append(Image(r, False, len(mine) % npn))   # spread the extra reads over the node's workers
    return ReshapePlan("shrink", layout, new, step, slot_map, (), {s: tuple(v) for s, v in images.items()},
                       predecessor)


def plan_grow(layout: Layout, fresh: int, snapshots: Mapping[int, Mapping[int, list[int]]],
              max_nnodes: int) -> ReshapePlan | Refusal:
    """Take `fresh` new nodes into slots nnodes..nnodes+fresh-1 (never past `max_nnodes`, the job's --nnodes).

    snapshots: slot -> rank -> steps of every node in the job now. Every old rank is read by its own node; the
    new ranks continue nothing (they take rank 0's parameters, RNG and script state: runtime/reshard.py)."""
    refused = _layout_refusal(layout)
    if refused:
        return refused
    fresh = min(fresh, max_nnodes - layout.nnodes)
    if fresh <= 0:
        return Refusal(f"the job already has its {max_nnodes} nodes (--nnodes): nothing to grow")
    step = _newest_common([set(snapshots.get(layout.slot_of(r), {}).get(r, ())) for r in range(layout.world_size)])
    if step is None:
        return Refusal("no snapshot step is committed by every rank yet: grow again later")
    npn = layout.nproc_per_node
    new = Layout(layout.nnodes + fresh, npn, layout.tp, layout.pp)
    images = {s: tuple(Image(r, True, r - s * npn) for r in layout.ranks_of_slot(s)) for s in range(layout.nnodes)}
    return ReshapePlan("grow", layout, new, step, {s: s for s in range(layout.nnodes)},
                       tuple(range(layout.nnodes, new.nnodes)), images, {r: r for r in range(layout.world_size)})

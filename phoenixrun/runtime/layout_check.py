"""What `phoenixrun.protect()` refuses, before training: state it could not restore correctly today.

A hot swap restores a lost rank's shared state - its plain (non-DTensor) parameters, buffers and a plain
optimizer's state - from a rank the plan takes for its data-parallel peer: the ranks with the same (tp, pp)
coordinates of the `--tp/--pp` layout, over all ranks when no flags are given. That is only correct when
those ranks hold the same bytes: DDP-replicated parameters. DTensor state (FSDP2 `fully_shard`, HSDP, tensor
parallelism) is not shared: the local shard of every DTensor is rank-private, snapshotted with the
replicated part and restored from the rank's own replica, never from a peer (runtime/snapshot.py). What
cannot be restored correctly is refused here, with the layout named and the way out:

- a DTensor with a Partial placement: a pending reduction, not state;
- FSDP1 (`FullyShardedDataParallel`): flat sharded plain parameters that a DP peer does not hold;
- a DDP whose process group does not include every rank the plan takes for a DP peer (DDP over a
  mesh dimension or a subgroup, without matching `--tp/--pp`): the peers' parameters diverge;
- ranks in the DP-peer relation whose shared (non-DTensor) state differs at protect() time (pipeline
  stages, per-rank models): compared with one all-gather of a checksum per rank;
- BatchNorm running statistics: each rank's forward updates them from its own batch, so DP peers
  never hold a replaced rank's values (SyncBatchNorm's are identical on every rank).

The decisions are pure functions of observed facts (`local_refusal`, `peer_mismatch`); `observe`
and `shared_checksum` read them from the live objects. Parameters that start equal and diverge
later (two stages seeded alike) pass here; the restore then refuses them (the fetched bytes must
match the checksum the lost rank recorded: agents/slots.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

WAY_OUT = ("run it without protect() (PHOENIXRUN_PROTECT=0, or plain torchrun: a failure restarts the job, "
           "--max-restarts) - protecting this layout is tracked in issue 15.")


class ProtectionRefused(ValueError):
    """protect() cannot restore this script's state correctly after a failure; the message says why."""


@dataclass(frozen=True)
class DTensorFacts:
    name: str                       # "model/<state_dict key>" or "optim/<param index>/<key>"
    mesh_dims: tuple[str, ...]      # the mesh's dimension names (or dim_<i>)
    placements: tuple[str, ...]     # str() of each placement: Shard(dim=0), Replicate(), Partial(sum)


@dataclass(frozen=True)
class LayoutFacts:
    """What protect() sees of one rank's model and optimizer."""
    rank: int
    wrapper: str                                   # type name of the model object
    dtensors: tuple[DTensorFacts, ...] = ()
    ddp_group: tuple[int, ...] | None = None       # global ranks of DDP's process group; None: not DDP
    plan_peers: tuple[int, ...] = ()               # the ranks the plan takes for this rank's DP peers (with itself)
    flags: str = "--tp 1 --pp 1"
    local_stats: tuple[str, ...] = ()              # modules whose buffers each rank's own forward updates


def describe(d: DTensorFacts) -> str:
    """The layout a DTensor's placements mean, in the words of the APIs that make them."""
    shard = [m for m, p in zip(d.mesh_dims, d.placements) if p.startswith("Shard") or p.startswith("_StridedShard")]
    rep = [m for m, p in zip(d.mesh_dims, d.placements) if p.startswith("Replicate")]
    if shard and rep:
        kind = f"sharded over {shard} and replicated over {rep} (HSDP, or TP x DP)"
    elif shard:
        kind = f"sharded over {shard} (FSDP2 fully_shard or tensor parallelism)"
    elif rep or not any(p.startswith("Partial") for p in d.placements):
        kind = f"a DTensor replicated over {rep or list(d.mesh_dims)}"
    else:
        kind = "a DTensor with a pending reduction"
    return f"{d.name} is {kind}; placements ({', '.join(d.placements)}) on mesh dims {list(d.mesh_dims)}"


def local_refusal(f: LayoutFacts) -> str | None:
    """Why this rank's state cannot be protected, from what it sees locally; None: nothing against it."""
    partial = [d for d in f.dtensors if any(p.startswith("Partial") for p in d.placements)]
    if partial:
        more = f" (and {len(partial) - 1} more)" if len(partial) > 1 else ""
        return (f"phoenixrun.protect: {describe(partial[0])}{more}. A Partial placement is a reduction still "
                "pending: its local tensor is not state a snapshot can restore. Redistribute it to Shard or "
                "Replicate before protect() (and keep it so between steps), or " + WAY_OUT)
    if f.wrapper == "FullyShardedDataParallel":
        return ("phoenixrun.protect: the model is FSDP (FullyShardedDataParallel): each rank holds a different "
                "flat shard of the parameters, and the recovery plan would restore a replaced rank's shard from a "
                "data-parallel peer that holds another. Use DDP, or " + WAY_OUT)
    if f.local_stats:
        # measured: DDP broadcasts buffers before the forward, BatchNorm then updates them from the local batch, so
        # after one step running_mean differs between two DDP ranks (torchrun, 2 ranks, gloo)
        return (f"phoenixrun.protect: {list(f.local_stats)} keep running statistics that each rank's own forward "
                "updates (BatchNorm): they differ between data-parallel peers after every step, so a replaced rank "
                "could only get another rank's values. Use torch.nn.SyncBatchNorm (its statistics are the same on "
                "every rank), or " + WAY_OUT)
    if f.ddp_group is not None and not set(f.plan_peers) <= set(f.ddp_group):
        outside = sorted(set(f.plan_peers) - set(f.ddp_group))
        return (f"phoenixrun.protect: DDP on rank {f.rank} replicates over ranks {list(f.ddp_group)}, but with "
                f"{f.flags} phoenixrun takes ranks {list(f.plan_peers)} for its data-parallel peers: rank(s) "
                f"{outside} hold other parameters (another stage or shard), and a replaced rank would be restored "
                "from one of them. Pass --tp/--pp so that the DP peers are exactly DDP's group, or " + WAY_OUT)
    return None


def dp_groups(world_size: int, peers_of) -> list[tuple[int, ...]]:
    """The plan's DP-peer classes (each rank with its peers), from `peers_of(rank) -> iterable of ranks`."""
    seen: set[int] = set()
    out = []
    for r in range(world_size):
        if r in seen:
            continue
        g = tuple(sorted({r, *peers_of(r)}))
        seen.update(g)
        out.append(g)
    return out


def peer_mismatch(checksums: Sequence[int], groups: Sequence[Sequence[int]], flags: str = "--tp 1 --pp 1") -> str | None:
    """None when every DP-peer class holds identical replicated state; else why not (the first class that differs)."""
    for g in groups:
        values = {checksums[r] for r in g}
        if len(values) > 1:
            by_value: dict[int, list[int]] = {}
            for r in g:
                by_value.setdefault(checksums[r], []).append(r)
            split = " vs ".join(str(rs) for rs in by_value.values())
            return (f"phoenixrun.protect: ranks {list(g)} are data-parallel peers in phoenixrun's plan ({flags}), "
                    f"so a replaced rank's parameters would be taken from one of them, but they hold different "
                    f"parameters at protect() time ({split}): pipeline stages or per-rank models are not plain "
                    "DDP replicas. Pass --pp/--tp so that only true replicas are DP peers, or " + WAY_OUT)
    return None


def verdict(own: str | None, refused: Sequence[int], checksums: Sequence[int], groups: Sequence[Sequence[int]],
            flags: str = "--tp 1 --pp 1") -> str | None:
    """The decision every rank takes from the same gathered facts (so all of them stop, none waits on the others):
    its own refusal, else another rank's, else a DP-peer class whose state differs."""
    if own is not None:
        return own
    if refused:
        return (f"phoenixrun.protect: rank(s) {list(refused)} cannot be protected (their error says why); "
                "every rank stops before training")
    return peer_mismatch(checksums, groups, flags)


def observe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, plan_peers: Sequence[int],
            flags: str) -> LayoutFacts:
    """The facts `local_refusal` decides on, read from the live model and optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dts = []
    for name, t in model.state_dict().items():
        d = _dtensor_facts(f"model/{name}", t)
        if d is not None:
            dts.append(d)
    for idx, st in _optimizer_state(optimizer).items():
        for k, v in st.items():
            d = _dtensor_facts(f"optim/{idx}/{k}", v)
            if d is not None:
                dts.append(d)
    ddp_group = None
    if isinstance(model, DDP):
        import torch.distributed as dist
        ddp_group = tuple(dist.get_process_group_ranks(model.process_group))
    bn = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)   # SyncBatchNorm is none of them
    stats = tuple(name or type(m).__name__ for name, m in model.named_modules()
                  if isinstance(m, bn) and m.track_running_stats)
    return LayoutFacts(rank=rank, wrapper=type(model).__name__, dtensors=tuple(dts), ddp_group=ddp_group,
                       plan_peers=tuple(sorted({rank, *plan_peers})), flags=flags, local_stats=stats)


def shared_checksum(model: torch.nn.Module) -> int:
    """crc32 over the model's shared state (names, dtypes, shapes and bytes): what DP peers must hold identically.

    DTensors are left out: their local shards are rank-private (snapshotted and restored from the rank's own
    replica, never taken from a peer), and a peer holding another shard is expected."""
    c = 0
    for name, t in model.state_dict().items():
        if is_dtensor(t):
            continue
        t = t.detach()
        c = zlib.crc32(f"{name}:{t.dtype}:{tuple(t.shape)};".encode(), c)
        if t.numel():
            c = zlib.crc32(t.cpu().contiguous().view(-1).view(torch.uint8).numpy(), c)   # the buffer, no copy
    return c


def _optimizer_state(optimizer) -> dict:
    from phoenixrun.runtime.snapshot import local_optimizer
    try:
        return local_optimizer(optimizer).state_dict()["state"]
    except Exception:  # noqa: BLE001 - an optimizer whose state_dict fails is refused later by the snapshot
        return {}


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _dtensor_facts(name: str, t) -> DTensorFacts | None:
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    dims = tuple(mesh.mesh_dim_names or (f"dim_{i}" for i in range(mesh.ndim)))
    return DTensorFacts(name, dims, tuple(placement_name(p) for p in t.placements))


def placement_name(p) -> str:
    # str(Shard(0)) is "S(0)" in torch 2.13: spell them the way the APIs are written. FSDP2 over a TP-sharded
    # parameter shards it again as _StridedShard, which is_shard() does not count
    if type(p).__name__ == "_StridedShard":
        return f"_StridedShard(dim={p.dim}, sf={getattr(p, 'split_factor', '?')})"
    if p.is_shard():
        return f"Shard(dim={p.dim})"
    if p.is_replicate():
        return "Replicate()"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return str(p)



"""What `phoenixrun.protect()` refuses, and which state a recovery may take from a peer, decided before training.

A hot swap restores a lost rank's *shared* state - its plain (non-DTensor) parameters, buffers and a plain
optimizer's state - from a rank the plan takes for its data-parallel peer: the ranks with the same (tp, pp)
coordinates of the `--tp/--pp` layout, over all ranks when no flags are given. That is only correct when those
ranks hold the same bytes, and the one thing that keeps them so is DDP (its all-reduce makes every replica's
update identical). Everything else is *rank-private*: snapshotted into the rank's private region, copied to
`--replicas` holders on other nodes and restored from the rank's own replica, never taken from a peer:

- every DTensor's local shard (FSDP2 `fully_shard`, HSDP, tensor parallelism) unless every rank's DTensors live
  on one mesh spanning the world and each rank has a rank on another node with the same coordinates along every
  dimension its tensors are sharded over (`dtensor_verdict`: HSDP with replicas across nodes, TP with DP peers
  across nodes): then they are shared, and the plan takes them from such a peer (runtime/snapshot.py
  StateBinding);
- all plain state of every rank, when any rank's plain state is not provably held by its plan peers: a model
  that is not DDP (a hand-written pipeline stage, per-rank models, manual all-reduce), DDP over a group that
  does not include every rank the plan takes for a peer (DDP over a mesh dimension or a subgroup without
  matching `--tp/--pp`), BatchNorm running statistics (each rank's forward updates them from its own batch),
  or plan peers whose plain state differs at protect() time (one all-gather of a checksum per rank).
  Correct by construction, at the cost of replicating those bytes; `--tp/--pp` matching the layout (DDP over
  true replicas) makes them shared again.

Refused, with the layout named and the way out, is only what no snapshot can restore:
- a DTensor with a Partial placement: a pending reduction, not state;
- FSDP1 (`FullyShardedDataParallel`): its state_dict() is a collective, not a rank's own tensors;
- `--tp/--pp` that contradict a `tp`/`pp` dimension of a DTensor's device mesh: with a mesh they are
  unnecessary (the mesh says it), and a wrong one is a user mistake named as such (redundancy.check_flags).

The decisions are pure functions of observed facts (`local_refusal`, `unshared_reason`, `peer_mismatch`,
`verdict`); `observe` and `shared_checksum` read them from the live objects. Every rank takes the same decision
from the same gathered facts, and a replacement process takes the one recorded in the snapshot it restores.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

from phoenixrun.redundancy import LayoutError, Mesh, PeerSet, check_flags, lacking_copy, peer_set, varies_of

WAY_OUT = ("run it without protect() (PHOENIXRUN_PROTECT=0, or plain torchrun: a failure restarts the job, "
           "--max-restarts).")


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
    meshes: tuple[Mesh, ...] = ()                  # the device meshes its DTensors live on
    tp: int = 1                                    # the --tp/--pp flags given
    pp: int = 1


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
    """Why this rank's state cannot be protected at all, from what it sees locally; None: nothing against it."""
    partial = [d for d in f.dtensors if any(p.startswith("Partial") for p in d.placements)]
    if partial:
        more = f" (and {len(partial) - 1} more)" if len(partial) > 1 else ""
        return (f"phoenixrun.protect: {describe(partial[0])}{more}. A Partial placement is a reduction still "
                "pending: its local tensor is not state a snapshot can restore. Redistribute it to Shard or "
                "Replicate before protect() (and keep it so between steps), or " + WAY_OUT)
    for mesh in f.meshes:   # a DTensor's mesh is often a submesh (FSDP2 over TP: (dp, tp)): only its own dims
        try:
            check_flags(mesh, f.tp if "tp" in mesh.names else 1, f.pp if "pp" in mesh.names else 1)
        except LayoutError as e:
            return f"phoenixrun.protect: {e}. Or " + WAY_OUT
    if f.wrapper == "FullyShardedDataParallel":
        return ("phoenixrun.protect: the model is FSDP (FullyShardedDataParallel): its state_dict() is a collective "
                "over flat sharded parameters, not state a per-step snapshot can take. Use FSDP2 (fully_shard) or "
                "DDP, or " + WAY_OUT)
    return None


def unshared_reason(f: LayoutFacts) -> str | None:
    """Why this rank's plain (non-DTensor) state may not be taken from the ranks the plan takes for its DP peers
    (None: DDP keeps them identical). Not a refusal: such state is snapshotted as rank-private and replicated."""
    if f.local_stats:
        # measured: DDP broadcasts buffers before the forward, BatchNorm then updates them from the local batch, so
        # after one step running_mean differs between two DDP ranks (torchrun, 2 ranks, gloo)
        return (f"{list(f.local_stats)} keep running statistics that each rank's own forward updates (BatchNorm): "
                "they differ between data-parallel peers (torch.nn.SyncBatchNorm keeps them identical)")
    if f.ddp_group is None:
        return (f"the model on rank {f.rank} is {f.wrapper}, not DDP: nothing keeps its parameters identical on "
                f"ranks {list(f.plan_peers)}, which phoenixrun takes for its data-parallel peers ({f.flags})")
    if not set(f.plan_peers) <= set(f.ddp_group):
        outside = sorted(set(f.plan_peers) - set(f.ddp_group))
        return (f"DDP on rank {f.rank} replicates over ranks {list(f.ddp_group)}, but with {f.flags} phoenixrun "
                f"takes ranks {list(f.plan_peers)} for its data-parallel peers: rank(s) {outside} hold other "
                "parameters (another stage or shard); --tp/--pp matching the layout make them true replicas")
    return None


def dp_groups(world_size: int, peers_of: Callable[[int], Iterable[int]]) -> list[tuple[int, ...]]:
    """The plan's DP-peer classes (each rank with its peers), from `peers_of(rank) -> iterable of ranks`."""
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for r in range(world_size):
        if r in seen:
            continue
        g = tuple(sorted({r, *peers_of(r)}))
        seen.update(g)
        out.append(g)
    return out


def peer_mismatch(checksums: Sequence[int], groups: Sequence[Sequence[int]], flags: str = "--tp 1 --pp 1") -> str | None:
    """None when every DP-peer class holds identical plain state; else why not (the first class that differs)."""
    for g in groups:
        values = {checksums[r] for r in g}
        if len(values) > 1:
            by_value: dict[int, list[int]] = {}
            for r in g:
                by_value.setdefault(checksums[r], []).append(r)
            split = " vs ".join(str(rs) for rs in by_value.values())
            return (f"ranks {list(g)} are data-parallel peers in phoenixrun's plan ({flags}) but hold different "
                    f"parameters at protect() time ({split}): pipeline stages or per-rank models, not replicas")
    return None


@dataclass(frozen=True)
class Verdict:
    """The decision every rank takes at protect(): refuse (with the reason), or protect - taking plain state from
    DP peers on recovery (`peer_shared`) or snapshotting it as rank-private (`private_why` says why)."""
    refusal: str | None = None
    peer_shared: bool = True
    private_why: str | None = None
    # DTensor state in the shared region, taken on recovery from a peer of this set (dtensor_verdict); None: it is
    # rank-private, and `dtensor_why` says why (None too when there are no DTensors)
    dtensor_peers: PeerSet | None = None
    dtensor_why: str | None = None


def verdict(own: str | None, refused: Sequence[int], checksums: Sequence[int], groups: Sequence[Sequence[int]],
            unshared: Sequence[tuple[int, str]] = (), flags: str = "--tp 1 --pp 1") -> Verdict:
    """The decision every rank takes from the same gathered facts (so all of them stop, none waits on the others):
    its own refusal, else another rank's; else plain state is shared unless some rank's is not provably held by
    its plan peers (`unshared`: (rank, reason) pairs) or a DP-peer class differs - then it is private on every
    rank (a replaced rank and the peer it would fetch from must agree on what the shared region holds)."""
    if own is not None:
        return Verdict(refusal=own, peer_shared=False)
    if refused:
        return Verdict(refusal=f"phoenixrun.protect: rank(s) {list(refused)} cannot be protected (their error says "
                               "why); every rank stops before training", peer_shared=False)
    if unshared:
        rank, why = unshared[0]
        more = f" (and {len(unshared) - 1} more rank(s))" if len(unshared) > 1 else ""
        return Verdict(peer_shared=False, private_why=f"rank {rank}: {why}{more}")
    mismatch = peer_mismatch(checksums, groups, flags)
    return Verdict(peer_shared=mismatch is None, private_why=mismatch)


def dtensor_peers(f: LayoutFacts, world_size: int) -> PeerSet | None:
    """This rank's DTensors as a job-wide peer set (redundancy.peer_set: one mesh over the world, U the union of
    the dimensions its tensors vary along); None when it has none, or they live on submeshes."""
    if not f.dtensors:
        return None
    try:
        return peer_set(f.meshes, [varies_of(d.mesh_dims, d.placements) for d in f.dtensors], world_size)
    except LayoutError:
        return None


def peer_fingerprint(ps: PeerSet | None) -> int:
    """A positive int naming (mesh, U), for the all-gather that makes every rank decide alike; 0: none."""
    if ps is None:
        return 0
    wire = {k: v for k, v in ps.to_wire().items() if k != "plain"}
    return zlib.crc32(json.dumps(wire, sort_keys=True).encode()) | 1


def dtensor_verdict(own: PeerSet | None, fingerprints: Sequence[int], node_of: Mapping[int, Hashable],
                    plain_shared: bool, same_plain_peers: Callable[[int, int], bool] = lambda rank, peer: True,
                    ) -> tuple[PeerSet | None, str | None]:
    """Whether DTensor state goes to the shared region (taken from a peer on recovery), decided alike on every
    rank from the gathered fingerprints: only when every rank has the same peer set and every rank has a peer
    on another node - one that also holds its plain state (`same_plain_peers`) when plain state is shared, since
    a peer then serves both from one region. Else (None, why) and it stays rank-private, replicated."""
    if own is None or any(fp != fingerprints[0] for fp in fingerprints) or not fingerprints[0]:
        return None, ("the ranks' DTensors do not all live on one device mesh spanning every rank with the same "
                      "sharded dimensions (submeshes, e.g. TP x PP x FSDP): no peer provably holds a rank's shards")
    ps = PeerSet(own.mesh, own.varies, plain=plain_shared)
    lacking = lacking_copy(ps, node_of, same_plain_peers if plain_shared else (lambda rank, peer: True))
    if lacking:
        more = f" (and {len(lacking) - 4} more)" if len(lacking) > 4 else ""
        return None, (f"rank(s) {lacking[:4]}{more} have no rank on another node holding the same DTensor shards "
                      f"(mesh {list(own.mesh.names)} {list(own.mesh.shape)}, sharded over {sorted(own.varies)})")
    return ps, None


def observe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, plan_peers: Sequence[int],
            flags: str, tp: int = 1, pp: int = 1) -> LayoutFacts:
    """The facts `local_refusal` decides on, read from the live model and optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    dts, meshes = [], {}
    tensors = [(f"model/{name}", t) for name, t in model.state_dict().items()]
    tensors += [(f"optim/{idx}/{k}", v) for idx, st in _optimizer_state(optimizer).items() for k, v in st.items()]
    for name, t in tensors:
        d = _dtensor_facts(name, t)
        if d is not None:
            dts.append(d)
            m = _mesh(t.device_mesh, d.mesh_dims)
            meshes[(m.names, m.shape, m.ranks)] = m
    ddp_group = None
    if isinstance(model, DDP):
        import torch.distributed as dist
        ddp_group = tuple(dist.get_process_group_ranks(model.process_group))
    bn = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)   # SyncBatchNorm is none of them
    stats = tuple(name or type(m).__name__ for name, m in model.named_modules()
                  if isinstance(m, bn) and m.track_running_stats)
    return LayoutFacts(rank=rank, wrapper=type(model).__name__, dtensors=tuple(dts), ddp_group=ddp_group,
                       plan_peers=tuple(sorted({rank, *plan_peers})), flags=flags, local_stats=stats,
                       meshes=tuple(meshes.values()), tp=tp, pp=pp)


def _mesh(device_mesh: DeviceMesh, names: tuple[str, ...]) -> Mesh:
    """A torch DeviceMesh as the pure core's Mesh (names, shape, the world rank at every coordinate)."""
    return Mesh(names, tuple(device_mesh.mesh.shape), tuple(int(r) for r in device_mesh.mesh.flatten().tolist()))


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


def has_plain_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether any model or optimizer tensor is not a DTensor (what the sharing decision is about)."""
    if any(not is_dtensor(t) for t in model.state_dict().values()):
        return True
    return any(torch.is_tensor(v) and not is_dtensor(v) and v.dim() > 0
               for st in _optimizer_state(optimizer).values() for v in st.values())


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    """The rank's optimizer state by parameter (state_dict()'s "state": the user's optimizer's values)."""
    from phoenixrun.runtime.snapshot import local_optimizer
    try:
        state: dict[Any, dict[str, Any]] = local_optimizer(optimizer).state_dict()["state"]
        return state
    except Exception:  # noqa: BLE001 - an optimizer whose state_dict fails is refused later by the snapshot
        return {}


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _dtensor_facts(name: str, t: object) -> DTensorFacts | None:
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    dims = tuple(mesh.mesh_dim_names or (f"dim_{i}" for i in range(mesh.ndim)))
    return DTensorFacts(name, dims, tuple(placement_name(p) for p in t.placements))


def placement_name(p: Placement) -> str:
    # str(Shard(0)) is "S(0)" in torch 2.13: spell them the way the APIs are written. FSDP2 over a TP-sharded
    # parameter shards it again as _StridedShard, which is_shard() does not count
    dim = getattr(p, "dim", None)   # Shard's and _StridedShard's (the Placement base class has none)
    if type(p).__name__ == "_StridedShard":
        return f"_StridedShard(dim={dim}, sf={getattr(p, 'split_factor', '?')})"
    if p.is_shard():
        return f"Shard(dim={dim})"
    if p.is_replicate():
        return "Replicate()"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    return str(p)



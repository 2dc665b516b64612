"""Re-partition a job's state over a new world size (a shrink or a grow-back; control/reshape.py plans it).

Every worker of the new world starts as a new process. Its node's agent hands it the snapshot images the plan
gave it (`Image`s: old ranks' slots at the restore step, or replicas a survivor held for a lost rank). Once the
new world's process group is up, every rank:

1. decodes its images and maps each old rank's ZeRO shard from the old rank's local numbering to the global
   parameter index (`zero_partition`: ZeroRedundancyOptimizer's own greedy partition, for the old world size);
2. exchanges them with every other rank (all-gather), checks that every old rank's shard came exactly once and
   that their union covers every parameter any shard had state for - nothing lost, nothing counted twice;
3. loads the union into its ZeroRedundancyOptimizer, which keeps the new partition's part
   (`ZeroRedundancyOptimizer.load_state_dict`);
4. takes the parameters, the RNG state and the script's `state` dict of the old rank it continues (its
   `predecessor`); parameters are then broadcast from rank 0, so every data-parallel rank holds the same bytes,
   and a rank with no predecessor (a grow-back's new node) takes rank 0's RNG and script state.

A plain optimizer (not ZeRO) is identical on every DP rank: it is taken from the predecessor's image like the
parameters. DTensor state, and state protect() kept rank-private (not provably the peers'), are refused.
"""
from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phoenixrun.runtime.snapshot import entry_view, local_optimizer
from phoenixrun.slot_format import HEADER_SIZE, Entry, SlotHeader, crc_private, crc_shared

if TYPE_CHECKING:
    from typing_extensions import Buffer


class ReshardError(RuntimeError):
    """The images cannot be re-partitioned without losing or mixing state."""


def zero_partition(numels: list[list[int]], world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition for `world` ranks: for each rank, the global indices (numbered over the
    param groups in order) of its parameters, in the order its local optimizer numbers them. `numels`: per param
    group, each parameter's numel. The same greedy as torch's `_partition_parameters`: largest first (stable),
    each to the rank with the smallest total so far (the first such), totals carried across groups. Pure."""
    out: list[list[int]] = [[] for _ in range(world)]
    sizes = [0] * world
    base = 0
    for group in numels:
        per_rank: list[list[int]] = [[] for _ in range(world)]
        for i in sorted(range(len(group)), key=lambda i: group[i], reverse=True):
            rank = min(range(world), key=lambda r: sizes[r])
            per_rank[rank].append(base + i)
            sizes[rank] += group[i]
        for r in range(world):
            out[r].extend(per_rank[r])
        base += len(group)
    return out


# a snapshot's metadata (JSON: slot_format.py), one rank's optimizer state by parameter index (torch's state_dict
# form), and a decoded image: (metadata, tensors by entry name, has_shared)
Meta = dict[str, Any]
OptState = dict[int, dict[str, Any]]
Decoded = tuple[Meta, dict[str, torch.Tensor], bool]


def decode_image(buf: Buffer) -> Decoded:
    """(metadata, tensors by entry name, has_shared) of a sealed slot image or a replica (the replicated prefix:
    no shared region). Both checksums are checked where their region is present."""
    mv = memoryview(buf)
    h = SlotHeader.unpack(mv)
    if crc_private(mv, h) != h.crc_private:
        raise ReshardError(f"snapshot image of step {h.step} fails its checksum")
    has_shared = len(mv) >= h.shared_off + h.shared_len
    if has_shared and crc_shared(mv, h) != h.crc_shared:
        raise ReshardError(f"snapshot image of step {h.step} fails its parameters' checksum")
    meta = json.loads(bytes(mv[HEADER_SIZE:HEADER_SIZE + h.meta_len]))
    raw = torch.frombuffer(bytearray(mv), dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)
    tensors = {e.name: entry_view(raw, h.private_off, e).clone() for e in map(Entry.from_json, meta["private"])}
    if has_shared:
        tensors.update({e.name: entry_view(raw, h.shared_off, e).clone() for e in map(Entry.from_json, meta["shared"])})
    return meta, tensors, has_shared


def shard_state(meta: Meta, tensors: dict[str, torch.Tensor], local_to_global: list[int]) -> OptState:
    """One old rank's optimizer state, keyed by global parameter index."""
    out: dict[int, dict[str, Any]] = {}

    def put(idx: str, name: str, v: object) -> None:
        i = int(idx)
        if i >= len(local_to_global):
            raise ReshardError(f"the snapshot has optimizer state for local parameter {i}, the old partition "
                               f"gives that rank {len(local_to_global)}: not the same model or optimizer")
        out.setdefault(local_to_global[i], {})[name] = v
    for k, v in tensors.items():
        if k.startswith("optim/"):
            _, idx, name = k.split("/", 2)
            put(idx, name, v)
    for k, v in meta["scalars"].items():
        idx, name = k.split("/", 1)
        put(idx, name, v)
    return out


def merge_shards(shards: dict[int, OptState], old_world: int) -> OptState:
    """The union of every old rank's shard; ReshardError when a rank is missing or two hold the same parameter."""
    missing = sorted(set(range(old_world)) - set(shards))
    if missing:
        raise ReshardError(f"the optimizer shards of old rank(s) {missing} did not arrive: re-partitioning would "
                           "lose their state")
    full: OptState = {}
    for r in sorted(shards):
        for idx, st in shards[r].items():
            if idx in full:
                raise ReshardError(f"parameter {idx} has optimizer state in two old ranks' shards")
            full[idx] = st
    return full


def _all_gather_bytes(data: bytes) -> list[bytes]:
    world = dist.get_world_size()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n)   # (all_gather_into_tensor warns of its deprecation in torch 2.13)
    cap = int(max(s.item() for s in sizes))
    mine = torch.zeros(cap, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros(cap, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine)
    return [out[i][:int(sizes[i].item())].numpy().tobytes() for i in range(world)]


def _dumps(obj: object) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def _loads(data: bytes) -> Any:   # what _dumps saved, of the caller's shape
    return torch.load(io.BytesIO(data), weights_only=False)


def reshard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, images: dict[int, bytes],
            predecessor: int | None, old_world: int) -> dict[str, Any]:
    """Load the re-partitioned state (module doc) into this rank's live model and optimizer; returns the script's
    `state` dict to restore. `images`: old rank -> the image bytes this rank read. Collective: every rank of the
    new world calls it, in the new world's default group."""
    decoded = {r: decode_image(b) for r, b in images.items()}
    for r, (meta, _, _) in decoded.items():
        if meta.get("dtensors") or meta.get("peer_shared") is False:
            raise ReshardError(f"old rank {r}'s snapshot holds DTensor or rank-private plain state: a shrink or grow "
                               "re-partitions only DDP + ZeRO (or a replicated optimizer)")
    zero = local_optimizer(optimizer) is not optimizer     # ZeroRedundancyOptimizer
    shards: dict[int, OptState] = {}
    if zero:
        numels = [[p.numel() for p in g["params"]] for g in optimizer.param_groups]
        old_part = zero_partition(numels, old_world)
        shards = {r: shard_state(meta, t, old_part[r]) for r, (meta, t, _) in decoded.items()}
    own = decoded.get(predecessor) if predecessor is not None else None
    if predecessor is not None and (own is None or not own[2]):
        raise ReshardError(f"the snapshot of old rank {predecessor} (whose parameters this rank continues) is not "
                           "among the images this rank read")
    carry: dict[str, Any] = {"shards": shards}
    if own is not None:
        carry["groups"] = own[0]["param_groups"]
    gathered = [_loads(b) for b in _all_gather_bytes(_dumps(carry))]
    with torch.no_grad():
        if own is not None:
            meta, tensors, _ = own
            model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
            torch.set_rng_state(tensors["rng/cpu"])
        for t in model.state_dict().values():    # every DP rank holds rank 0's bytes
            dist.broadcast(t, 0)
    groups = gathered[0]["groups"]
    if zero:
        all_shards: dict[int, OptState] = {}
        for g in gathered:
            for r, s in g["shards"].items():
                if r in all_shards:
                    raise ReshardError(f"old rank {r}'s shard was read twice")
                all_shards[r] = s
        full = merge_shards(all_shards, old_world)
        optimizer.load_state_dict({"state": full, "param_groups": _global_groups(groups, optimizer)})
    else:
        _load_replicated(optimizer, own, groups)
    # the script's state and the RNG: the predecessor's; a rank without one takes rank 0's
    extra: Any = own[0]["extra"] if own is not None else None   # the script's state dict (None: no predecessor)
    mine = _dumps([extra, torch.get_rng_state()]) if dist.get_rank() == 0 else b""
    got = _loads(_all_gather_bytes(mine)[0])
    if own is None:
        extra = got[0]
        torch.set_rng_state(got[1])
    state: dict[str, Any] = extra   # the script's state dict, as its predecessor (or rank 0) saved it
    return state


def _load_replicated(optimizer: torch.optim.Optimizer, own: Decoded | None, groups: list[dict[str, Any]]) -> None:
    """A plain optimizer: identical on every DP rank, taken from the predecessor's image (rank 0's otherwise)."""
    state: OptState = {}
    if own is not None:
        meta, tensors, _ = own
        state = shard_state(meta, tensors, list(range(sum(len(g["params"]) for g in optimizer.param_groups))))
    state = _loads(_all_gather_bytes(_dumps(state) if dist.get_rank() == 0 else b"")[0])
    optimizer.load_state_dict({"state": state, "param_groups": _global_groups(groups, optimizer)})


def _global_groups(groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The predecessor's param-group settings (lr, betas...), numbered over the live optimizer's parameters."""
    base, out = 0, list[dict[str, Any]]()
    for g, live in zip(groups, optimizer.param_groups):
        n = len(live["params"])
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(base, base + n))})
        base += n
    return out

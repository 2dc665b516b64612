"""runtime/reshard.py with real processes: a DDP + ZeroRedundancyOptimizer(AdamW) job of 3 ranks is snapshotted
by the real snapshot writer, one rank's node is lost (only its replica prefix is left), and a 2-rank world
re-partitions from the images the shrink plan assigns. Every parameter's Adam moments arrive, bit for bit; the
parameters are the old job's; then a 3-rank world grows back from the 2 ranks' snapshots the same way."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from phoenixrun.control.reshape import plan_grow, plan_shrink
from phoenixrun.runtime.reshard import ReshardError, merge_shards, reshard, zero_partition
from phoenixrun.runtime.snapshot import SlotMap, SnapshotWriter, StateBinding, local_optimizer
from phoenixrun.slot_format import SlotHeader, crc_private, crc_shared
from phoenixrun.topology import Layout, place_replicas


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 7), torch.nn.LayerNorm(7))


def _setup(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DDP(_model(), find_unused_parameters=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    numels = [[p.numel() for p in g["params"]] for g in opt.param_groups]
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    mine = [index[id(p)] for g in local_optimizer(opt).param_groups for p in g["params"]]
    assert zero_partition(numels, world)[rank] == mine     # torch's own partition, local order
    return model, opt


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randint(0, 50, (4, 3), generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _snapshot(model, opt, path: str, step: int) -> None:
    binding = StateBinding(model, opt)
    writer = SnapshotWriter(binding, meta_cap=64 * 1024)
    with open(path, "wb") as f:
        f.truncate(writer.total_len)
    slot = SlotMap(path)
    writer.write(slot, step, {"me": dist.get_rank()}, binding.param_groups())
    mv = slot.memview()
    h = SlotHeader.unpack(mv)
    mv[:64] = SlotHeader(h.step, h.meta_cap, h.meta_len, h.private_len, h.shared_len, crc_private(mv, h),
                         crc_shared(mv, h)).pack()   # sealed as the agent seals it


def _reference(model, opt, path: str) -> None:
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save({"optim": opt.state_dict(), "model": model.module.state_dict()}, path)


def _images(tmp: str, plan, new_rank: int) -> dict[int, bytes]:
    out = {}
    for img in plan.reshard_for(new_rank).images:
        data = open(f"{tmp}/{plan.kind}-from{img.old_rank}.img", "rb").read()
        h = SlotHeader.unpack(data)
        out[img.old_rank] = data if img.own else data[:h.replicated_len]   # a holder has only the prefix
    return out


def _phase(rank: int, world: int, port: int, tmp: str, what: str) -> None:
    model, opt = _setup(rank, world, port)
    if what == "start":                       # 3 ranks train, snapshot, and write the reference
        _train(model, opt, rank, range(3))
        _snapshot(model, opt, f"{tmp}/shrink-from{rank}.img", 3)
        _reference(model, opt, f"{tmp}/ref3.pt")
    else:
        plan = torch.load(f"{tmp}/{what}.plan", weights_only=False)
        extra = reshard(model, opt, _images(tmp, plan, rank), plan.predecessor.get(rank), plan.old.world_size)
        assert extra == {"me": plan.predecessor.get(rank, plan.predecessor[0])}
        _reference(model, opt, f"{tmp}/{what}.pt")
        _train(model, opt, rank, range(3, 5))       # the re-partitioned optimizer steps
        digest = torch.tensor([float(sum(p.double().sum() for p in model.parameters()))])
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, digest.double())
        assert all(torch.equal(every[0], d) for d in every)      # no rank diverged from its DP peers
        if what == "shrink":
            _snapshot(model, opt, f"{tmp}/grow-from{rank}.img", 5)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_state(a: dict, b: dict) -> None:
    assert sorted(a["optim"]["state"]) == sorted(b["optim"]["state"])
    for idx, st in a["optim"]["state"].items():
        assert sorted(st) == sorted(b["optim"]["state"][idx]) == ["exp_avg", "exp_avg_sq", "step"]
        for k, v in st.items():
            assert torch.equal(v, b["optim"]["state"][idx][k]), (idx, k)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


# real processes: three 2-3 rank gloo jobs, forked from this one (spawned, each re-imported torch: 95-210 s)
@pytest.mark.smoke
@pytest.mark.e2e
def test_shrink_then_grow_repartitions_every_shard(tmp_path):
    tmp = str(tmp_path)
    mp.start_processes(_phase, args=(3, _port(), tmp, "start"), nprocs=3, start_method="fork")
    L3 = Layout(3, 1)
    inv = {s: {s: [3]} for s in (0, 2)}
    reps = {h: {r: [3]} for r, hs in place_replicas(L3, 1).items() for h in hs if h != 1}
    shrink = plan_shrink(L3, {1}, inv, reps, place_replicas(L3, 1))
    torch.save(shrink, f"{tmp}/shrink.plan")
    mp.start_processes(_phase, args=(2, _port(), tmp, "shrink"), nprocs=2, start_method="fork")
    ref, got = torch.load(f"{tmp}/ref3.pt"), torch.load(f"{tmp}/shrink.pt")
    _same_state(ref, got)          # all of old rank 1's moments too, from its replica alone
    grow = plan_grow(Layout(2, 1), 1, {0: {0: [5]}, 1: {1: [5]}}, max_nnodes=3)
    torch.save(grow, f"{tmp}/grow.plan")
    mp.start_processes(_phase, args=(3, _port(), tmp, "grow"), nprocs=3, start_method="fork")
    grown = torch.load(f"{tmp}/grow.pt")
    assert grown["model"].keys() == ref["model"].keys()
    assert all(len(st) == 3 for st in grown["optim"]["state"].values())
    assert len(grown["optim"]["state"]) == len(ref["optim"]["state"])


def test_merge_refuses_a_missing_or_doubled_shard():
    with pytest.raises(ReshardError, match=r"old rank\(s\) \[1\]"):
        merge_shards({0: {0: {}}, 2: {1: {}}}, 3)
    with pytest.raises(ReshardError, match="parameter 4 has optimizer state in two"):
        merge_shards({0: {4: {}}, 1: {4: {}}}, 2)

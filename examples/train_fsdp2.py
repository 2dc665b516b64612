"""A tiny transformer trained with FSDP2 (`fully_shard`) - or, with --hsdp, HSDP - and AdamW, deterministically.

Written the way a torchtitan user writes it (a DeviceMesh, `fully_shard` on each block, then on the root),
and runs unmodified under torchrun and under phoenixrun:
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --steps 20 --out A
    phoenixrun --standalone --nnodes 2 --nproc-per-node 2 --spares 1 examples/train_fsdp2.py --steps 20 --out B
    ... --hsdp: a 2-D (replicate, shard) mesh; shards within a group of --shard ranks, replicated across groups
Every rank writes OUT/rank{R}.json: losses and digests of its own parameter shards and optimizer-state shards
(the local tensors of the DTensors), so runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import phoenixrun


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def batch(step: int, dp_rank: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-indexed synthetic data: the same (step, data-parallel rank) always gives the same batch."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_rank)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = local(t).detach().contiguous()
        h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="out")
    p.add_argument("--hsdp", action="store_true", help="HSDP: a (replicate, shard) mesh instead of FSDP's 1-D one")
    p.add_argument("--shard", type=int, default=None, help="HSDP: ranks per shard group (default: LOCAL_WORLD_SIZE)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ctx = phoenixrun.init()
    rank, world = ctx.rank, ctx.world_size
    if args.hsdp:
        shard = args.shard or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if world % shard:
            p.error(f"--shard {shard} does not divide the world size {world}")
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(args.seed)
    model = Transformer(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    progress: dict = {"losses": {}}
    job = phoenixrun.protect(model, opt, state=progress)

    @job.on_restore   # after a recovery (never under plain torchrun, which reruns the script instead)
    def restored(step: int, generation: int) -> None:
        print(f"rank {rank}: restored step {step} in generation {generation}", flush=True)

    step_seconds: dict[int, float] = {}   # the whole iteration, phoenixrun's end-of-step work included (benchmarks)
    for step in job.steps(args.steps):
        t0 = time.perf_counter()
        with job.step(step):
            x, y = batch(step, rank, args)     # every rank is a data-parallel rank under FSDP and HSDP
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            job.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress["losses"][str(step)] = loss.item()
        step_seconds[step] = time.perf_counter() - t0

    state = opt.state_dict()["state"]
    result = {
        "rank": rank, "world_size": world, "steps": args.steps, "hsdp": args.hsdp,
        "losses": [progress["losses"][str(s)] for s in range(args.steps)],
        "param_sha256": digest(model.state_dict().values()),
        "optim_sha256": digest(v for i in sorted(state) for k, v in sorted(state[i].items()) if torch.is_tensor(v)),
        "step_seconds": [step_seconds.get(s) for s in range(args.steps)],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del job, opt, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

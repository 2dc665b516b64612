"""A tiny transformer-style MLP stack trained with 3D parallelism - pipeline x data x tensor - deterministically.

PHOENIX's own setting in miniature, written the way a torchtitan user writes it: one DeviceMesh (pp, dp, tp);
tensor parallelism with `parallelize_module` (Colwise/Rowwise Linear pairs) over `tp`; FSDP2 `fully_shard` over
`dp`, which shards parameters and the optimizer state (ZeRO-3) across data-parallel ranks; pipeline stages with
`torch.distributed.pipelining` (PipelineStage + ScheduleGPipe) over `pp`. Runs unmodified under torchrun and
phoenixrun:
    torchrun --standalone --nproc-per-node 8 examples/train_3d.py --steps 12 --out A
    phoenixrun --standalone --nnodes 4 --nproc-per-node 2 --spares 1 examples/train_3d.py --steps 12 --out B
Rank order is torch's row-major mesh order: tp fastest, then dp, then pp (Megatron's), so with two ranks a node
each node holds one TP pair.

The pipeline schedule keeps per-run state (shapes inferred by its first P2P exchange, buffers); after a hot swap
every rank - survivors and the replacement - rebuilds it (`job.on_restore`), or the stages' first messages would
not match.

Every rank writes OUT/rank{R}.json: losses (last stage) and digests of its own parameter and optimizer-state
shards (the local tensors of the DTensors), so runs can be compared bit for bit.
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
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import phoenixrun


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, the head on the last, its share of the blocks."""

    def __init__(self, args, index: int, stages: int):
        super().__init__()
        per = args.layers // stages
        self.embed = nn.Embedding(args.vocab, args.d_model) if index == 0 else None
        self.blocks = nn.ModuleList(Block(args.d_model) for _ in range(per))
        self.head = nn.Linear(args.d_model, args.vocab, bias=False) if index == stages - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


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


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="out")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ctx = phoenixrun.init()
    rank, world = ctx.rank, ctx.world_size
    if world % (args.pp * args.tp) or args.layers % args.pp:
        p.error(f"world size {world} must be a multiple of pp x tp = {args.pp * args.tp}, and --layers of --pp")
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cpu", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    torch.manual_seed(args.seed + pp_rank)          # each stage its own weights; TP/DP ranks of a stage alike
    model = Stage(args, pp_rank, args.pp)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(b, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    progress: dict = {"losses": {}}
    job = phoenixrun.protect(model, opt, state=progress)

    def schedule(stage_model: torch.nn.Module = model) -> ScheduleGPipe:
        stage = PipelineStage(stage_model, pp_rank, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        return ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    pipe = schedule()

    @job.on_restore   # after a recovery (never under plain torchrun, which reruns the script instead)
    def restored(step: int, generation: int) -> None:
        nonlocal pipe
        pipe = schedule()

    first, last = pp_rank == 0, pp_rank == args.pp - 1
    step_seconds: dict[int, float] = {}   # the whole iteration, phoenixrun's end-of-step work included (benchmarks)
    for step in job.steps(args.steps):
        t0 = time.perf_counter()
        with job.step(step):
            x, y = batch(step, dp_rank, args)
            losses: list[torch.Tensor] = []
            if first:
                pipe.step(x)
            elif last:
                pipe.step(target=y, losses=losses)
            else:
                pipe.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if last:
                loss = torch.stack(losses).mean()
                job.observe_loss(loss)
                progress["losses"][str(step)] = loss.item()
        step_seconds[step] = time.perf_counter() - t0

    state = opt.state_dict()["state"]
    result = {
        "rank": rank, "world_size": world, "steps": args.steps, "pp": args.pp, "tp": args.tp, "dp": dp,
        "losses": [progress["losses"][str(s)] for s in range(args.steps)] if last else [],
        "param_sha256": digest(model.state_dict().values()),
        "optim_sha256": digest(v for i in sorted(state) for k, v in sorted(state[i].items()) if torch.is_tensor(v)),
        "step_seconds": [step_seconds.get(s) for s in range(args.steps)],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del job, opt, model, pipe
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

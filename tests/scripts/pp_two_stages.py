"""Pure pipeline parallelism without a mesh: 2 ranks, rank r is stage r, activations and gradients by send/recv.

Runs under torchrun (--nproc-per-node 2) and phoenixrun (--nnodes 2 --nproc-per-node 1). Without --pp, phoenixrun
takes the two ranks for data-parallel peers, and they are not: each holds a different stage. With --same-init both
stages start from the same weights (the same seed on every rank, as hand-written pipelines often do), so they only
differ once training moved them; otherwise each stage is seeded by its rank.

Writes OUT/rank{R}.json: the stage's parameter digest and losses (stage 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist

import phoenixrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--same-init", action="store_true")
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    ctx = phoenixrun.init()
    rank = ctx.rank
    assert ctx.world_size == 2, "two stages, one rank each"
    torch.manual_seed(0 if args.same_init else 100 + rank)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    opt = torch.optim.SGD(stage.parameters(), lr=0.05)
    progress: dict = {"losses": {}}
    job = phoenixrun.protect(stage, opt, state=progress)
    for step in job.steps(args.steps):
        with job.step(step):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 8, generator=g)
            if rank == 0:
                h = stage(x)
                dist.send(h.detach(), dst=1)
                grad = torch.empty_like(h)
                dist.recv(grad, src=1)
                h.backward(grad)
            else:
                h = torch.empty(4, 8)
                dist.recv(h, src=0)
                h.requires_grad_(True)
                loss = (stage(h) - x).pow(2).mean()
                loss.backward()
                dist.send(h.grad, dst=0)
                progress["losses"][str(step)] = loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.step_seconds:
                time.sleep(args.step_seconds)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in stage.state_dict().values())).hexdigest()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "param_sha256": digest, "losses": progress["losses"]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

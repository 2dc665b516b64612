"""A DDP loop over a DataLoader + DistributedSampler (shuffled, several epochs) with an LR scheduler, written as a
user of the phoenixrun API writes it (docs/porting.md).

  --mode managed   protect(..., data=loader, stateful={"scheduler": sched}); batches from next(job.batches)
  --mode naive     the three documented lines only; the loop keeps its own iterator over the loader, epoch after
                   epoch (the loop of issue 28 that finished on the wrong batches after a hot swap)
  --mode rogue     managed, but a restored process broadcasts once at its first batch, as a library that syncs its
                   random state on its first `next()` does: a collective the survivors never issue
  --workers N      the DataLoader's num_workers
  --compile B      torch.compile the module with backend B before DDP wraps it (nanoGPT's order)
  --compile-ddp B  torch.compile the DDP-wrapped model with backend B (the other order)

Both take the same batches in a fault-free run (torchrun), so one reference serves both. At the end each rank writes
OUT/rank<R>.json: losses, the sample indices of every step's batch, the learning rates, parameter and optimizer
hashes.
"""
import argparse
import hashlib
import itertools
import json
import time
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phoenixrun

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out", required=True)
ap.add_argument("--mode", choices=["managed", "naive", "rogue"], default="managed")
ap.add_argument("--workers", type=int, default=0)
ap.add_argument("--compile", default=None)
ap.add_argument("--compile-ddp", default=None)
ap.add_argument("--samples", type=int, default=64)
ap.add_argument("--progress-dir", default=None, help="append 'step unix_time' per finished step (benchmarks)")
args, _ = ap.parse_known_args()   # the harness's model flags are not this script's

ctx = phoenixrun.init()
rank, world = ctx.rank, ctx.world_size
torch.manual_seed(0)
X = torch.randn(args.samples, 16)
dataset = TensorDataset(X, X.sum(dim=1, keepdim=True), torch.arange(args.samples))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=args.workers)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
if args.compile:
    net = torch.compile(net, backend=args.compile)
model = DDP(net, find_unused_parameters=True)
if args.compile_ddp:
    model = torch.compile(model, backend=args.compile_ddp)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
progress: dict = {"losses": {}, "batches": {}, "lr": {}}

if args.mode in ("managed", "rogue"):
    job = phoenixrun.protect(model, opt, state=progress, data=loader, stateful={"scheduler": sched})
    batches = job.batches
    if args.mode == "rogue" and job.generation > 0:   # a restored process (it joined inside protect())
        def first_sync(it):
            dist.broadcast(torch.zeros(4), src=0)   # a lone collective: only this restored process issues it
            yield from it
        batches = first_sync(batches)
else:
    job = phoenixrun.protect(model, opt, state=progress)

    def epochs():
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader
    batches = epochs()

log = open(os.path.join(args.progress_dir, f"rank{rank}.log"), "a", buffering=1) if args.progress_dir else None
for step in job.steps(args.steps):
    with job.step(step):
        x, y, idx = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress["lr"][str(step)] = sched.get_last_lr()[0]
        sched.step()
        progress["losses"][str(step)] = loss.item()
        progress["batches"][str(step)] = idx.tolist()
        if log:   # a step abandoned for a recovery never gets here (it is replayed)
            log.write(f"{step} {time.time()}\n")

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
momenta = torch.cat([s["momentum_buffer"].flatten() for s in opt.state_dict()["state"].values()])
(out / f"rank{rank}.json").write_text(json.dumps({
    "losses": [progress["losses"][str(s)] for s in range(args.steps)],
    "batches": [progress["batches"][str(s)] for s in range(args.steps)],
    "lr": [progress["lr"][str(s)] for s in range(args.steps)],
    "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "optim_sha256": hashlib.sha256(momenta.numpy().tobytes()).hexdigest(),
    "pid": os.getpid(), "generation": job.generation}))
dist.destroy_process_group()

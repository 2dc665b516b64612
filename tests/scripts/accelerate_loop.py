"""An accelerate training loop opted into hot swap with the adapter (docs/porting.md): a shuffled DataLoader
prepared by accelerate (sharded over the ranks, several epochs), an LR scheduler, accelerator.backward.

At the end each rank writes OUT/rank<R>.json: losses, the sample indices of every step's batch, the learning
rates, parameter and optimizer hashes, its pid and generation.
"""
import argparse
import hashlib
import json
import time
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch.utils.data import DataLoader, TensorDataset

import phoenixrun
import phoenixrun.integrations.accelerate

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out", required=True)
ap.add_argument("--progress-dir", default=None, help="append 'step unix_time' per finished step (benchmarks)")
args, _ = ap.parse_known_args()

phoenixrun.init()   # before Accelerator(): the job's process group is phoenixrun's
accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
torch.manual_seed(0)
X = torch.randn(64, 16)
loader = DataLoader(TensorDataset(X, X.sum(dim=1, keepdim=True), torch.arange(64)), batch_size=4, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
rank = accelerator.process_index
progress: dict = {"losses": {}, "batches": {}, "lr": {}}
job = phoenixrun.integrations.accelerate.protect(accelerator, model, opt, dataloader=loader, scheduler=sched,
                                                 state=progress)
log = open(os.path.join(args.progress_dir, f"rank{rank}.log"), "a", buffering=1) if args.progress_dir else None
for step in job.steps(args.steps):
    with job.step(step):
        x, y, idx = next(job.batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        progress["lr"][str(step)] = sched.get_last_lr()[0]
        sched.step()
        opt.zero_grad()
        progress["losses"][str(step)] = loss.item()
        progress["batches"][str(step)] = idx.tolist()
        if log:   # a step abandoned for a recovery never gets here (it is replayed)
            log.write(f"{step} {time.time()}\n")

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
inner = opt.optimizer.state_dict()["state"]
moments = torch.cat([s[k].flatten() for s in inner.values() for k in ("exp_avg", "exp_avg_sq")])
(out / f"rank{rank}.json").write_text(json.dumps({
    "losses": [progress["losses"][str(s)] for s in range(args.steps)],
    "batches": [progress["batches"][str(s)] for s in range(args.steps)],
    "lr": [progress["lr"][str(s)] for s in range(args.steps)],
    "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "optim_sha256": hashlib.sha256(moments.numpy().tobytes()).hexdigest(),
    "pid": os.getpid(), "generation": job.generation}))
accelerator.end_training()

"""A plain torchrun script: DDP training with gloo, no phoenixrun API (tests of torchrun semantics).

Each rank logs its loss every step and, at the end, writes OUT/rank<R>.json (losses, parameter hash,
attempt). OUT/progress-<R> holds the last step a rank finished, so a test can act mid-training.
  --fail-once RANK   that rank raises at --fail-step on the first attempt only (TORCHELASTIC_RESTART_COUNT 0)
  --step-sleep S     seconds per step (gives a test time to kill something mid-training)
  --stall-init RANK  on a restart, that rank never reaches init_process_group (an attempt that cannot come up)
"""
import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--out", required=True)
ap.add_argument("--fail-once", type=int, default=-1)
ap.add_argument("--fail-step", type=int, default=3)
ap.add_argument("--step-sleep", type=float, default=0.0)
ap.add_argument("--stall-init", type=int, default=-1)
args = ap.parse_args()

if int(os.environ["RANK"]) == args.stall_init and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
    time.sleep(3600)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1000 + rank)
losses = []
for step in range(args.steps):
    x = torch.randn(8, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(round(loss.item(), 6))
    print(f"attempt {attempt} rank {rank} step {step} loss {loss.item():.6f}", flush=True)
    if rank == args.fail_once and attempt == 0 and step == args.fail_step:
        raise RuntimeError(f"rank {rank} fails once at step {step}")
    (out / f"progress-{rank}").write_text(f"{attempt} {step}")
    time.sleep(args.step_sleep)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
(out / f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "world": world, "attempt": attempt, "losses": losses,
    "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "group_rank": os.environ.get("GROUP_RANK"), "node_tag": os.environ.get("NODE_TAG")}))
dist.destroy_process_group()

"""Long steps without the CPU: a DDP model whose backward sleeps between gradient buckets (quiesce tests).

LAYERS linear layers, each DDP bucket one parameter (a tiny bucket cap), and before each layer an identity whose
backward sleeps SLEEP seconds: a step takes about LAYERS x SLEEP seconds, nearly all of it in backward, with a
bucket's all-reduce issued between two sleeps. The sleep changes no number: a run with --sleep 0 (the torchrun
reference) computes the same bits. Runs unmodified under torchrun and under phoenixrun.

Every rank writes OUT/rank{R}.json (losses, step seconds, digests of parameters and optimizer state);
with --progress-dir, PROGRESS/rank{R}.log gets 'step unix_time' per finished step (not an abandoned one) and PROGRESS/start{R}.log
'step unix_time' per started step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import phoenixrun


class Sleep(torch.autograd.Function):
    """Identity forward; its backward sleeps (compute that holds no CPU)."""

    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.seconds:
            time.sleep(ctx.seconds)
        return g, None


class Net(nn.Module):
    def __init__(self, width: int, layers: int, sleep: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.sleep = sleep

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(Sleep.apply(x, self.sleep)))
        return x


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--sleep", type=float, default=1.0, help="seconds each layer's backward sleeps")
    p.add_argument("--progress-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ctx = phoenixrun.init()
    rank = ctx.rank
    torch.manual_seed(0)
    # one parameter a bucket: an all-reduce is issued after each layer's gradients, between two sleeps
    model = DDP(Net(args.width, args.layers, args.sleep), find_unused_parameters=True, bucket_cap_mb=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    progress: dict = {"losses": {}, "step_seconds": {}}
    job = phoenixrun.protect(model, opt, state=progress)
    logs = None
    if args.progress_dir:
        os.makedirs(args.progress_dir, exist_ok=True)
        logs = [open(os.path.join(args.progress_dir, f"{kind}{rank}.log"), "a", buffering=1) for kind in ("start", "rank")]
    for step in job.steps(args.steps):
        t0 = time.perf_counter()
        with job.step(step):
            if logs:
                logs[0].write(f"{step} {time.time():.6f}\n")
            g = torch.Generator().manual_seed(step * 1009 + rank)
            x = torch.randn(16, args.width, generator=g)
            loss = (model(x) - x).pow(2).mean()
            job.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress["losses"][str(step)] = loss.item()
            progress["step_seconds"][str(step)] = time.perf_counter() - t0
        # an abandoned step (a recovery) leaves the `with` too: its loss is not in the restored state
        if logs and str(step) in progress["losses"]:
            logs[1].write(f"{step} {time.time():.6f}\n")
    state = opt.state_dict()["state"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump({"rank": rank, "losses": [progress["losses"][str(s)] for s in range(args.steps)],
                   "step_seconds": [progress["step_seconds"].get(str(s)) for s in range(args.steps)],
                   "param_sha256": digest(model.module.state_dict().values()),
                   "optim_sha256": digest(v for i in sorted(state) for k, v in sorted(state[i].items())
                                          if torch.is_tensor(v)),
                   "pid": os.getpid()}, f)
    os.replace(os.path.join(args.out, f"rank{rank}.json.tmp"), os.path.join(args.out, f"rank{rank}.json"))


if __name__ == "__main__":
    main()

"""A tiny GPT trained with DDP + ZeroRedundancyOptimizer(AdamW) over gloo, deterministically.

Runs unmodified under torchrun and under phoenixrun:
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --steps 20 --out A
    phoenixrun --standalone --nnodes 2 --nproc-per-node 2 examples/train_gpt.py --steps 20 --out B
Every rank writes OUT/rank{R}.json: losses, step times and digests of its parameters and of its
own optimizer shard, so runs can be compared bit for bit.

The per-step losses and times are not kept in the state dict given to protect(): it is encoded with every
snapshot, and a history that grows a line a step made each step slower than the last (docs/api.md, `state`).
Each process appends them to a log of its own under OUT/steps/ (OUT must be shared by the nodes, as it is in
the tests); the state dict holds only the list of the logs its history is in - the logs of the processes it
was restored from, then its own - so a restored or replacement process reads the steps before its restore
from its predecessors' logs, exactly what it would have restored from the state dict.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

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


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.seq = seq

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def batch(step: int, rank: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-indexed synthetic data: the same (step, rank) always gives the same batch."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()


def save_checkpoint(args, rank: int, step: int, model, opt, progress: dict) -> None:
    """Baseline checkpoint-restart: every rank saves its state; rank 0 marks the step complete."""
    d = os.path.join(args.ckpt_dir, f"step{step}")
    os.makedirs(d, exist_ok=True)
    state = {"model": model.module.state_dict(), "optim": opt.optim.state_dict(), "rng": torch.get_rng_state(),
             "progress": progress}
    torch.save(state, os.path.join(d, f"rank{rank}.pt.tmp"))
    os.replace(os.path.join(d, f"rank{rank}.pt.tmp"), os.path.join(d, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        open(os.path.join(d, "complete"), "w").close()


def load_checkpoint(args, rank: int, model, opt, progress: dict) -> int:
    done = [int(n[4:]) for n in os.listdir(args.ckpt_dir) if n.startswith("step")
            and os.path.exists(os.path.join(args.ckpt_dir, n, "complete"))] if os.path.isdir(args.ckpt_dir) else []
    if not done:
        return 0
    step = max(done)
    state = torch.load(os.path.join(args.ckpt_dir, f"step{step}", f"rank{rank}.pt"), weights_only=False)
    model.module.load_state_dict(state["model"])
    opt.optim.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    progress.update(state["progress"])
    return step


class StepLog:
    """This process's per-step losses and times, appended to OUT/steps/rank{R}.{pid}.jsonl, one write() a line
    (a process killed mid-step leaves whole lines). `logs`: the chain in the state dict, oldest first."""

    def __init__(self, out: str, rank: int, logs: list):
        os.makedirs(os.path.join(out, "steps"), exist_ok=True)
        self.path = os.path.join(out, "steps", f"rank{rank}.{os.getpid()}.jsonl")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.logs = logs
        self.joined()

    def joined(self) -> None:
        """At the start and after every restore (the state dict, and with it the chain, came from a snapshot)."""
        if self.path not in self.logs:
            self.logs.append(self.path)

    def write(self, step: int, key: str, value: float) -> None:
        os.write(self.fd, (json.dumps({"step": step, key: value}) + "\n").encode())

    def read(self, key: str) -> dict[int, float]:
        """step -> the last value written for it along the chain (a replayed step's is the later)."""
        out: dict[int, float] = {}
        for path in self.logs:
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    if key in rec:
                        out[rec["step"]] = rec[key]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint-restart baseline: save here every --ckpt-every steps")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--progress-dir", default=None, help="append 'step unix_time' per finished step (benchmarks)")
    p.add_argument("--raise-at", type=int, default=None, help="fault drill: rank 0 raises a user error at this step")
    p.add_argument("--nan-at", type=int, default=None, help="fault drill: rank 0's loss is NaN at this step")
    p.add_argument("--crash-at", type=int, default=None,
                   help="fault drill: rank 0 kills itself (SIGKILL) whenever it reaches this step")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="test pacing: each step lasts at least this long (a sleep after it; changes no number)")
    p.add_argument("--state-growth", type=int, default=0, metavar="BYTES",
                   help="test: grow the state dict given to protect() by BYTES a step (snapshots must grow)")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ctx = phoenixrun.init()
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(args.seed)
    model = DDP(GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq), find_unused_parameters=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    progress: dict = {"logs": [], **({"pad": {}} if args.state_growth else {})}
    job = phoenixrun.protect(model, opt, state=progress)
    start = load_checkpoint(args, rank, model, opt, progress) if args.ckpt_dir else 0
    steps_log = StepLog(args.out, rank, progress["logs"])

    @job.on_restore   # after a recovery (never under plain torchrun, which reruns the script instead)
    def restored(step: int, generation: int) -> None:
        steps_log.logs = progress["logs"]   # the restored chain (the state dict was refilled)
        steps_log.joined()
        print(f"rank {rank}: restored step {step} in generation {generation}", flush=True)
    log = open(os.path.join(args.progress_dir, f"rank{rank}.log"), "a", buffering=1) if args.progress_dir else None

    for step in job.steps(args.steps):
        if step < start:
            continue
        t0, done = time.perf_counter(), -1
        with job.step(step):
            if step == args.crash_at and rank == 0:   # a fault that comes back however often it is recovered
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.raise_at and rank == 0:
                raise ValueError(f"fault drill: user error at step {step}")
            x, y = batch(step, rank, args)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if step == args.nan_at and rank == 0:
                loss = loss * float("nan")
            job.observe_loss(loss)   # a NaN/inf loss stops the job before any rank applies this step
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps_log.write(step, "loss", loss.item())
            done = step
            if args.state_growth:
                progress["pad"][str(step)] = (f"{step:08d}" * (args.state_growth // 8 + 1))[:args.state_growth]
        if args.step_seconds:
            time.sleep(max(0.0, args.step_seconds - (time.perf_counter() - t0)))
        # the whole iteration, including phoenixrun's end-of-step work
        if done == step:   # not a step abandoned for a recovery (it is replayed)
            steps_log.write(step, "step_seconds", time.perf_counter() - t0)
        if log and done == step:
            log.write(f"{step} {time.time():.6f}\n")
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args, rank, step + 1, model, opt, progress)

    shard = opt.optim.state_dict()["state"]
    losses, step_seconds = steps_log.read("loss"), steps_log.read("step_seconds")
    result = {
        "rank": rank, "world_size": world, "steps": args.steps,
        "losses": [losses[s] for s in range(args.steps)],
        "step_seconds": [step_seconds.get(s) for s in range(args.steps)],
        # the JSON of the state dict at the end: the same size at any step count, whatever the run's length
        "state_bytes": len(json.dumps({k: v for k, v in progress.items() if k != "pad"})),
        "param_sha256": digest(model.module.state_dict().values()),
        "optim_sha256": digest(v for i in sorted(shard) for k, v in sorted(shard[i].items()) if torch.is_tensor(v)),
        # this rank's ZeRO shard: how many parameters' worth of Adam moments it holds, and their step counts (a
        # parameter whose state was lost and recreated on the way would count fewer steps)
        "optim_numel": sum(s["exp_avg"].numel() for s in shard.values() if "exp_avg" in s),
        "optim_steps": sorted({int(s["step"]) for s in shard.values() if "step" in s}),
        "param_numel": sum(p.numel() for p in model.module.parameters()),
    }
    if args.state_growth:   # what was restored of the state dict (timings aside) must match an unprotected run
        kept = {"pad": progress["pad"]}
        result["state_sha256"] = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Free DDP/ZeRO (and the gloo work they hold) while the process group is still up: left to
    # interpreter teardown, gloo occasionally aborted the process at exit (SIGABRT).
    del job, opt, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

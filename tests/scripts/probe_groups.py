"""Probe: results of collectives and P2P on subgroups and on a 2x2 DeviceMesh's dimensions, every step.

For 4 ranks (phoenixrun: 2 nodes x 2; or torchrun --nproc-per-node 4). Each step runs every check
below and compares the result with the value computed by hand; the values depend on the step, so a
stale or wrong result cannot pass by accident. A tiny DDP model is protected so that a node kill
is a hot swap: the checks after the recovery run on the rebuilt groups.

Writes OUT/rank{R}.json: {"checks": n run, "failures": [...], "steps": [...], "mesh_names": ...}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import phoenixrun


def checks(rank: int, step: int, pairs: dict, mesh) -> list[tuple[str, object, object]]:
    """(name, got, expected) for every entry point on this rank's groups at `step`."""
    out = []
    v = float(step * 10 + rank + 1)                 # this rank's value at this step
    members = pairs["row"]                          # [0, 1] or [2, 3]: ranks on the same node
    g = pairs["row_group"]
    peer = members[1] if rank == members[0] else members[0]
    vals = {r: float(step * 10 + r + 1) for r in range(4)}

    t = torch.tensor([v])
    dist.all_reduce(t, group=g)
    out.append(("all_reduce(row)", t.item(), vals[members[0]] + vals[members[1]]))

    col = pairs["col"]                              # [0, 2] or [1, 3]: across the nodes
    t = torch.tensor([v])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pairs["col_group"])
    out.append(("all_reduce_max(col)", t.item(), max(vals[c] for c in col)))

    o = torch.zeros(2)
    dist.all_gather_into_tensor(o, torch.tensor([v]), group=g)
    out.append(("all_gather_into_tensor", o.tolist(), [vals[m] for m in members]))

    lst = [torch.zeros(1) for _ in members]
    dist.all_gather(lst, torch.tensor([v]), group=g)
    out.append(("all_gather", [x.item() for x in lst], [vals[m] for m in members]))

    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.tensor([v, 2 * v]), group=g)
    me = members.index(rank)
    out.append(("reduce_scatter_tensor", rs.item(), sum(vals[m] * (me + 1) for m in members)))

    a2a = torch.zeros(2)
    dist.all_to_all_single(a2a, torch.tensor([v, -v]), group=g)
    out.append(("all_to_all_single", a2a.tolist(), [vals[m] * (1 if me == 0 else -1) for m in members]))

    outs = [torch.zeros(1) for _ in members]
    dist.all_to_all(outs, [torch.tensor([v + i]) for i in range(2)], group=g)
    out.append(("all_to_all", [x.item() for x in outs], [vals[m] + me for m in members]))

    b = torch.tensor([v])
    dist.broadcast(b, src=members[1], group=g)
    out.append(("broadcast(src=global)", b.item(), vals[members[1]]))

    r = torch.tensor([v])
    dist.reduce(r, dst=members[0], group=g)
    if rank == members[0]:
        out.append(("reduce", r.item(), vals[members[0]] + vals[members[1]]))

    sc = torch.zeros(1)
    dist.scatter(sc, [torch.tensor([100.0 + step]), torch.tensor([200.0 + step])] if rank == members[0] else None,
                 src=members[0], group=g)
    out.append(("scatter", sc.item(), (100.0 if me == 0 else 200.0) + step))

    ga = [torch.zeros(1) for _ in members] if rank == members[1] else None
    dist.gather(torch.tensor([v]), ga, dst=members[1], group=g)
    if ga is not None:
        out.append(("gather", [x.item() for x in ga], [vals[m] for m in members]))

    buf = torch.zeros(1)
    if me == 0:
        dist.send(torch.tensor([v]), dst=peer, group=g)
        dist.recv(buf, src=peer, group=g)
    else:
        dist.recv(buf, src=peer, group=g)
        dist.send(torch.tensor([v]), dst=peer, group=g)
    out.append(("send/recv", buf.item(), vals[peer]))

    buf = torch.zeros(1)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([v]), peer, group=g),
                                   dist.P2POp(dist.irecv, buf, peer, group=g)])
    for q in reqs:
        q.wait()
    out.append(("batch_isend_irecv", buf.item(), vals[peer]))

    objs = [None, None]
    dist.all_gather_object(objs, {"r": rank, "s": step}, group=g)
    out.append(("all_gather_object", objs, [{"r": m, "s": step} for m in members]))

    dist.barrier(group=g)

    # the mesh: dims ("node", "local"); "local" groups are the rows, "node" groups the columns
    for dim, expect_members in (("local", members), ("node", col)):
        mg = mesh.get_group(dim)
        t = torch.tensor([v])
        dist.all_reduce(t, group=mg)
        out.append((f"mesh[{dim}].all_reduce", t.item(), sum(vals[m] for m in expect_members)))
        out.append((f"mesh[{dim}].ranks", dist.get_process_group_ranks(mg), expect_members))
    t = torch.tensor([v])
    dist.all_reduce(t)                               # and the world still works
    out.append(("world.all_reduce", t.item(), sum(vals.values())))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (time for a kill to land)")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)   # reduce_scatter_tensor etc.: the names scripts use
    ctx = phoenixrun.init()
    rank, world = ctx.rank, ctx.world_size
    assert world == 4, "the probe is written for 4 ranks"
    row = [0, 1] if rank < 2 else [2, 3]
    col = [0, 2] if rank % 2 == 0 else [1, 3]
    groups = {tuple(rs): dist.new_group(rs) for rs in ([0, 1], [2, 3], [0, 2], [1, 3])}
    pairs = {"row": row, "col": col, "row_group": groups[tuple(row)], "col_group": groups[tuple(col)]}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 4), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    progress: dict = {"checks": 0, "failures": [], "steps": []}
    job = phoenixrun.protect(model, opt, state=progress)
    for step in job.steps(args.steps):
        with job.step(step):
            model(torch.full((2, 4), float(step))).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for name, got, want in checks(rank, step, pairs, mesh):
                progress["checks"] += 1
                if got != want:
                    progress["failures"].append(f"step {step} {name}: got {got}, expected {want}")
            progress["steps"].append(step)
            if args.step_seconds:
                time.sleep(args.step_seconds)
    result = {**progress, "rank": rank, "generation": getattr(ctx, "generation", None),
              "mesh_names": [mesh.get_group(d).group_name for d in ("node", "local")]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    del job, opt, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What protect() refuses and what it lets a recovery take from a peer: table tests of the pure decisions, the facts
read from real FSDP2/TP/DDP objects, and a property over random layouts and flags: shared state is only ever
fetched from a true replica. End to end (a pipeline whose stages the plan takes for DP peers):
tests/test_restore_integrity.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.runtime.layout_check import (DTensorFacts, LayoutFacts, describe, dp_groups, local_refusal,
                                             peer_mismatch, unshared_reason, verdict)
from phoenixrun.redundancy import Mesh
from phoenixrun.topology import Layout

FSDP2 = DTensorFacts("model/0.weight", ("dp_shard",), ("Shard(dim=0)",))
HSDP = DTensorFacts("model/0.weight", ("replicate", "shard"), ("Replicate()", "Shard(dim=0)"))
TP = DTensorFacts("model/w1.weight", ("tp",), ("Shard(dim=1)",))
REPL = DTensorFacts("model/b", ("dp",), ("Replicate()",))
PARTIAL = DTensorFacts("optim/3/exp_avg", ("tp",), ("Partial(sum)",))
MESH_DP_TP = Mesh(("dp", "tp"), (2, 2), (0, 1, 2, 3))


def assert_reason(got: str | None, expect: str | None) -> None:
    """None expected: no reason; else a reason matching the pattern `expect`."""
    if expect is None:
        assert got is None, got
    else:
        assert got is not None and re.search(expect, got), got


@pytest.mark.parametrize("facts, expect", [
    # plain DDP, DDP over a subgroup, a plain module: nothing that no snapshot can restore
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1, 2, 3), plan_peers=(0, 1, 2, 3)), None),
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1), plan_peers=(0, 1, 2, 3)), None),
    (LayoutFacts(0, "Sequential", plan_peers=(0, 1)), None),
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1), plan_peers=(0, 1), local_stats=("module.1",)), None),
    # DTensor state (FSDP2, HSDP, TP, replicated DTensors): every local shard is rank-private, never taken from a peer
    (LayoutFacts(0, "FSDPModule", dtensors=(FSDP2,), plan_peers=(0, 1)), None),
    (LayoutFacts(0, "FSDPModule", dtensors=(HSDP, FSDP2), plan_peers=(0, 1)), None),
    (LayoutFacts(0, "Transformer", dtensors=(TP,), plan_peers=(0, 1)), None),
    (LayoutFacts(0, "Module", dtensors=(REPL,), plan_peers=(0, 1)), None),
    # a pending reduction is not state: refused, naming the tensor
    (LayoutFacts(0, "Module", dtensors=(FSDP2, PARTIAL), plan_peers=(0, 1)),
     r"optim/3/exp_avg is a DTensor with a pending reduction; placements \(Partial\(sum\)\).*Redistribute"),
    (LayoutFacts(0, "FullyShardedDataParallel", plan_peers=(0, 1)), r"FSDP \(FullyShardedDataParallel\).*collective"),
    # --tp/--pp are unnecessary with a mesh; given, they must agree with its dimensions
    (LayoutFacts(0, "Module", dtensors=(TP,), meshes=(MESH_DP_TP,), tp=2), None),
    (LayoutFacts(0, "Module", dtensors=(TP,), meshes=(MESH_DP_TP,), tp=1, pp=2), None),      # no 'pp' dimension
    (LayoutFacts(0, "Module", dtensors=(TP,), meshes=(MESH_DP_TP,), tp=4),
     r"--tp 4 contradicts the script's device mesh, whose 'tp' dimension has size 2; leave --tp out"),
])
def test_local_refusal(facts, expect):
    got = local_refusal(facts)
    assert_reason(got, expect)
    if expect is not None:
        assert "PHOENIXRUN_PROTECT=0" in got and "torchrun" in got      # the way out is always named




@pytest.mark.parametrize("facts, expect", [
    # plain DDP over the world, no flags: every rank is a DP peer of every other, DDP replicates over all: shared
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1, 2, 3), plan_peers=(0, 1, 2, 3)), None),
    # DDP over a DP subgroup with matching --pp 2: the plan's peers are inside DDP's group
    (LayoutFacts(1, "DistributedDataParallel", ddp_group=(1, 3), plan_peers=(1, 3), flags="--tp 1 --pp 2"), None),
    # DDP over the world with --tp 2: the plan's peers are a subset of DDP's replicas: still identical bytes
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1, 2, 3), plan_peers=(0, 2), flags="--tp 2 --pp 1"),
     None),
    # a plain module (hand-written pipeline, manual all-reduce): nothing proves its peers hold its bytes
    (LayoutFacts(0, "Sequential", plan_peers=(0, 1)), r"Sequential, not DDP.*ranks \[0, 1\]"),
    # DDP over a mesh dimension without --tp/--pp: ranks 2, 3 are "peers" of rank 0 but hold another stage/shard
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1), plan_peers=(0, 1, 2, 3)),
     r"DDP on rank 0 replicates over ranks \[0, 1\].*--tp 1 --pp 1.*ranks \[0, 1, 2, 3\].*rank\(s\) \[2, 3\]"),
    # BatchNorm statistics are each rank's own
    (LayoutFacts(0, "DistributedDataParallel", ddp_group=(0, 1), plan_peers=(0, 1), local_stats=("module.1",)),
     r"\['module.1'\] keep running statistics.*SyncBatchNorm"),
])
def test_unshared_reason(facts, expect):
    assert_reason(unshared_reason(facts), expect)


@pytest.mark.parametrize("checksums, groups, expect", [
    ([7, 7, 7, 7], [(0, 1, 2, 3)], None),
    ([7, 9, 7, 9], [(0, 2), (1, 3)], None),                  # --tp 2: each class identical, classes differ: fine
    ([7, 9], [(0, 1)], r"ranks \[0, 1\] are data-parallel peers.*\[0\] vs \[1\]"),   # pure PP, 2 stages
    ([7, 7, 9, 9], [(0, 1, 2, 3)], r"\[0, 1\] vs \[2, 3\]"),  # PP 2 x DP 2 without --pp
    ([7, 7, 7, 8], [(0, 2), (1, 3)], r"ranks \[1, 3\]"),
])
def test_peer_mismatch(checksums, groups, expect):
    assert_reason(peer_mismatch(checksums, groups), expect)


# expected: (refusal pattern, peer_shared, private_why pattern); None patterns: no reason at all
@pytest.mark.parametrize("own, refused, checksums, unshared, refusal, shared, why", [
    (None, [], [1, 1], [], None, True, None),                                   # DDP replicas: shared
    ("mine", [], [1, 2], [], "^mine$", False, None),                            # its own reason first
    (None, [1], [1, 1], [], r"rank\(s\) \[1\] cannot be protected", False, None),   # another refused: stop too
    (None, [], [1, 2], [], None, False, "different parameters"),               # peers differ: private, not refused
    (None, [], [1, 1], [(1, "not DDP")], None, False, "^rank 1: not DDP$"),     # one rank unproven: all private
])
def test_verdict_is_the_same_decision_on_every_rank(own, refused, checksums, unshared, refusal, shared, why):
    got = verdict(own, refused, checksums, [(0, 1)], unshared)
    assert_reason(got.refusal, refusal)
    assert got.peer_shared is shared
    assert_reason(got.private_why, why)


@pytest.mark.parametrize("layout, expect", [
    (Layout(2, 2), [(0, 1, 2, 3)]),
    (Layout(2, 2, tp=2), [(0, 2), (1, 3)]),
    (Layout(2, 2, pp=2), [(0, 1), (2, 3)]),
    (Layout(2, 1), [(0, 1)]),
])
def test_dp_groups_follow_the_plan(layout, expect):
    assert dp_groups(layout.world_size, layout.dp_peers) == expect


def test_describe_names_the_layout():
    assert "FSDP2" in describe(FSDP2) and "HSDP" in describe(HSDP) and "pending reduction" in describe(PARTIAL)


OBSERVE = textwrap.dedent("""
    import json, os, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.nn.parallel import DistributedDataParallel as DDP
    from phoenixrun.runtime.layout_check import observe, local_refusal, describe, unshared_reason
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    def check(name, m):
        f = observe(m, torch.optim.SGD(m.parameters(), lr=0.1), 0, [], "--tp 1 --pp 1")
        out[name] = {"refusal": local_refusal(f), "described": [describe(d) for d in f.dtensors],
                     "unshared": unshared_reason(f)}
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    from torch.distributed.fsdp import fully_shard
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(m, mesh=mesh)
    check("fsdp2", m)
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    tp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    t = parallelize_module(torch.nn.Linear(4, 4), tp_mesh, ColwiseParallel())
    check("tp", t)
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tf = parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh2["tp"], {"0": ColwiseParallel()})
    fully_shard(tf, mesh=mesh2["dp"])
    check("tp_fsdp2", tf)
    out["tp_flag"] = local_refusal(observe(tf, torch.optim.SGD(tf.parameters(), lr=0.1), 0, [], "--tp 2 --pp 1",
                                           tp=2, pp=1))
    p = torch.nn.Linear(4, 4)
    p.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 4), tp_mesh, [Partial()]))
    check("partial", p)
    b = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    check("bn", b)
    s = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4),   # DDP wraps SyncBatchNorm on GPU only
                            torch.nn.BatchNorm1d(4, track_running_stats=False))
    check("syncbn", s)
    d = DDP(torch.nn.Linear(4, 4))
    check("ddp", d)
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_facts_are_read_from_real_fsdp2_tp_and_ddp_objects(tmp_path):
    """One process, a world of 1 (gloo): the facts and the refusal come from the objects torch builds, not a fake."""
    r = subprocess.run([sys.executable, "-c", OBSERVE], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # DTensor state is protected (rank-private shards): seen, described, not refused
    assert out["fsdp2"]["refusal"] is None and len(out["fsdp2"]["described"]) == 2
    assert "FSDP2" in out["fsdp2"]["described"][0] and "Shard(dim=0)" in out["fsdp2"]["described"][0]
    assert out["tp"]["refusal"] is None and "Shard(dim=0)" in out["tp"]["described"][0]
    assert out["tp_fsdp2"]["refusal"] is None
    assert "--tp 2 contradicts the script's device mesh, whose 'tp' dimension has size 1" in out["tp_flag"]
    assert "sharded over ['dp', 'tp']" in out["tp_fsdp2"]["described"][0]   # _StridedShard counted as a shard
    assert "model/weight is a DTensor with a pending reduction" in out["partial"]["refusal"], out["partial"]
    assert out["bn"]["refusal"] is None and "['module.1'] keep running statistics" in out["bn"]["unshared"], out["bn"]
    assert out["syncbn"]["refusal"] is None and out["ddp"]["refusal"] is None and out["ddp"]["unshared"] is None
    assert "not DDP" in out["syncbn"]["unshared"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _jobs(draw):
    """A job: nodes x ranks, the script's real (tp, pp) layout (its DDP groups: ranks at the same tp/pp coordinate,
    or no DDP at all), the --tp/--pp flags the user gave (right or wrong), whether every rank starts from the same
    weights (stages seeded alike: equal at protect(), different later), a failed node set."""
    nnodes, nproc = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    world = nnodes * nproc
    real_tp = draw(st.sampled_from(_divisors(world)))
    real_pp = draw(st.sampled_from(_divisors(world // real_tp)))
    flag_tp = draw(st.sampled_from(_divisors(world)))
    flag_pp = draw(st.sampled_from(_divisors(world // flag_tp)))
    ddp, same_init = draw(st.booleans()), draw(st.booleans())
    lost = draw(st.sets(st.integers(0, nnodes - 1), min_size=1, max_size=nnodes - 1))
    return Layout(nnodes, nproc, real_tp, real_pp), Layout(nnodes, nproc, flag_tp, flag_pp), ddp, same_init, lost


@given(_jobs())
@settings(max_examples=300, deadline=None)
def test_shared_state_is_only_ever_fetched_from_a_rank_holding_the_same_bytes(job):
    """Whatever the script's real layout and whatever --tp/--pp say: when the decision every rank takes makes plain
    state shared, the recovery plan's source for every lost rank's shared region is a true replica of it (the same
    DDP group, the same real stage and TP shard); otherwise the shared region is empty and nothing is fetched from a
    peer that matters."""
    from phoenixrun.control.state import NodeRecord, Role, plan_recovery
    from phoenixrun.topology import place_replicas
    real, flags, ddp, same_init, lost = job
    world = real.world_size
    key = lambda r: (real.coords(r).tp, real.coords(r).pp)                       # noqa: E731 - what DDP replicates
    group_of = {r: tuple(p for p in range(world) if key(p) == key(r)) for r in range(world)}
    facts = [LayoutFacts(r, "DistributedDataParallel" if ddp else "Stage", ddp_group=group_of[r] if ddp else None,
                         plan_peers=tuple(sorted({r, *flags.dp_peers(r)})), flags=f"--tp {flags.tp} --pp {flags.pp}")
             for r in range(world)]
    # at protect(): replicas' bytes equal, other stages' differ - unless all were seeded alike
    checksums = [0 if same_init else hash(key(r)) for r in range(world)]
    unshared = [(f.rank, why) for f in facts if (why := unshared_reason(f))]
    decided = verdict(None, [], checksums, dp_groups(world, flags.dp_peers), unshared)
    assert decided.refusal is None
    if not decided.peer_shared:
        return
    nodes = {f"n{s}": NodeRecord(f"n{s}", "h", 1, f"n{s}:1", f"n{s}", Role.ACTIVE, slot=s,
                                 snapshots={r: [5] for r in flags.ranks_of_slot(s)},
                                 replicas={r: [5] for r in range(world)}) for s in range(real.nnodes)}
    spares = {s: f"spare{s}" for s in lost}
    nodes.update({nid: NodeRecord(nid, "h", 1, f"{nid}:1", nid, Role.SPARE) for nid in spares.values()})
    try:
        plan = plan_recovery(flags, nodes, {s: f"n{s}" for s in range(real.nnodes)}, lost,
                             place_replicas(flags, 1), spares)
    except Exception:                                             # no surviving peer: a refusal, never a restore
        return
    for r, src in plan.fetch.items():
        assert src.shared_rank in group_of[r] and src.shared_rank != r and key(src.shared_rank) == key(r)

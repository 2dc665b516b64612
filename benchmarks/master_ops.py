"""Two of the master's O(nodes) operations, timed in-process with nothing else running.

- registration: `Master.register` for N nodes + 1 spare (what a job's start costs the master), per node;
- a heartbeat: `Master.heartbeat` with the agent's payload (4 ranks x 2 snapshot steps, replicas, protection
  figures), parsing and validation included, per call (the handler the master runs 16K times a second);
- the recovery plan: `plan_recovery` over N nodes x 4 ranks with one slot lost and a spare to fill it,
  every rank holding the same two snapshot steps (as in the scale test).

    python benchmarks/master_ops.py [--nodes 16384] [--repeat 5]

Runs unchanged against older commits (same functions), to compare before and after a change.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from phoenixrun.config import MasterConfig
from phoenixrun.control.master import Master
from phoenixrun.control.state import NodeRecord, Role, plan_recovery
from phoenixrun.topology import Layout, place_replicas

NPROC = 4


def time_registration(n: int) -> float:
    """Seconds per registration of n + 1 agents into a fresh master (not started: no sockets)."""
    with tempfile.TemporaryDirectory(prefix="phoenixrun-ops-") as tmp:
        m = Master(MasterConfig.build(run_dir=Path(tmp), nnodes=n, nproc_per_node=NPROC), "secret")
        m.store_port = 1
        t0 = time.perf_counter()
        for i in range(n + 1):
            m.register({"node_id": f"n{i}", "host": "127.0.0.1", "agent_pid": 0, "peer_addr": "127.0.0.1:1"})
        took = time.perf_counter() - t0
        m.events.close()
    return took / (n + 1)


def time_heartbeat(n: int, repeat: int) -> float:
    """Seconds per `Master.heartbeat` of n registered nodes (best of `repeat` rounds over every node)."""
    with tempfile.TemporaryDirectory(prefix="phoenixrun-ops-") as tmp:
        m = Master(MasterConfig.build(run_dir=Path(tmp), nnodes=n, nproc_per_node=NPROC), "secret")
        m.store_port = 1
        payloads = []
        for i in range(n):
            reply = m.register({"node_id": f"n{i}", "host": "127.0.0.1", "agent_pid": 0, "peer_addr": "127.0.0.1:1"})
            ranks = [str(i * NPROC + r) for r in range(NPROC)]
            payloads.append({"node_id": f"n{i}", "token": reply.get("token"), "worker_pids": [1, 2, 3, 4],
                             "snapshots": {r: [5, 6] for r in ranks}, "replicas": {str((i + 1) % n * NPROC): [5, 6]},
                             "protection": {r: {"committed_step": 6, "h2h_s": 0.001, "replicated_bytes": 1 << 20}
                                            for r in ranks}, "api": True})
        best = float("inf")
        for _ in range(repeat):   # CPU time: on a shared machine wall time measured the neighbours (no threads here)
            t0 = time.process_time()
            for p in payloads:
                m.heartbeat(p)
            best = min(best, time.process_time() - t0)
        m.events.close()
    return best / n


def time_plan(n: int, repeat: int) -> float:
    """Seconds for one plan of a lost slot at n nodes (best of `repeat`)."""
    layout = Layout(n, NPROC)
    placement = place_replicas(layout, 1)
    holds: dict[int, list[int]] = {}
    for rank, holders in placement.items():
        for h in holders:
            holds.setdefault(h, []).append(rank)
    nodes, slots = {}, {}
    for s in range(n + 1):
        nid = f"n{s}"
        nodes[nid] = NodeRecord(node_id=nid, host="h", agent_pid=0, peer_addr=f"h:{s}", fault_domain=nid,
                                role=Role.ACTIVE if s < n else Role.SPARE, slot=s if s < n else None)
        if s < n:
            slots[s] = nid
            nodes[nid].snapshots = {r: [5, 6] for r in layout.ranks_of_slot(s)}
            nodes[nid].replicas = {r: [5, 6] for r in holds.get(s, [])}
    slots[1] = f"n{n}"                                   # slot 1 lost, the spare promoted into it
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_recovery(layout, nodes, slots, {1}, placement, {1: f"n{n}"})
        best = min(best, time.perf_counter() - t0)
    assert plan.restore_step == 6
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    if args.nodes < 2:
        p.error("--nodes must be >= 2")
    print(f"{args.nodes} nodes x {NPROC} ranks: registration {1e6 * time_registration(args.nodes):.1f} us per "
          f"node; heartbeat {1e6 * time_heartbeat(args.nodes, args.repeat):.1f} us CPU per call (best of {args.repeat} "
          f"rounds); plan of one lost slot {1e3 * time_plan(args.nodes, args.repeat):.1f} ms (best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

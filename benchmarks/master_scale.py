"""The master at scale: 16,384 simulated agents (one asyncio process) against a real `phoenixrun master`.

Reports the master's CPU (cores) and RSS in steady state (1 Hz heartbeats, every agent parked in a
directive long-poll), then fails one node and times detection, the quiesce broadcast to every
survivor, the plan, the restore and resume broadcasts (the simulated agents ack at once, so these
are the control plane's own times) - each broadcast both until the master sent it to the last
agent and until the load generator read it there. Goal: <= 1 core in steady state, plan +
broadcast < 1 s.

    python benchmarks/master_scale.py [--nodes 16384] [--nproc 4] [--steady 10] [--fault kill|silent]
        [--relay-threshold N] [--direct-heartbeats] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from phoenixrun.sim.master_load import LoadTestConfig, LoadTestError, run_load_test
from phoenixrun.sim.swarm import FAULTS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16384, help="active nodes (one spare more registers)")
    p.add_argument("--nproc", type=int, default=4, help="ranks per node (size of each inventory)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat period, s")
    p.add_argument("--node-timeout", type=float, default=5.0, help="master --node-timeout, s (its default)")
    p.add_argument("--steady", type=float, default=10.0, help="steady-state measurement window, s")
    p.add_argument("--hb-connections", type=int, default=1024, help="shared heartbeat connections")
    p.add_argument("--fault", choices=FAULTS, default="kill",
                   help="kill: the failed agent's connections close and its port refuses, as when its process dies; "
                        "silent: a hung host, connections open, it just stops answering")
    p.add_argument("--relay-threshold", type=int, default=None,
                   help="the master's --relay-threshold (default: its own; 0: every agent polls the master)")
    p.add_argument("--direct-heartbeats", action="store_true",
                   help="every simulated agent heartbeats the master directly, not through its relay (A/B)")
    p.add_argument("--json", default=None)
    p.add_argument("--run-dir", default=None, help="keep the master's log and events here (default: a temp dir)")
    args = p.parse_args()
    if args.nodes < 2:
        p.error("--nodes must be >= 2")
    with tempfile.TemporaryDirectory(prefix="phoenixrun-scale-") as tmp:
        cfg = LoadTestConfig(run_dir=Path(args.run_dir or tmp), nodes=args.nodes, nproc_per_node=args.nproc,
                             heartbeat_s=args.heartbeat, node_timeout_s=args.node_timeout, steady_s=args.steady,
                             hb_connections=args.hb_connections, fault=args.fault,
                             relay_threshold=args.relay_threshold, relay_heartbeats=not args.direct_heartbeats)
        try:
            r = run_load_test(cfg)
        except LoadTestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    s, rec = r["steady"], r["recovery"]
    print(f"{r['agents']} simulated agents ({args.nodes} active x {args.nproc} ranks + spare), "
          f"registered in {r['register_s']:.1f} s, all running {r['start_s']:.1f} s later")
    print(f"steady state ({s['window_s']} s): master {s['master_cores']:.2f} cores, RSS {s['master_rss_mb']} MB, "
          f"{s['master_fds']} fds; {s['heartbeats_per_s']:.0f} heartbeats/s ({s['relayed_heartbeats']} through the "
          f"relays; {s['heartbeat_requests_per_s']:.0f} requests/s), direct latency p50 {s['heartbeat_p50_ms']} ms "
          f"p99 {s['heartbeat_p99_ms']} ms; load generator {s['swarm_cores']:.2f} cores")
    print(f"failure ({args.fault}) of {rec['failed_node']} (slot {rec['failed_slot']}): detected "
          f"{rec['detect_after_fault_s']:.3f} s after the fault, {rec['detect_s']:.3f} s after its last heartbeat "
          f"(--node-timeout {args.node_timeout:g} s); by: {rec['detected_by']}; ring watchers' suspect reports: "
          f"{rec['suspect_reports']}")
    print(f"  quiesce broadcast sent {rec['quiesce_sent_s']:.3f} s (read: half {rec['quiesce_broadcast_p50_s']:.3f} s, "
          f"all {rec['quiesce_broadcast_s']:.3f} s), acks {rec['quiesce_acks_s']:.3f} s, plan {rec['plan_s']:.3f} s, "
          f"restore sent {rec['restore_sent_s']:.3f} s (read: half {rec['restore_broadcast_p50_s']:.3f} s, "
          f"all {rec['restore_broadcast_s']:.3f} s), acks {rec['restore_acks_s']:.3f} s, resume sent "
          f"{rec['resume_sent_s']:.3f} s (read: half {rec['resume_broadcast_p50_s']:.3f} s, "
          f"all {rec['resume_broadcast_s']:.3f} s)")
    print(f"  plan + broadcasts {rec['plan_and_broadcasts_sent_s']:.3f} s sent by the master, "
          f"{rec['plan_and_broadcasts_s']:.3f} s read by every agent (goal < 1 s); fault -> every agent resumed "
          f"{rec['fault_to_all_resumed_s']:.3f} s; master {rec['master_cores_during']:.2f} cores meanwhile")
    print(f"  fan-out: {rec['relays']} relays serving {rec['relayed_children']} agents; the master wrote "
          f"{rec['master_directive_writes']} directive answers from the fault to the last resume "
          f"({rec['master_writes_per_broadcast']:g} per broadcast); the failed node "
          f"{'was' if rec['victim_was_relay'] else 'was not'} a relay; the relays carried {rec['relayed_acks']} "
          f"acks in {rec['relayed_ack_requests']} requests; the generator made its last quiesce / restore ack "
          f"{rec['quiesced_made_s']:.3f} / {rec['resumed_made_s']:.3f} s after the detection")
    if r["errors"]:
        print(f"errors: {r['errors']}")
    if r["generator_stalls"]:
        print(f"the load generator itself did not run for > 0.5 s {len(r['generator_stalls'])} times (longest "
              f"{max(s for _, s in r['generator_stalls']):.1f} s): a contended machine")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    wrongly = [n for n in rec["lost_nodes"] if n != rec["failed_node"]]
    if wrongly:
        print(f"error: live nodes declared lost: {len(wrongly)} ({', '.join(wrongly[:10])})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

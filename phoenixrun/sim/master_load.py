"""Load test of the real master: a `phoenixrun master` process and a swarm of simulated agents.

Steps: start the master sized for `nodes` active nodes, register nodes + spares simulated agents,
let them heartbeat and long-poll, measure the master's CPU and RSS in steady state, then fail one
active node (heartbeats and polls stop, its peer port refuses) and time the recovery the master
drives: detection (heartbeat timeout), quiesce broadcast to every survivor, the survivors' acks,
plan, restore broadcast, acks, resume broadcast. The simulated agents answer at once, so the
times are the control plane's own (no worker or state transfer is simulated).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

from phoenixrun.control.events import read_events
from phoenixrun.control.server import new_event_loop
from phoenixrun.protocol.relay import FALLBACK_POLL_S
from phoenixrun.sim.swarm import SimAgent, Swarm, SwarmConfig


@dataclass
class LoadTestConfig:
    run_dir: Path
    nodes: int = 16384
    nproc_per_node: int = 4
    spares: int = 1
    heartbeat_s: float = 1.0
    node_timeout_s: float = 5.0
    steady_s: float = 10.0
    hb_connections: int = 1024
    phase_timeout_s: float = 300.0
    fault: str = "kill"           # swarm.FAULTS: a killed agent (its connections close) or a silent (hung) host
    relay_threshold: int | None = None   # the master's --relay-threshold (None: its default; 0: no relays)
    relay_heartbeats: bool = True        # children heartbeat through their relays (False: each the master directly)


MasterProcess = subprocess.Popen[bytes]   # the master under test (its output goes to a log file)


def _arrivals(swarm: Swarm, cmd: str) -> list[float]:
    """When each agent got `cmd` of generation 1, in order."""
    return sorted(a.received[(cmd, 1)] for a in swarm.agents if (cmd, 1) in a.received)


class LoadTestError(Exception):
    """The master did not get through a step of the test; the message says which."""


def start_master(cfg: LoadTestConfig) -> tuple[MasterProcess, dict[str, Any], str]:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).parent / "phoenixrun"), "master", "--nnodes", str(cfg.nodes),
           "--nproc-per-node", str(cfg.nproc_per_node), "--run-dir", str(cfg.run_dir), "--port", "0",
           "--node-timeout", str(cfg.node_timeout_s), "--recovery-timeout", str(cfg.phase_timeout_s)]
    if cfg.relay_threshold is not None:
        cmd += ["--relay-threshold", str(cfg.relay_threshold)]
    for stale in ("master.json", "secret", "events.jsonl"):   # a reused --run-dir: never read the last run's
        (cfg.run_dir / stale).unlink(missing_ok=True)
    log = open(cfg.run_dir / "master.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PHOENIXRUN_LOG_LEVEL": "WARNING"})
    info_path = cfg.run_dir / "master.json"
    deadline = time.time() + 120
    while not info_path.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise LoadTestError(f"master did not start: {(cfg.run_dir / 'master.log').read_text()[-500:]}")
        time.sleep(0.05)
    return proc, json.loads(info_path.read_text()), (cfg.run_dir / "secret").read_text().strip()


def run_load_test(cfg: LoadTestConfig) -> dict[str, Any]:
    proc, info, secret = start_master(cfg)
    try:
        loop = new_event_loop()   # uvloop if installed: the load generator needs the CPU as much as the master
        try:
            return loop.run_until_complete(_drive(cfg, proc, info, secret))
        finally:
            loop.close()
    finally:
        proc.kill()
        proc.wait()


def _tree(swarm: Swarm) -> dict[str, Any]:
    """The fan-out tree the agents were following (from the master's heartbeat replies)."""
    relays = sorted({r for r in swarm.relays.parent.values()})
    return {"relays": len(relays), "relayed_children": len(swarm.relays.parent), "relay_ids": relays[:64]}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _reached(cfg: LoadTestConfig, proc: MasterProcess, swarm: Swarm, cmd: str, g: int, n: int,
                   what: str) -> None:
    """Wait until n agents got `cmd` of generation g; LoadTestError saying what went wrong if they do not within
    the phase timeout, or as soon as the master exits."""
    deadline = time.time() + cfg.phase_timeout_s
    while not await swarm.wait_reached(cmd, g, n, 1.0) and time.time() < deadline:
        if proc.poll() is not None:
            break      # the master stopped the job: say so now, not after the phase timeout
    if swarm.arrivals[(cmd, g)] < n:
        said = [ln for ln in (cfg.run_dir / "master.log").read_text().splitlines() if " WARNING " in ln
                or " ERROR " in ln]
        raise LoadTestError(f"{what}: {swarm.arrivals[(cmd, g)]} of {n} agents got `{cmd}` (generation {g}) "
                            + (f"before the master exited ({proc.returncode})" if proc.poll() is not None
                               else f"within {cfg.phase_timeout_s:g}s")
                            + f"; errors: {swarm.errors[:3]}; the load generator stalled {len(swarm.stalls)} "
                            f"times (longest {max((s for _, s in swarm.stalls), default=0):.1f}s); the master said: "
                            + (" | ".join(said[-5:]) or "nothing"))
    if proc.poll() is not None:
        raise LoadTestError(f"master exited with {proc.returncode}")


async def _drive(cfg: LoadTestConfig, proc: MasterProcess, info: dict[str, Any], secret: str) -> dict[str, Any]:
    master = psutil.Process(proc.pid)
    me = psutil.Process()
    swarm = Swarm(SwarmConfig(endpoint=info["endpoint"], secret=secret, nnodes=cfg.nodes,
                              nproc_per_node=cfg.nproc_per_node, spares=cfg.spares, heartbeat_s=cfg.heartbeat_s,
                              hb_connections=cfg.hb_connections, relay_heartbeats=cfg.relay_heartbeats))
    victim = swarm.agents[1]
    await swarm.give_own_peer_port(victim)
    out: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                 "agents": len(swarm.agents)}

    async def reached(cmd: str, g: int, n: int, what: str) -> None:
        await _reached(cfg, proc, swarm, cmd, g, n, what)

    try:
        await swarm.start()
        t = time.time()
        await swarm.register_all()
        out["register_s"] = time.time() - t
        if victim.slot is None:
            raise LoadTestError("the victim agent did not get an active slot")
        t = time.time()
        await reached("run", 0, cfg.nodes, "job start")
        out["start_s"] = time.time() - t

        # steady state: every agent heartbeating and parked in a directive poll (a relay's child: at its relay,
        # once the master has answered the direct poll it made before it knew its relay, within FALLBACK_POLL_S)
        await asyncio.sleep(max(2.0, 2 * cfg.heartbeat_s) + (FALLBACK_POLL_S + 1 if swarm.relays.parent else 0))
        hb0, lat0 = swarm.heartbeats_ok, len(swarm.heartbeat_latency)
        beats0 = swarm.beats.batches, swarm.beats.relayed
        m0, s0, w0 = master.cpu_times(), me.cpu_times(), time.time()
        await asyncio.sleep(cfg.steady_s)
        m1, s1, w1 = master.cpu_times(), me.cpu_times(), time.time()
        lat = swarm.heartbeat_latency[lat0:]
        out["steady"] = {
            "window_s": round(w1 - w0, 2),
            "master_cores": round((m1.user + m1.system - m0.user - m0.system) / (w1 - w0), 3),
            "master_rss_mb": round(master.memory_info().rss / 2**20, 1),
            "master_fds": master.num_fds(),
            "swarm_cores": round((s1.user + s1.system - s0.user - s0.system) / (w1 - w0), 3),
            "heartbeats": swarm.heartbeats_ok - hb0,
            "heartbeats_per_s": round((swarm.heartbeats_ok - hb0) / (w1 - w0), 1),
            # through the relays (sim/swarm_beats.py): the heartbeats they carried, in how many requests; the rest
            # went to the master one request each
            "relayed_heartbeats": swarm.beats.relayed - beats0[1],
            "heartbeat_requests_per_s": round((swarm.heartbeats_ok - hb0 - (swarm.beats.relayed - beats0[1])
                                               + swarm.beats.batches - beats0[0]) / (w1 - w0), 1),
            "heartbeat_p50_ms": round(1e3 * _pct(lat, 0.5), 2), "heartbeat_p99_ms": round(1e3 * _pct(lat, 0.99), 2),
        }

        last_hb = victim.last_heartbeat
        m0 = master.cpu_times()
        writes0, tree, acks0 = swarm.relays.master_writes, _tree(swarm), (swarm.acks.batches, swarm.acks.relayed)
        t_fail = await swarm.fail(victim, cfg.fault)
        survivors = [a for a in swarm.agents if a.slot is not None and a is not victim]
        await reached("quiesce", 1, len(survivors), "quiesce broadcast")
        await reached("restore", 1, cfg.nodes, "restore broadcast")
        await reached("run", 1, cfg.nodes, "resume broadcast")
        m1, t_end = master.cpu_times(), time.time()
        writes = swarm.relays.master_writes - writes0
        # the acks through the relays (sim/swarm_relay.py's SwarmAcks): requests the relays sent, acks they carried
        tree.update(relayed_ack_requests=swarm.acks.batches - acks0[0], relayed_acks=swarm.acks.relayed - acks0[1])
    finally:
        await swarm.stop()

    out["recovery"] = _recovery(cfg, swarm, victim, last_hb, t_fail, t_end, m1.user + m1.system - m0.user - m0.system,
                                writes, tree)
    out["errors"] = swarm.errors[:10]
    out["generator_stalls"] = swarm.stalls[:20]
    out["heartbeat_latency_median_ms"] = round(1e3 * statistics.median(swarm.heartbeat_latency), 2) \
        if swarm.heartbeat_latency else None
    return out


def _recovery(cfg: LoadTestConfig, swarm: Swarm, victim: SimAgent, last_hb: float, t_fail: float, t_end: float,
              master_cpu: float, writes: int, tree: dict[str, Any]) -> dict[str, Any]:
    """The recovery's figures, from the master's events and the load generator's arrivals."""
    ev = read_events(cfg.run_dir / "events.jsonl")
    first: Callable[[str], dict[str, Any]] = lambda name: next(e for e in ev if e["event"] == name)  # noqa: E731
    fault, started, plan, done = (first(n) for n in ("fault_detected", "recovery_started", "recovery_plan",
                                                     "recovery_done"))
    arrivals: Callable[[str], list[float]] = lambda cmd: _arrivals(swarm, cmd)  # noqa: E731
    latest: Callable[[str], float] = lambda cmd: arrivals(cmd)[-1]  # noqa: E731
    rec = {
        "failed_node": victim.node_id, "failed_slot": victim.slot,
        "fault": cfg.fault, "detect_s": round(fault["t"] - last_hb, 4),
        "detect_after_fault_s": round(fault["t"] - t_fail, 4), "detected_by": fault.get("detail", ""),
        "quiesce_broadcast_s": round(latest("quiesce") - started["t"], 4),
        "quiesce_acks_s": done["phases"]["quiesce_s"],
        "plan_s": done["phases"]["plan_s"],
        "restore_broadcast_s": round(latest("restore") - plan["t"], 4),
        "restore_acks_s": done["phases"]["restore_s"],
        "resume_broadcast_s": round(latest("run") - done["t"], 4),
        "recovery_s": done["duration_s"],
        "fault_to_all_resumed_s": round(latest("run") - fault["t"], 4),
        # when the generator had made its last quiesce and restore ack (after the detection): one process plays every
        # agent, so its own pace bounds the ack phases from below (real agents answer in parallel)
        "quiesced_made_s": round(swarm.acks.made.get("quiesced", fault["t"]) - fault["t"], 4),
        "resumed_made_s": round(swarm.acks.made.get("resumed", fault["t"]) - fault["t"], 4),
        "master_cores_during": round(master_cpu / (t_end - t_fail), 3),
        "replaced_slots": done["replaced_slots"],
        # the fan-out (protocol/relay.py): what the master wrote from the fault until every agent resumed, over the
        # recovery's three broadcasts (quiesce, restore, resume); the tree as it stood at the fault
        "master_directive_writes": writes, "master_writes_per_broadcast": round(writes / 3, 1), **tree,
        "victim_was_relay": victim.node_id in tree["relay_ids"],
        # the ring watch (control/ring_watch.py): suspect reports the victim's watchers sent the master
        "suspect_reports": swarm.watch.reports,
        # every node the master declared lost until the last agent resumed: the victim alone, or live ones too
        "lost_nodes": sorted({e["node"] for e in ev if e["event"] == "fault_detected" and e["t"] <= t_end}),
    }
    # Each broadcast two ways. *_sent_s: until the master had handed it to the last agent's connection
    # (its `directive_sent` event; on loopback the bytes are then in that agent's socket). *_broadcast_s
    # (and its median, *_broadcast_p50_s): until the load generator had read it off the last agent's
    # socket - which adds the generator's own backlog, as it shares the machine with the master.
    sent = {e["command"]: e["t"] for e in ev if e["event"] == "directive_sent" and e["generation"] == 1}
    for cmd, name, since in (("quiesce", "quiesce", started["t"]), ("restore", "restore", plan["t"]),
                             ("run", "resume", done["t"])):
        rec[f"{name}_broadcast_p50_s"] = round(_pct(arrivals(cmd), 0.5) - since, 4)
        rec[f"{name}_sent_s"] = round(sent[cmd] - since, 4) if cmd in sent else None
    rec["plan_and_broadcasts_s"] = round(rec["quiesce_broadcast_s"] + rec["plan_s"] + rec["restore_broadcast_s"]
                                         + rec["resume_broadcast_s"], 4)
    if all(rec[f"{n}_sent_s"] is not None for n in ("quiesce", "restore", "resume")):
        rec["plan_and_broadcasts_sent_s"] = round(rec["quiesce_sent_s"] + rec["plan_s"] + rec["restore_sent_s"]
                                                  + rec["resume_sent_s"], 4)
    return rec

"""A master that was not running (stopped, swapped out) must not take its own silence for the nodes'.

A real `phoenixrun master` process and a few simulated agents; the master is SIGSTOPped for three
heartbeat timeouts and continued. Before the fix, it declared every node lost the moment it ran again
(and, with no spares for them, failed the job). Afterwards a real node loss is still detected.
"""
import asyncio
import os
import signal
import time

from phoenixrun.control.events import read_events
from phoenixrun.sim.master_load import LoadTestConfig, start_master
from phoenixrun.sim.swarm import Swarm, SwarmConfig

NODE_TIMEOUT_S = 1.0


def events_named(run_dir, name):
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == name]


async def until(pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            return False
        await asyncio.sleep(0.05)    # the events file has no notification to wait on
    return True


def test_a_stopped_master_does_not_declare_every_node_lost(tmp_path):
    cfg = LoadTestConfig(run_dir=tmp_path, nodes=4, nproc_per_node=1, heartbeat_s=0.2,
                         node_timeout_s=NODE_TIMEOUT_S, phase_timeout_s=60.0)
    proc, info, secret = start_master(cfg)

    async def drive() -> None:
        swarm = Swarm(SwarmConfig(endpoint=info["endpoint"], secret=secret, nnodes=4, nproc_per_node=1,
                                  spares=1, heartbeat_s=0.2, hb_connections=4, report_connections=4))
        victim = swarm.agents[2]
        await swarm.give_own_peer_port(victim)
        try:
            await swarm.start()
            await swarm.register_all()
            assert await swarm.wait_reached("run", 0, 4, 30.0)

            os.kill(proc.pid, signal.SIGSTOP)
            await asyncio.sleep(3 * NODE_TIMEOUT_S)      # the fault itself: the master does not run
            os.kill(proc.pid, signal.SIGCONT)
            assert await until(lambda: events_named(tmp_path, "master_stalled"), 10.0), "stall not noticed"
            stalled = events_named(tmp_path, "master_stalled")[0]
            assert stalled["seconds"] >= 2 * NODE_TIMEOUT_S

            # two more timeouts of normal running: nobody is lost, no recovery starts
            await asyncio.sleep(2 * NODE_TIMEOUT_S)
            assert events_named(tmp_path, "fault_detected") == []
            assert swarm.arrivals[("quiesce", 1)] == 0 and proc.poll() is None

            # the guard hides only the master's own silence: a node that really dies is still replaced
            await swarm.fail(victim)
            assert await swarm.wait_reached("run", 1, 4, 30.0), "the real loss was not recovered"
            lost = events_named(tmp_path, "fault_detected")
            assert [e["node"] for e in lost] == [victim.node_id]
        finally:
            await swarm.stop()

    try:
        asyncio.run(drive())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()

"""A killed agent is found by its closed connection, not by --node-timeout of silence; a link that closes while its
agent lives is not a loss (issue 32). Decisions: tests/test_detection.py; here the real master and real processes.

- the load generator's agents against a real `phoenixrun master` (no torch): one agent's poll connection is reset
  under it while it lives (its client redials, as agents/master_link.py does) - nobody is declared lost; another is
  killed (its connection closes, its port refuses) - found within a monitor tick or two, with --node-timeout 30 s;
- a real job: a node's agent and workers SIGKILLed, the spare takes over, the result bit-identical to torchrun.
"""
import asyncio
import time

import pytest

from phoenixrun.sim.master_load import LoadTestConfig, start_master
from phoenixrun.sim.swarm import Swarm, SwarmConfig
from tests.harness import assert_identical, by_event, kill_node, launch, torchrun
from tests.test_master_stall import events_named, until

NODE_TIMEOUT_S = 30.0    # far longer than the test waits: a detection can only be the closed link's
pytestmark = pytest.mark.e2e


def test_a_reset_link_is_not_a_loss_and_a_killed_agent_is_found_by_its_closed_link(tmp_path):
    cfg = LoadTestConfig(run_dir=tmp_path, nodes=4, nproc_per_node=1, heartbeat_s=0.5,
                         node_timeout_s=NODE_TIMEOUT_S, phase_timeout_s=60.0)
    proc, info, secret = start_master(cfg)

    async def drive() -> None:
        swarm = Swarm(SwarmConfig(endpoint=info["endpoint"], secret=secret, nnodes=4, nproc_per_node=1,
                                  spares=1, heartbeat_s=0.5, hb_connections=4, report_connections=4))
        live, victim = swarm.agents[1], swarm.agents[2]
        await swarm.give_own_peer_port(live)
        await swarm.give_own_peer_port(victim)
        try:
            await swarm.start()
            await swarm.register_all()
            assert await swarm.wait_reached("run", 0, 4, 60.0)
            await asyncio.sleep(1.0)                       # every agent's poll parked

            # a transient error: the live agent's poll connection is reset under it; it polls again shortly
            swarm.lane_of(live).conn.transport.abort()
            await asyncio.sleep(3.0)                       # many monitor ticks, far inside the node timeout
            assert events_named(tmp_path, "fault_detected") == [], "a live agent whose link reset was declared lost"

            t_kill = await swarm.fail(victim, "kill")
            assert await until(lambda: events_named(tmp_path, "fault_detected"), NODE_TIMEOUT_S / 2), "kill not found"
            found = events_named(tmp_path, "fault_detected")
            assert [e["node"] for e in found] == [victim.node_id], found
            assert "refuses" in found[0]["detail"] and found[0]["t"] - t_kill < NODE_TIMEOUT_S / 2, found
            assert await swarm.wait_reached("run", 1, 4, 60.0), "the killed node was not replaced"
        finally:
            await swarm.stop()

    try:
        asyncio.run(drive())
    finally:
        proc.kill()
        proc.wait()


def test_a_sigkilled_node_is_replaced_without_waiting_for_the_node_timeout(tmp_path):
    job = launch(tmp_path, "job", nnodes=2, nproc=2, spares=1, steps=40,
                 extra_flags=["--node-timeout", str(NODE_TIMEOUT_S)])
    state = job.wait_for(lambda s: (s["step"] or 0) >= 6 and all(len(n["worker_pids"]) == 2 for n in s["nodes"]),
                         what="training with a warm spare")
    kill_node(state, slot=1)
    t_kill = time.time()
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    found = [e for e in by_event(ev, "fault_detected") if not e.get("during_recovery")]
    # by its closed link, or by the survivors' collective errors and the probe that follows them (whichever the
    # master sees first) - not by the heartbeat timeout
    assert [e["slot"] for e in found] == [1] and "no heartbeat" not in found[0]["detail"], found
    assert found[0]["t"] - t_kill < NODE_TIMEOUT_S / 2, found
    assert len(by_event(ev, "recovery_done")) == 1
    assert_identical(job.out, torchrun(tmp_path, "ref", nproc=4, steps=40))

"""The directive fan-out with real processes (issue 32 item 2; the tree: tests/test_relay_tree.py).

A job with --relay-threshold low enough that its 4 agents use 2 relays (the children heartbeat through them): a
worker dies (the recovery's directives go out through the relays), a relay is SIGKILLed while it is forwarding that
recovery's directives to its children (held at the `relay_serve` pause point, so the kill lands mid-broadcast), its
children poll the master directly, the master takes the relay's loss as one more fault, and the job finishes
bit-identical to torchrun.
"""
import os
import signal

import psutil
import pytest

from tests.harness import assert_identical, by_event, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


def test_a_relay_killed_mid_broadcast_and_the_job_recovers_bit_identical(tmp_path):
    # held serving a generation-1 directive; and the job held at a late step's snapshot until the relay is dead: a
    # held relay's children poll the master after RELAY_POLL_S, so the job can finish before the test acts (CI: it
    # exited 0 between the relay's pause and the test's next state query)
    job = launch(tmp_path, "relay", nnodes=3, nproc=1, spares=1, steps=STEPS, extra_flags=["--relay-threshold", "2"],
                 PHOENIXRUN_TEST_PAUSE=f"relay_serve:1,d2h:{STEPS - 5}+")
    # ... and the relays' children heartbeating through them (agents/beats.py)
    state = job.wait_for(lambda s: (s["step"] or 0) >= 8 and len(s["nodes"]) == 4
                         and all(n["worker_pids"] for n in s["nodes"] if n["role"] == "active")
                         and s["relayed_heartbeats"]["taken"] > 0,
                         what="training with 4 agents, heartbeats through the relays")
    victim_worker = next(n for n in state["nodes"] if n["slot"] == 0)["worker_pids"][0]
    os.kill(victim_worker, signal.SIGKILL)                  # the first fault: its recovery goes out via the relays
    relay_pid = int(job.wait_file(tmp_path / "paused-relay_serve"))
    relay = next(n for n in state["nodes"] if n["agent_pid"] == relay_pid)
    # the relay's node lost whole: its agent and its workers now (slot 0's worker was just respawned)
    agent = psutil.Process(relay_pid)
    for p in [agent, *agent.children(recursive=True)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    (tmp_path / "release-d2h").touch()
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    # an active relay is a fault (fault_detected, its slot replaced), a spare one a spare lost
    lost = [e for e in by_event(ev, "fault_detected") + by_event(ev, "spare_lost") if e.get("node") == relay["node_id"]]
    assert lost, f"the killed relay {relay['node_id']} was never found lost: {ev[-12:]}"
    assert by_event(ev, "recovery_done"), job.log()[-3000:]
    assert_identical(job.out, torchrun(tmp_path, "ref3", nproc=3, steps=STEPS))

"""The scale harness at a small size: 256 simulated agents against a real `phoenixrun master` process.

The full-size run (16,384 agents) is benchmarks/master_scale.py; this checks that the harness and
the master's transport get a node failure detected and every agent reached by each recovery
directive, with the recovery completing.
"""
import pytest

from phoenixrun.config import MasterConfig
from phoenixrun.control.jobstate import JobState
from phoenixrun.control.state import NodeRecord, Phase, Role
from phoenixrun.protocol.constants import READ_TIMEOUT_S
from phoenixrun.sim.master_load import LoadTestConfig, run_load_test


def test_a_heartbeat_does_not_walk_every_node(tmp_path, monkeypatch):
    # Issue 32 (4,096 nodes): every heartbeat listed the active nodes for the straggler check before the check's
    # twice-a-second rate limit said no - O(nodes) a heartbeat, O(nodes^2) a second. The master spent 46% of its
    # samples there (py-spy), registered 3,477 of 4,097 agents in 107 s, and fell so far behind that 165 live nodes
    # went unheard for 5 s right after the job started. Per heartbeat (handlers.py) the check must cost O(1) while
    # not due: the active nodes are listed at most once per due check.
    job = JobState(MasterConfig.build(run_dir=tmp_path, nnodes=64, nproc_per_node=1, replicas=1))
    for i in range(64):
        job.members.add_node(NodeRecord(node_id=f"n{i}", host="h", agent_pid=1, peer_addr="h:1", fault_domain="",
                                        role=Role.ACTIVE, slot=i))
    job.course.phase = Phase.RUNNING
    listed = []
    real = job.members.actives
    monkeypatch.setattr(job.members, "actives", lambda: listed.append(1) or real())

    class Slots(dict):          # counts the walks over the slot holders (the throughput sample's)
        def values(self):
            for v in super().values():
                listed.append(v) if v == "n0" else None
                yield v
    job.members.slots = Slots(job.members.slots)
    for _ in range(1000):       # a thousand heartbeats within well under the 0.5 s rate limits, on any machine
        assert job.new_stragglers() == []
        job.note_progress()
    # (16K agents, issue 32: the slot holders listed per heartbeat for the throughput sample, 28% of the master)
    assert len(listed) <= 4, f"every node was walked {len(listed)} times for 1000 heartbeats"


def test_256_agents_failure_detected_and_every_agent_reached(tmp_path):
    cfg = LoadTestConfig(run_dir=tmp_path, nodes=256, nproc_per_node=4, heartbeat_s=0.25, node_timeout_s=2.0,
                         steady_s=1.0, phase_timeout_s=60.0, fault="silent")
    r = run_load_test(cfg)   # raises LoadTestError naming the step if any agent is not reached
    # (a heartbeat the master did not answer within the agent's client timeout is given up and sent again, as the
    # agent's is: on this shared machine at a load average of 20-25 the master answered some after > 5 s)
    assert r["agents"] == 257 and [e for e in r["errors"] if "no answer within" not in e] == []
    s, rec = r["steady"], r["recovery"]
    # the load really ran. (How many heartbeats a second the generator sends depends on how busy this machine is -
    # 284-330/s at load average 16-24 against ~1,000/s idle: a rate is benchmarks/master_scale.py's to report.)
    assert s["heartbeats"] > 0
    # a hung host: found by its ring watchers (control/ring_watch.py) and confirmed by the master, not by the 2 s
    # heartbeat timeout; how soon is the benchmark's figure
    assert "ring watchers" in rec["detected_by"] and rec["suspect_reports"] >= 1, rec
    assert rec["detect_after_fault_s"] < cfg.node_timeout_s, rec
    assert rec["lost_nodes"] == [rec["failed_node"]], "a live node was declared lost"
    assert rec["failed_slot"] is not None and list(rec["replaced_slots"]) == [str(rec["failed_slot"])]
    for name in ("quiesce", "restore", "resume"):
        # the master reports each broadcast sent to every agent (its directive_sent event), and every agent read it;
        # the event is written just after the last send, so it may trail the last read by a hair
        assert 0 <= rec[f"{name}_sent_s"] < rec[f"{name}_broadcast_s"] + 0.1, name
        assert 0 <= rec[f"{name}_broadcast_s"] < cfg.phase_timeout_s, name
    assert rec["fault_to_all_resumed_s"] < 3 * cfg.phase_timeout_s
    # 257 agents are past the default --relay-threshold (256): the broadcasts went through ~16 relays, so the master
    # wrote far fewer directive answers than one per agent per broadcast (protocol/relay.py)
    assert rec["relays"] >= 8 and rec["master_writes_per_broadcast"] < 257 / 2, rec
    # ... and their acks came back through them: most of the ~2 x 256 acks, in far fewer requests to the master
    assert rec["relayed_acks"] > 256 and rec["relayed_ack_requests"] < rec["relayed_acks"] / 2, rec


@pytest.mark.e2e
def test_a_run_longer_than_the_read_timeout_completes_and_loses_no_live_node(tmp_path):
    # Issue 32: the benchmark stopped completing at 1K-16K nodes while this suite passed. What broke needs time to
    # show: connections the master sees idle for READ_TIMEOUT_S (the generator's report pool, opened ahead of use)
    # were dropped, and agents whose shared connection was dropped went silent for good; the master's O(nodes^2)
    # progress line stalled it every 10 s of a join; its own read backlog was taken for the nodes' silence. So:
    # the steady window outlasts the read timeout, at the real heartbeat period and node timeout.
    cfg = LoadTestConfig(run_dir=tmp_path, nodes=384, nproc_per_node=4, heartbeat_s=1.0, node_timeout_s=5.0,
                         steady_s=READ_TIMEOUT_S + 2.0, phase_timeout_s=120.0)
    r = run_load_test(cfg)   # raises LoadTestError naming the step if any agent is not reached
    s, rec = r["steady"], r["recovery"]
    assert rec["lost_nodes"] == [rec["failed_node"]], "a live node was declared lost"
    assert not [e for e in r["errors"] if "report" in e], r["errors"]      # every ack got through
    # the relays' children heartbeat through them (agents/beats.py): fewer requests reach the master than
    # heartbeats, and nobody was declared lost for it (above). How many fewer is the benchmark's figure: a child
    # whose relay's batch comes late on a loaded machine sends its own.
    assert s["relayed_heartbeats"] > 0 and s["heartbeat_requests_per_s"] < s["heartbeats_per_s"], s
    assert list(rec["replaced_slots"]) == [str(rec["failed_slot"])]
    # a killed agent: its closed connection and refusing port, confirmed, are the evidence - not 5 s of silence
    assert rec["detect_after_fault_s"] < cfg.node_timeout_s and "refuses" in rec["detected_by"], rec

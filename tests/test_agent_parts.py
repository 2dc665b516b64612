"""The agent's parts: the pure decisions (what a directive means here, what a worker's state means), the
phase acknowledgements, and the worker-op table and the replicator over real sockets (the runtime's own end
of the worker channel, two agents' peer servers; no worker processes)."""
import json
import mmap
import re
from pathlib import Path

import pytest

from phoenixrun.protocol import PeerOp
from phoenixrun.protocol.peer_requests import SlotRequest
from phoenixrun.agents.agent import Agent
from phoenixrun.config import AgentConfig
from phoenixrun.agents.node import Handover
from phoenixrun.agents.executor import Step, plan_directive, waits_for_io_process
from phoenixrun.agents.ipc import WorkerChannelServer
from phoenixrun.agents.peer import PeerServer
from phoenixrun.agents.phases import (QUIESCE_GRACE_CAP_S, QUIESCE_GRACE_FLOOR_S, PhaseAcks, StepTimes,
                                      quiesce_grace)
from phoenixrun.agents.replicator import holders_of, peer_addr_of
from phoenixrun.agents.supervisor import EXIT_WAIT_WARN_MIN_S, Exit, exit_detail, exit_outcome, exit_overdue
from phoenixrun.agents.workers import WorkerSpec
from phoenixrun.protocol import WorkerOp
from phoenixrun.protocol.directives import World, decode
from phoenixrun.protocol.restore import RankSource
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol.timings import Timings
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.reshard import WorkerReshard
from phoenixrun.protocol.worker_orders import Assign
from phoenixrun.protocol.worker_orders import decode as wo_decode
from phoenixrun.runtime.agent_link import AgentLink
from phoenixrun.slot_format import SlotHeader
from phoenixrun.protocol.reports import RestoreRefused, Resumed
from phoenixrun.protocol.replies import JobTerms

RUNTIME = Path(__file__).resolve().parents[1] / "phoenixrun" / "runtime"


@pytest.mark.parametrize("d, has_workers, in_place, expected", [
    ({"command": "wait"}, False, False, Step.NOTHING),
    ({"command": "wait", "warm": True}, False, False, Step.WARM_UP),
    ({"command": "wait", "warm": True}, True, False, Step.NOTHING),          # its warm workers are up already
    ({"command": "run"}, True, False, Step.START),
    ({"command": "run", "resume": True}, True, True, Step.RESUME),
    ({"command": "restart"}, True, True, Step.RESTART),                       # torchrun's restart: no checkpoint
    ({"command": "restart", "restore_step": 8}, True, False, Step.RESTART),   # a plain script: new processes
    ({"command": "restart", "restore_step": 8}, True, True, Step.RESTART_IN_PLACE),
    ({"command": "restart", "restore_step": 0}, True, True, Step.RESTART_IN_PLACE),   # step 0 is a step
    ({"command": "restart", "restore_step": 8, "reshard": {"kind": "shrink", "old_world": 6, "step": 8}}, True, True, Step.RESHAPE),
    ({"command": "restart", "restore_step": 8, "reshard": {"kind": "grow", "old_world": 2, "step": 8}}, True, False, Step.RESHAPE),
    ({"command": "quiesce"}, True, True, Step.QUIESCE),
    ({"command": "restore", "restore_step": 3}, True, True, Step.RESTORE),
    ({"command": "stop", "exit_code": 1}, True, True, Step.STOP),
    ({"command": "stop", "fenced": True}, True, True, Step.FENCED),
    ({"command": "noop"}, True, True, Step.NOTHING),
    ({"command": "teleport"}, True, True, Step.NOTHING),                      # unknown: nothing to do
])
def test_plan_directive(d, has_workers, in_place, expected):
    assert plan_directive(decode(d), has_workers=has_workers, in_place=in_place) is expected


@pytest.mark.parametrize("code, job_end, level", [(0, True, "INFO"), (1, True, "WARNING"), (75, True, "WARNING"),
                                                   (0, False, "WARNING")])   # a node drained or fenced alone
def test_a_clean_finish_is_not_a_warning(caplog, code, job_end, level):
    """Every agent logged a finished job as `WARNING stopping (exit code 0)` (issue 29 item 3)."""
    import threading
    from types import SimpleNamespace

    from phoenixrun.agents.executor import DirectiveExecutor
    stopped = []
    node = SimpleNamespace(lock=threading.Lock(), take_directive=lambda d: None, api=False, persister=None)
    ex = DirectiveExecutor(node, SimpleNamespace(stop=stopped.append), None, None,
                           SimpleNamespace(workers={}, warm_workers=lambda: False), None, None, None)
    caplog.set_level("DEBUG", logger="phoenixrun.agent")
    ex.apply(decode({"command": "stop", "exit_code": code, "reason": "all workers finished", "job_end": job_end}))
    assert stopped == [code]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "stopping" in r.getMessage()] == \
        [(level, f"stopping (exit code {code}): all workers finished")]


@pytest.mark.parametrize("d, expected", [
    ({"command": "run"}, True),
    ({"command": "run", "resume": True}, True),
    ({"command": "restart"}, True),
    ({"command": "restart", "restore_step": 4}, False),   # reading the checkpoint waits for the process anyway
    ({"command": "quiesce"}, False),
    ({"command": "wait", "warm": True}, False),
])
def test_waits_for_io_process(d, expected):
    assert waits_for_io_process(decode(d).order) is expected


@pytest.mark.parametrize("now, left, hang_timeout, expected", [
    (100.0, 100.0 - EXIT_WAIT_WARN_MIN_S, 1.0, False),   # exactly the floor: not yet
    (100.0, 100.0 - EXIT_WAIT_WARN_MIN_S - 0.1, 1.0, True),
    (100.0, 100.0 - EXIT_WAIT_WARN_MIN_S - 0.1, 30.0, False),   # 3 x a long hang timeout is the limit then
    (100.0, 100.0 - 90.1, 30.0, True),
])
def test_exit_overdue(now, left, hang_timeout, expected):
    assert exit_overdue(now, left, hang_timeout) is expected


def test_a_worker_that_left_the_loop_and_does_not_exit_is_named_once_and_left_alone(tmp_path, caplog):
    """Past its last step a worker is not watched for hangs (torchrun's semantics: its teardown takes what it takes);
    one that has not exited long after is named in the log, once, and not killed."""
    import logging
    import time
    script = tmp_path / "linger.py"
    script.write_text("import time\ntime.sleep(60)\n")
    a = Agent(AgentConfig(endpoint="127.0.0.1:1", secret="s3cret", spec=WorkerSpec(str(script)), nproc_per_node=1))
    a.node.slot, a.node.role = 0, "active"
    a.node.job = JobTerms(run_id="test", store_port=1, nnodes=1, nproc_per_node=1, tp=1, pp=1, max_restarts=0)
    sup = a.supervisor
    with a.node.lock:
        sup.spawn(0, rank_known=True)
    w = sup.workers[0]
    try:
        sup.left_loop[0] = time.time() - EXIT_WAIT_WARN_MIN_S - 1      # its link closed that long ago
        with caplog.at_level(logging.WARNING, logger="phoenixrun.agent"):
            sup.watch()
            sup.watch()
        named = [r.getMessage() for r in caplog.records if "left the training loop" in r.getMessage()]
        assert len(named) == 1 and f"pid {w.pid}" in named[0]
        assert w.poll() is None and a.reporter.outbox.empty()            # not killed, nothing reported
    finally:
        w.kill_tree(grace=0.1)
        a.slots.clear()


@pytest.mark.parametrize("rank, rc, expected, detail", [
    (3, None, Exit.RUNNING, None),
    (None, 1, Exit.WARM, None),
    (None, 0, Exit.WARM, None),
    (3, 0, Exit.DONE, None),
    (3, 1, Exit.FAILED, "rank 3 exited with code 1"),
    (3, -9, Exit.FAILED, "rank 3 exited with signal 9"),
])
def test_exit_outcome(rank, rc, expected, detail):
    assert exit_outcome(rank, rc) is expected
    if detail is not None:
        assert exit_detail(rank, rc) == detail


def test_quiesce_is_reported_once_when_the_last_worker_acks():
    p = PhaseAcks()
    p.expect_quiesce({0, 1}, deadline=50.0)
    assert not p.quiesce_complete(frozen=True)
    p.quiesced(0, next_step=7)
    assert not p.quiesce_complete(frozen=True)
    p.gone(1)                                   # exited instead: owes nothing
    assert not p.quiesce_complete(frozen=False)  # not in a recovery: nothing to report
    assert p.quiesce_complete(frozen=True)
    assert not p.quiesce_complete(frozen=True)   # once
    p.quiesced(1, next_step=9)                   # a late ack reports nothing
    assert not p.quiesce_complete(frozen=True) and p.quiesced_next_step == 9


def test_quiesce_overdue_and_a_new_quiesce_forgets_the_last_steps():
    p = PhaseAcks()
    p.expect_quiesce({0, 1}, deadline=50.0)
    p.quiesced(1, next_step=4)
    assert not p.quiesce_overdue(50.0) and p.quiesce_overdue(50.1)
    assert p.unacked_quiesce() == [0]
    p.expect_quiesce({2})                        # no deadline: the last one holds
    assert p.quiesce_overdue(50.1) and p.quiesced_next_step == 4
    p.expect_quiesce({0}, deadline=60.0)
    assert p.quiesced_next_step == 0 and not p.quiesce_overdue(59.0)
    p.quiesced(0, next_step=1)
    assert p.quiesce_complete(frozen=True)
    assert not p.quiesce_overdue(100.0) and p.unacked_quiesce() == []   # reported: nothing is overdue


@pytest.mark.parametrize("steps, floor, k, cap, grace", [
    ([], 5.0, 2.0, 45.0, 5.0),                        # nothing measured yet: the floor
    ([0.2, 0.3, 0.25], 5.0, 2.0, 45.0, 5.0),          # short steps: the floor (the old constant)
    ([8.0], 5.0, 2.0, 45.0, 16.0),                    # an 8 s step: two of them, the survivor keeps its process
    ([0.2, 8.0, 0.2], 5.0, 2.0, 45.0, 16.0),          # the longest recent step counts, not the last
    ([3.0], 5.0, 2.0, 45.0, 6.0),                     # just above the floor
    ([100.0], 5.0, 2.0, 45.0, 45.0),                  # capped: the agent acts before the master's phase deadline
    ([100.0], 5.0, 2.0, 3.0, 5.0),                    # a cap below the floor: never less than the floor
    ([float("nan"), float("inf"), -1.0, 4.0], 5.0, 2.0, 45.0, 8.0),   # nonsense samples are ignored
    ([1.0], 0.5, 3.0, 45.0, 3.0),
])
def test_quiesce_grace(steps, floor, k, cap, grace):
    assert quiesce_grace(steps, floor=floor, steps=k, cap=cap) == grace


def test_quiesce_grace_defaults_and_step_times_per_rank():
    assert quiesce_grace([]) == QUIESCE_GRACE_FLOOR_S and quiesce_grace([1e9]) == QUIESCE_GRACE_CAP_S
    t = StepTimes(per_rank=2)
    assert t.grace() == QUIESCE_GRACE_FLOOR_S
    t.record(0, 8.0)
    t.record(1, 1.0)
    assert t.grace() == quiesce_grace([8.0])
    t.record(0, 1.0)
    t.record(0, 1.0)                                  # rank 0's 8 s step is no longer recent
    assert t.grace() == QUIESCE_GRACE_FLOOR_S


def test_resume_reports_the_slowest_timings_once():
    p = PhaseAcks()
    p.expect_resume(range(2), Timings(fetch_s=0.5))
    assert p.resumed(0, Timings(rebuild_s=1.0, fetch_s=0.1)) is None
    assert p.resumed(1, Timings(rebuild_s=2.0)) == Timings(fetch_s=0.5, rebuild_s=2.0)
    assert p.resumed(1, Timings(rebuild_s=3.0)) is None


@pytest.mark.parametrize("world, rank, holders", [
    ({}, 0, []),
    ({"placement": {0: [1, 2]}}, 0, [1, 2]),
    ({"placement": {1: [0]}}, 0, []),
])
def test_holders_of(world, rank, holders):
    assert holders_of(World.from_wire(world), rank) == holders


def test_peer_addr_of():
    assert peer_addr_of(World.from_wire({"slots": {"1": "h:1", "2": "h:2"}}), 2) == "h:2"


def _ops_the_runtime_sends() -> set[str]:
    """The ops of the worker messages (protocol/worker_messages.py, imported as `wm`) the runtime builds."""
    ops = set()
    for path in RUNTIME.glob("*.py"):
        ops |= {wm.MESSAGES[m.OP.value].OP.value for name in re.findall(r'\bwm\.(\w+)\(', path.read_text())
                if isinstance(m := getattr(wm, name, None), type) and issubclass(m, wm.WorkerMessage)}
    return ops


@pytest.fixture
def two_agents():
    """Agents of node slots 0 and 1 (one rank each), built but not started: their peer servers serve the
    replicator, node 0's worker channel serves the op table; reports stay in their outboxes."""
    job = JobTerms(run_id="test", store_port=1, nnodes=2, nproc_per_node=1, tp=1, pp=1, max_restarts=0)
    agents, servers = [], []
    for slot in (0, 1):
        a = Agent(AgentConfig(endpoint="127.0.0.1:1", secret="s3cret", spec=WorkerSpec("unused.py"),
                              nproc_per_node=1))
        a.node.slot, a.node.job, a.node.role = slot, job, "active"
        servers.append(PeerServer("127.0.0.1", "s3cret", a.replicator.peer_handlers(),
                                  sinks=a.replicator.peer_sinks()))   # as agents/agent.py builds it
        agents.append(a)
    # as the agent gets it from a directive (protocol/codec.py: JSON's string keys made ints)
    world = World.from_wire({"placement": {"0": [1], "1": [0]}, "slots": {"0": servers[0].addr, "1": servers[1].addr}})
    for a in agents:
        a.node.world = world
    channel = WorkerChannelServer(agents[0].sock_path, agents[0].worker_ops.on_message, agents[0].worker_ops.on_close)
    yield agents, servers
    channel.close()
    for a, s in zip(agents, servers):
        s.close()
        a.slots.clear()


def test_every_op_the_runtime_sends_has_a_handler(two_agents):
    agents, _ = two_agents
    sent = _ops_the_runtime_sends()
    assert {"hello", "write", "written", "quiesced", "resumed"} <= sent    # the scan finds them
    assert sent <= set(agents[0].worker_ops.handlers)
    assert all(isinstance(op, WorkerOp) for op in agents[0].worker_ops.handlers)   # named by the protocol


def test_worker_channel_through_the_op_table_and_replication(two_agents):
    (a, b), servers = two_agents
    link = AgentLink(a.sock_path)
    try:
        link.send(wm.Hello(local_rank=0, pid=1, api=True))
        assign = link.orders.get(timeout=30)
        assert isinstance(assign, Assign) and (assign.rank, assign.world_size) == (0, 2) and a.node.api
        link.sock.sendall(b'{"op": 5}\n')                      # no such op: ignored, the channel goes on
        link.sock.sendall(b'{"op": "teleport"}\n')
        h = SlotHeader(step=5, meta_cap=64, meta_len=2, private_len=100, shared_len=100)
        paths = link.request(wm.Alloc(nbytes=h.total_len), timeout=30).paths
        assert len(paths) == 2 and all(Path(p).exists() for p in paths)
        w = link.request(wm.Write(nbytes=h.total_len), timeout=30)
        with open(w.path, "r+b") as f, mmap.mmap(f.fileno(), w.nbytes) as mm:
            mm[64:66] = b"{}"
            mm[h.private_off:h.private_off + 100] = b"p" * 100
            mm[h.shared_off:h.shared_off + 100] = b"s" * 100
            mm[:64] = h.pack()
        link.send(wm.Written(slot=w.slot, step=5, stats=Figures(d2h_s=0.1)))
        with link.cv:
            assert link.cv.wait_for(lambda: link.committed_step == 5 or link.commit_error, timeout=30)
        assert link.commit_error is None and link.last_commit is not None
        assert link.last_commit.replicated_bytes == h.private_off + 100
        assert a.slots.available() == {0: [5]} and b.replicas.available() == {0: [5]}   # replicated to slot 1
        # one reader thread per worker: once a later request is answered, `written` has been handled whole
        assert link.request(wm.Slots(), timeout=30).paths == paths
        assert a.node.protection[0].committed_step == 5 and a.node.protection[0].d2h_s == 0.1
        assert 0 in a.supervisor.last_progress                  # write/written restart the hang clock
        link.send(wm.Progress(step=6, step_s=9.5))  # its longest step since the last progress
        link.request(wm.Slots(), timeout=30)
        assert a.supervisor.step_times.grace() == quiesce_grace([9.5]) > QUIESCE_GRACE_FLOOR_S

        link.send(wm.CommError(text="boom", step=6))
        link.send(wm.Resumed(generation=0, timings=Timings(rebuild_s=0.2)))
        sent = [a.reporter.outbox.get(timeout=30) for _ in range(2)]
        assert [(r.kind if r else None, r and r.rank, r and r.text) for r in sent] == [("comm_error", 0, "boom"),
                                                                                      ("resumed", None, "")]
        assert isinstance(sent[1], Resumed) and sent[1].timings == Timings(rebuild_s=0.2)

        # node 1 restores rank 0 from the peers: its private part from its own replica, the shared part from node 0
        timings = b.replicator.fetch({0: RankSource.from_wire({"private": [servers[1].addr],
                                                               "shared": [[servers[0].addr, 0]]})}, 5)
        assert b.slots.available() == {0: [5]} and timings.fetch_s >= timings.params_fetch_s > 0
        idx = b.slots.slot_of(0, 5)
        got = b.slots.view(0, idx)
        assert bytes(got[h.private_off:h.private_off + 100]) == b"p" * 100
        assert bytes(got[h.shared_off:h.shared_off + 100]) == b"s" * 100
    finally:
        link.close()


def _write_snapshot(link: AgentLink, step: int) -> SlotHeader:
    h = SlotHeader(step=step, meta_cap=64, meta_len=2, private_len=100, shared_len=100)
    w = link.request(wm.Write(nbytes=h.total_len), timeout=30)
    with open(w.path, "r+b") as f, mmap.mmap(f.fileno(), w.nbytes) as mm:
        mm[64:66] = b"{}"
        mm[h.private_off:h.private_off + 200] = b"x" * 200
        mm[:64] = h.pack()
    link.send(wm.Written(slot=w.slot, step=step))
    return h


def _join_as_rank_0(link: AgentLink) -> None:
    """Say hello as local rank 0, take the assignment, allocate slots for `_write_snapshot`'s layout."""
    link.send(wm.Hello(local_rank=0, pid=1, api=True))
    link.orders.get(timeout=30)
    link.request(wm.Alloc(nbytes=SlotHeader(step=0, meta_cap=64, meta_len=2, private_len=100,
                                            shared_len=100).total_len), timeout=30)


def test_a_holder_still_frozen_by_a_recovery_is_waited_for_not_reported(two_agents):
    """The resume reaches nodes one by one: node 0 may commit its next snapshot while its holder (node 1) is still
    frozen. That put is answered busy and retried until node 1 thaws - no comm_error (which started a needless
    local reset after a recovery); once node 0 is frozen itself, the commit fails quietly."""
    import threading
    (a, b), _ = two_agents
    link = AgentLink(a.sock_path)
    try:
        _join_as_rank_0(link)
        b.replicator.freeze(True)
        threading.Timer(0.3, b.replicator.freeze, (False,)).start()   # the fault: node 1 thaws 0.3 s later
        _write_snapshot(link, 7)
        with link.cv:
            assert link.cv.wait_for(lambda: link.committed_step == 7 or link.commit_error, timeout=30)
        assert link.commit_error is None and b.replicas.available() == {0: [7]}
        assert a.reporter.outbox.empty()

        b.replicator.freeze(True)          # a new recovery: the holder frozen, then this node too
        threading.Timer(0.3, a.replicator.freeze, (True,)).start()
        _write_snapshot(link, 8)
        with link.cv:
            assert link.cv.wait_for(lambda: link.commit_error is not None, timeout=30)
        assert "frozen" in link.commit_error and link.committed_step == 7
        assert a.reporter.outbox.empty()   # quiet: the recovery under way is the event, not this
    finally:
        link.close()


def test_a_worker_that_rejoined_the_recovery_may_snapshot_before_the_master_says_resume(two_agents):
    """Once a worker resumed the recovery's generation every rank is past its restore: its agent takes its next
    snapshot although the master's `resume` has not reached it yet (refused as "frozen", it started a second local
    reset). A `resumed` of an older generation thaws nothing."""
    (a, b), _ = two_agents
    link = AgentLink(a.sock_path)
    try:
        _join_as_rank_0(link)
        a.node.generation = 3
        a.replicator.freeze(True)                       # the recovery of generation 3: restore ordered, no resume yet
        link.send(wm.Resumed(generation=2))
        with pytest.raises(RuntimeError, match="frozen"):
            _write_snapshot(link, 4)
        link.send(wm.Resumed(generation=3))
        _write_snapshot(link, 5)
        with link.cv:
            assert link.cv.wait_for(lambda: link.committed_step == 5 or link.commit_error, timeout=30)
        assert link.commit_error is None and a.slots.available() == {0: [5]} and b.replicas.available() == {0: [5]}
    finally:
        link.close()


def test_a_quiesce_is_acknowledged_once_the_snapshots_written_before_it_are_settled(two_agents):
    """A `quiesced` that follows a `written` is acted on only once that snapshot is committed (or failed), so the
    inventory a recovery plans from is settled. Here the commit waits on a holder still frozen by a recovery for
    0.5 s."""
    import threading
    (a, b), _ = two_agents
    at_ack = []
    a.worker_ops.on_quiesce_ack = lambda: at_ack.append(a.slots.available())
    link = AgentLink(a.sock_path)
    try:
        _join_as_rank_0(link)
        b.replicator.freeze(True)
        threading.Timer(0.5, b.replicator.freeze, (False,)).start()
        _write_snapshot(link, 9)
        link.send(wm.Quiesced(generation=1, next_step=9))
        link.request(wm.Slots(), timeout=30)      # the quiesce has been handled
        assert at_ack == [{0: [9]}] and b.replicas.available() == {0: [9]}
    finally:
        link.close()


def test_replicas_are_received_into_the_buffers_the_store_keeps(two_agents):
    """Once a rank has both its buffers (from its third replica on), a replica goes over the wire straight into the
    older one (no new buffer a step); the newer replica stays whole while it is received, and bytes that fail the
    checksum leave the rank without that step, never with wrong bytes."""
    from phoenixrun.agents.peer import PeerError
    (a, b), _ = two_agents
    link = AgentLink(a.sock_path)
    try:
        _join_as_rank_0(link)
        buffers = []
        for step in (1, 2, 3, 4):
            _write_snapshot(link, step)
            with link.cv:
                assert link.cv.wait_for(lambda: link.committed_step == step or link.commit_error, timeout=30)
            assert link.commit_error is None
            buffers.append(b.replicas.held(0, step))
        assert b.replicas.available() == {0: [3, 4]}
        assert [SlotHeader.unpack(buf).step for buf in buffers[2:]] == [3, 4] and b.replicas.held(0, 2) is None
        assert buffers[2] is buffers[0] and buffers[3] is buffers[1] and buffers[0] is not buffers[1]
        assert b.replicas.get(0, 4)[200:400] == bytes(buffers[3])[200:400]

        # a put whose bytes do not match their checksum: received into the buffer of step 3, refused
        bad = bytearray(b.replicas.get(0, 4))
        h = SlotHeader.unpack(bad)
        bad[:64] = SlotHeader(5, h.meta_cap, h.meta_len, h.private_len, h.shared_len, h.crc_private ^ 1).pack()
        with pytest.raises(PeerError, match="checksum"):
            a.peers.call(peer_addr_of(a.node.world, 1), SlotRequest(PeerOp.PUT, 0, 5), bad)
        assert b.replicas.available() == {0: [4]} and SlotHeader.unpack(b.replicas.get(0, 4)).step == 4
    finally:
        link.close()


def test_restore_takes_the_next_option_when_one_is_refused(two_agents):
    """The plan names every option of each part; the fetching agent (node 1) refuses an unreachable holder and a
    peer whose bytes are not the lost rank's (rank 1's stage: same size, other bytes), reports each refusal and
    restores from the next option; with no good option left it refuses the restore."""
    from phoenixrun.agents.peer import PeerError
    from phoenixrun.agents.slots import IntegrityError
    from tests.test_restore_integrity import STEP, seal
    (a, b), servers = two_agents
    replica, shared = seal(a.slots, 0, b"\x01" * 64, bytes(range(256)))
    seal(a.slots, 1, b"\x02" * 64, bytes(reversed(range(256))))        # a "peer" holding other bytes
    b.replicas.put(0, STEP, bytearray(replica))
    dead, holder, peer = "127.0.0.1:1", servers[1].addr, servers[0].addr

    def refusals():
        out = []
        while not b.reporter.outbox.empty():
            out.append(b.reporter.outbox.get_nowait())
        return [(r.kind, r.part, r.addr, r.source_rank, r.integrity) for r in out if isinstance(r, RestoreRefused)]

    b.replicator.fetch({0: RankSource.from_wire({"private": [dead, holder], "shared": [[peer, 1], [peer, 0]]})}, STEP)
    mm = b.slots.view(0, b.slots.slot_of(0, STEP))
    h = SlotHeader.unpack(mm)
    assert bytes(mm[:h.replicated_len]) == replica and bytes(mm[h.shared_off:h.shared_off + h.shared_len]) == shared
    assert refusals() == [("restore_refused", "private", dead, 0, False), ("restore_refused", "shared", peer, 1, True)]

    b.slots.forget(0)
    with pytest.raises(IntegrityError, match=r"rank 0: every source of its shared state was refused: .*\(rank 1\)"):
        b.replicator.fetch({0: RankSource.from_wire({"private": [holder], "shared": [[peer, 1]]})}, STEP)
    assert b.slots.available().get(0, []) == []                        # nothing installed
    with pytest.raises(PeerError, match="no source of its shared state could be used") as e:
        b.replicator.fetch({0: RankSource.from_wire({"private": [holder], "shared": [[dead, 0], [peer, 1]]})}, STEP)
    assert not isinstance(e.value, IntegrityError)     # one was unreachable: the master plans again
    assert [r[1:] for r in refusals()] == [("shared", peer, 1, True), ("shared", dead, 0, False), ("shared", peer, 1, True)]


def test_a_reshape_hands_each_new_worker_its_images_and_predecessor():
    from phoenixrun.agents.node import NodeState
    node = NodeState(node_id="n", nproc_per_node=2, slot=1, job=JobTerms(run_id="test", store_port=1, nnodes=3, nproc_per_node=2, tp=1, pp=1, max_restarts=0))
    node.take_directive(decode({"command": "restart", "slot": 1, "nnodes": 2}))
    assert node.terms().nnodes == 2
    assert node.reshard_of(0) is None
    # over the wire the predecessor map's keys arrive as strings: decoded int-keyed once, with the directive
    order = decode({"command": "restart", "restore_step": 8, "reshard": {
        "kind": "shrink", "old_world": 6, "step": 8, "predecessor": {"2": 4, "3": 5}, "images": []}})
    assert order.own.reshard is not None and order.own.reshard.predecessor == {2: 4, 3: 5}
    node.reshard = Handover(6, order.own.reshard.predecessor,
                            {4: (0, "/dev/shm/a"), 5: (1, "/dev/shm/b"), 2: (0, "/dev/shm/c")})
    assert node.reshard_of(0) == WorkerReshard(6, 4, {4: "/dev/shm/a", 2: "/dev/shm/c"})
    assert node.reshard_of(1) == WorkerReshard(6, 5, {5: "/dev/shm/b"})
    # and the worker's assignment carries it over the channel as the same type
    assign = Assign(rank=2, local_rank=0, slot=1, nnodes=2, nproc_per_node=2, world_size=4, generation=3,
                    store_prefix=None, restart_count=0, restore_step=8, master_addr="h", master_port=1, tp=1, pp=1,
                    run_id="r", reshard=node.reshard_of(0))
    assert wo_decode(json.loads(json.dumps(assign.to_wire()))) == assign

"""A node's standby worker (agents/standby.py): the decisions as tables, and the agent's side with real processes -
started once the node trains, its hello kept for later, handed a dead worker's rank by the resume of a local reset,
replenished once the node trains again. (End to end with the example, bit for bit: test_e2e_standby_worker.py.)"""
import json
import os
import signal
import time

import pytest

from phoenixrun.agents.agent import Agent, AgentConfig
from phoenixrun.agents.ipc import WorkerChannelServer
from phoenixrun.agents.standby import IdleBudget, NodeView, Tend, after_exit, over_budget, tend, usable
from phoenixrun.agents.workers import Placement, WorkerSpec, standby_env, worker_env
from phoenixrun.protocol.timings import Timings
from phoenixrun.protocol.replies import JobTerms

ON = dict(enabled=True, api=True, active=True, have=False, current=True, settled=True, finishing=False)


@pytest.mark.parametrize("change, expected", [
    ({}, Tend.SPAWN),                                   # an active API node that trains: start one
    ({"settled": False}, Tend.NOTHING),                 # a recovery is under way: not now (its CPU is the recovery's)
    ({"api": False}, Tend.NOTHING),                     # a torchrun-semantics script: never
    ({"enabled": False}, Tend.NOTHING),                 # --no-standby-worker, or off for this run
    ({"active": False}, Tend.NOTHING),                  # a spare: its warm workers wait already
    ({"finishing": True}, Tend.NOTHING),                # the script finished on a rank
    ({"have": True}, Tend.NOTHING),                     # one is there
    ({"have": True, "settled": False}, Tend.NOTHING),   # ... kept through a recovery: it may be needed there
    ({"have": True, "current": False}, Tend.RETIRE),    # ... started before a full restart
    ({"have": True, "finishing": True}, Tend.RETIRE),
    ({"have": True, "enabled": False}, Tend.RETIRE),    # ... turned off (over its idle budget)
    ({"have": True, "active": False}, Tend.RETIRE),
])
def test_tend(change, expected):
    assert tend(NodeView(**{**ON, **change})) is expected


@pytest.mark.parametrize("alive, connected, current, expected", [
    (True, True, True, True),
    (True, False, True, False),     # still importing: a new process is no slower, and it runs the script's start
    (False, True, True, False),     # died while waiting
    (True, True, False, False),     # started before a full restart
])
def test_usable(alive, connected, current, expected):
    assert usable(alive=alive, connected=connected, current=current) is expected


@pytest.mark.parametrize("connected, rc, deaths, off_because", [
    (False, 1, 0, "before it reached phoenixrun.init()"),   # the script cannot have one: off for the run
    (False, -9, 5, "before it reached phoenixrun.init()"),
    (True, -9, 0, None),                                    # killed while waiting: start another
    (True, -9, 1, None),
    (True, -9, 2, "3 standby workers died while waiting (the last with signal 9)"),
])
def test_after_exit(connected, rc, deaths, off_because):
    why = after_exit(connected=connected, returncode=rc, idle_deaths=deaths)
    assert (why is None) if off_because is None else (off_because in why)


@pytest.mark.parametrize("cpu_s, wall_s, rss_mb, over", [
    (0.0, 10.0, 300, None),
    (0.19, 10.0, 300, None),               # 1.9% of a core
    (0.5, 10.0, 300, "5.0% of a core"),    # the script works before init()
    (0.0, 10.0, 4096, "4096 MiB"),         # ... or builds large state there
    (0.0, 0.0, 300, None),
])
def test_over_budget(cpu_s, wall_s, rss_mb, over):
    why = over_budget(cpu_s=cpu_s, wall_s=wall_s, rss_bytes=rss_mb << 20, budget=IdleBudget())
    assert (why is None) if over is None else (over in why)


def test_standby_env_has_no_rank_and_no_local_rank():
    p = Placement(local_rank=0, nproc_per_node=2, nnodes=2, slot=None, rank=None, master_addr="h", master_port=1,
                  run_id="r", restart_count=0, max_restarts=0, generation=3, agent_sock="/tmp/s", error_file="/e")
    e = standby_env(worker_env({"LOCAL_RANK": "7", "RANK": "9", "PATH": "/bin"}, p))
    assert e["PHOENIXRUN_STANDBY"] == "1" and e["PHOENIXRUN_WARM_SPARE"] == "1" and e["PATH"] == "/bin"
    assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK"} & e.keys()
    assert e["LOCAL_WORLD_SIZE"] == "2" and e["PHOENIXRUN_AGENT_SOCK"] == "/tmp/s"


# A worker without torch: says hello as phoenixrun.init() does, writes the assignment it gets, reports steps.
PROBE = """
import json, os, sys, time
from pathlib import Path
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.runtime.agent_link import AgentLink
link = AgentLink(os.environ["PHOENIXRUN_AGENT_SOCK"])
link.send(wm.Hello(local_rank=int(os.environ.get("LOCAL_RANK", "0")), pid=os.getpid(), api=sys.argv[2] == "api"))
assign = link.orders.get()
seen = {"assign": assign.to_wire(), "env_local_rank": os.environ.get("LOCAL_RANK"), "standby": os.environ.get("PHOENIXRUN_STANDBY")}
Path(sys.argv[1], f"{os.getpid()}.json").write_text(json.dumps(seen))
for step in range(3000):
    link.send(wm.Progress(step=step, step_s=0.01))
    time.sleep(0.2)
"""


def _until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def node(tmp_path):
    """An active node's agent (slot 1, two local ranks), built but not started: its channel serves real probe
    workers; reports stay in its outbox."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    a = Agent(AgentConfig(endpoint="127.0.0.1:1", secret="s3cret",
                          spec=WorkerSpec(str(script), (str(tmp_path), "api")), nproc_per_node=2))
    a.node.slot, a.node.role = 1, "active"
    a.node.job = JobTerms(run_id="test", store_port=1, nnodes=2, nproc_per_node=1, tp=1, pp=1, max_restarts=0)
    channel = WorkerChannelServer(a.sock_path, a.worker_ops.on_message, a.worker_ops.on_close)
    yield a
    a.supervisor.kill_all()
    channel.close()
    a.slots.clear()


def _seen(tmp_path, pid: int) -> dict:
    p = tmp_path / f"{pid}.json"
    _until(lambda: p.exists() and p.read_text(), f"the assignment of pid {pid}")
    return json.loads(p.read_text())


def _watch_until(a: Agent, cond, what: str) -> None:
    def look():
        a.supervisor.watch()
        return cond()
    _until(look, what)


def test_a_dead_workers_rank_goes_to_the_standby_which_is_then_replenished(node, tmp_path):
    a, sup = node, node.supervisor
    with a.node.lock:
        sup.spawn_all(rank_known=True)
    _watch_until(a, lambda: sup.settled(), "both ranks connected and stepping")
    assert a.node.api and sup.standby.alive                  # started once the node trains
    standby = sup.standby.worker.pid
    _watch_until(a, lambda: sup.standby.usable(a.node.restart_count), "the standby's hello")
    assert sup.live_pids() == [sup.workers[0].pid, sup.workers[1].pid]      # not among the ranks' workers
    keep, victim = sup.workers[0].pid, sup.workers[1]
    os.kill(victim.pid, signal.SIGKILL)                       # local rank 1 dies
    _watch_until(a, lambda: 1 in sup.reported_exit, "the exit reported")
    with a.node.lock:                                         # the local reset's restore (executor._restore)
        a.slots.frozen = True
        a.node.restore_step = 7
        a.phases.expect_resume(a.node.local_ranks())
        sup.last_progress.clear()
        sup.resume(7)
    assert sup.workers[1].pid == standby and sup.workers[0].pid == keep and not sup.standby.alive
    seen = _seen(tmp_path, standby)
    assert seen["standby"] == "1" and seen["env_local_rank"] is None     # it learns its local rank from this:
    assert (seen["assign"]["rank"], seen["assign"]["local_rank"], seen["assign"]["restore_step"]) == (3, 1, 7)
    for _ in range(5):                                        # not during the recovery
        sup.watch()
        assert not sup.standby.alive
    with a.node.lock:                                         # the recovery is over; the standby steps as rank 3
        a.slots.frozen = False
        a.phases.resumed(0, Timings())
        a.phases.resumed(1, Timings())
    _watch_until(a, lambda: sup.standby.alive, "a new standby once the node trains again")
    assert sup.standby.worker.pid not in (standby, keep) and sup.workers[1].rank == 3


def test_a_standby_that_dies_before_init_turns_standbys_off_for_the_run(node, tmp_path):
    a, sup = node, node.supervisor
    with a.node.lock:
        sup.spawn_all(rank_known=True)
    _watch_until(a, lambda: sup.settled(), "both ranks connected and stepping")
    (tmp_path / "probe.py").write_text("import os, sys\nsys.exit(int(os.environ['LOCAL_RANK']))\n")
    _watch_until(a, lambda: sup.standby.off is not None, "the standby's exit")
    assert "before it reached phoenixrun.init()" in sup.standby.off
    for _ in range(5):
        sup.watch()
        assert sup.standby.worker is None                     # not started again


@pytest.mark.parametrize("api, enabled", [(False, True), (True, False)])
def test_no_standby_without_the_api_or_when_turned_off(tmp_path, api, enabled):
    """A script that does not use the phoenixrun API (torchrun's semantics: it never waits in init()) gets no
    standby, and neither does a job run with --no-standby-worker."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    a = Agent(AgentConfig(endpoint="127.0.0.1:1", secret="s3cret",
                          spec=WorkerSpec(str(script), (str(tmp_path), "api" if api else "plain")),
                          nproc_per_node=1, standby_worker=enabled))
    a.node.slot, a.node.role = 0, "active"
    a.node.job = JobTerms(run_id="test", store_port=1, nnodes=1, nproc_per_node=1, tp=1, pp=1, max_restarts=0)
    channel = WorkerChannelServer(a.sock_path, a.worker_ops.on_message, a.worker_ops.on_close)
    try:
        with a.node.lock:
            a.supervisor.spawn_all(rank_known=True)
        _watch_until(a, lambda: a.supervisor.settled(), "the rank connected and stepping")
        for _ in range(5):
            a.supervisor.watch()
        assert a.supervisor.standby.worker is None and a.node.api is api
    finally:
        a.supervisor.kill_all()
        channel.close()
        a.slots.clear()


def test_a_late_hello_of_a_retired_standby_is_not_taken_for_local_rank_0(node):
    """A standby retired (or dead) with its hello still unread says local rank 0 (it has no LOCAL_RANK): that hello
    must not replace rank 0's channel."""
    import socket
    from phoenixrun.agents.ipc import WorkerConn
    a, sup = node, node.supervisor
    with a.node.lock:
        sup.spawn_all(rank_known=True)
    _watch_until(a, lambda: sup.standby.usable(a.node.restart_count), "the standby's hello")
    gone = sup.standby.worker.pid
    with a.node.lock:
        sup.standby.retire()
        rank0 = sup.conns[0]
        mine, theirs = socket.socketpair()
        try:
            late = WorkerConn(mine)
            late.local_rank, late.pid = 0, gone          # as WorkerOps._hello sets them from the message
            sup.hello(late, 0)
            assert sup.conns[0] is rank0 and late.local_rank is None
        finally:
            mine.close()
            theirs.close()

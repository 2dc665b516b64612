"""The generation lifecycle of the reconfigurable groups (runtime/generations.py), on CPU.

The same `Generations` logic drives gloo and NCCL generations. Here it runs with real gloo backends and a real
TCPStore, two ranks as threads of this process; the NCCL generation runs with a stand-in for the one NCCL-specific
call (`NcclGeneration.make_nccl`: a real gloo backend behind ProcessGroupNCCL's abort/shutdown surface), since no
CUDA build is installed here. tests/test_gpu.py runs the real ProcessGroupNCCL on a GPU.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from phoenixrun.config import WorkerSettings
from phoenixrun.runtime.generations import (DeviceRouted, GlooGeneration, Generations, NcclGeneration,
                                           generation_kind, nccl_env)
from phoenixrun.runtime.process_group import GroupRegistry, ReconfigurableProcessGroup

TIMEOUT = timedelta(seconds=20)   # a hang the abort failed to end fails the test in 20 s instead of wedging it


# ------------------------------------------------------------------------------------------------ pure decisions
NCCL_ENV = [
    # (environment, variables phoenixrun sets, warns)
    ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0",
          "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}, False),
    # torch's default (3, SkipCleanUp) and TearDown (1) kill the process on a peer's failure: overridden, named
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                                                "TORCH_NCCL_BLOCKING_WAIT": "0",
                                                "TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}, True),
    ({"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "5"},
     {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, True),
    # choices that keep the process alive are the user's
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"},
     {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "60"}, False),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0",
      "TORCH_NCCL_NONBLOCKING_TIMEOUT": "600"}, {}, False),
]


@pytest.mark.parametrize("environ,expected,warns", NCCL_ENV)
def test_nccl_env(environ, expected, warns):
    out, warnings = nccl_env(environ, 60.0)
    assert out == expected
    assert bool(warnings) == warns
    if warns:
        assert "2" in warnings[0] and "down" in warnings[0]


def test_backend_setting_names_the_generation_kind():
    assert WorkerSettings.from_env({}).backend == "gloo"
    assert generation_kind(WorkerSettings.from_env({}).backend) is GlooGeneration
    assert generation_kind(WorkerSettings.from_env({"PHOENIXRUN_BACKEND": "nccl"}).backend) is NcclGeneration
    with pytest.raises(ValueError, match="PHOENIXRUN_BACKEND='mpi'.*gloo, nccl"):
        generation_kind("mpi")


def test_device_routing_sends_cpu_tensors_to_gloo():
    calls = []
    gloo = SimpleNamespace(allreduce=lambda ts, *a: calls.append(("gloo", ts)), barrier=lambda *a: calls.append("b"))
    nccl = SimpleNamespace(allreduce=lambda ts, *a: calls.append(("nccl", ts)))
    r = DeviceRouted(gloo, nccl)
    t = torch.ones(1)
    r.allreduce([t])
    r.barrier()
    assert calls == [("gloo", [t]), "b"]
    assert DeviceRouted.on_cuda(([[t]], [t])) is False and DeviceRouted.on_cuda((3, "x")) is None
    with pytest.raises(AttributeError):
        r.no_such_op


# ------------------------------------------------------------------------------------------------ the lifecycle
class NcclStandIn:
    """What a generation calls on a ProcessGroupNCCL, over a real gloo backend: collectives, abort(), shutdown().
    After abort() every op raises the error ProcessGroupNCCL raises on an aborted communicator."""

    made: list["NcclStandIn"] = []

    def __init__(self, store, rank, size, timeout):
        self.rank = rank
        self.inner = ProcessGroupGloo(store, rank, size, timeout)
        self.aborted = self.shut = False
        NcclStandIn.made.append(self)

    def abort(self):
        self.aborted = True

    def shutdown(self):
        self.shut = True

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def op(*args, **kwargs):
            if self.aborted:
                raise dist.DistBackendError(f"NCCL communicator was aborted on rank {self.rank}.")
            return fn(*args, **kwargs)
        return op


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, use_libuv=True)
    yield server
    del server


def both(fn):
    """fn(rank) on two threads (the two members of a generation); the results, or the first exception."""
    out, errors = [None, None], []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a member never returned"
    if errors:
        raise errors[0]
    return out


def members(kind, store):
    """Per rank: its registry (the world and one subgroup over both ranks, as dist.new_group makes) and lifecycle."""
    ranks = []
    for r in (0, 1):
        reg = GroupRegistry()
        reg.world = ReconfigurableProcessGroup(r, 2)
        sub = reg.create(SimpleNamespace(global_ranks_in_group=[0, 1], group_rank=r, group_size=2, group_id="7"))
        ranks.append((reg, sub, Generations(kind, "127.0.0.1", store.port, r, 2, TIMEOUT, reg)))
    return ranks


def allreduce(pg, value):
    t = torch.tensor([float(value)])
    pg.allreduce([t]).wait()
    return t.item()


@pytest.mark.parametrize("kind", [GlooGeneration, NcclGeneration])
def test_abort_mid_collective_then_the_next_generation_works(kind, store, monkeypatch):
    """create -> a collective hangs on a member that never joins it -> abort from another thread ends it at once ->
    connect the next generation over the same membership -> collectives on the same group objects succeed."""
    monkeypatch.setattr(NcclGeneration, "make_nccl", staticmethod(NcclStandIn))
    NcclStandIn.made = []
    m = members(kind, store)
    both(lambda r: m[r][2].connect(0, "/test/gen0-a/"))
    (reg0, sub0, gens0), (reg1, sub1, gens1) = m
    assert gens0.current.generation == 0 and reg0.world.inner is gens0.current.backend
    assert both(lambda r: allreduce(m[r][0].world, r + 1)) == [3.0, 3.0]
    assert both(lambda r: allreduce(m[r][1], 10 * (r + 1))) == [30.0, 30.0]

    # rank 1 is "dead": rank 0's all-reduce waits for it until the abort
    failed = []

    def stuck():
        t0 = time.monotonic()
        try:
            allreduce(reg0.world, 1)
        except Exception as e:  # noqa: BLE001
            failed.append((e, time.monotonic() - t0))
    t = threading.Thread(target=stuck, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not failed, "the collective should be waiting for its peer"
    t_abort = time.monotonic()
    assert gens0.abort() > 0               # the generation's sockets were shut down
    gens1.abort()
    t.join(10)
    assert not t.is_alive(), "abort did not end the collective"
    assert failed and time.monotonic() - t_abort < 5, failed
    old = gens0.current
    assert old.aborted and not old.destroyed
    if kind is NcclGeneration:
        world_nccl = old.backend.nccl
        assert world_nccl.aborted and all(b.nccl.aborted for b in old.subgroups)

    both(lambda r: m[r][2].connect(1, "/test/gen1-b/"))
    assert gens0.current.generation == 1 and reg0.world.inner is gens0.current.backend
    assert both(lambda r: allreduce(m[r][0].world, r + 1)) == [3.0, 3.0]
    assert both(lambda r: allreduce(m[r][1], 5)) == [10.0, 10.0]
    if kind is NcclGeneration:
        # NCCL: the aborted generation is destroyed at the rebuild (its communicators are gone already)
        assert old.destroyed and world_nccl.shut and gens0.retired == []
    else:
        # gloo: kept referenced until exit (destroying a gloo backend whose peer vanished is not safe)
        assert not old.destroyed and gens0.retired == [old]
    for _, _, g in m:
        g.close()
    assert old.destroyed and reg0.world.inner is None and gens0.current is None


def test_a_rendezvous_blocked_on_a_missing_member_is_aborted(store):
    """A quiesce while the world's rendezvous waits for a member that never comes: the pending generation is
    aborted, connect raises, nothing is current, and the next generation can still be made."""
    m = members(GlooGeneration, store)
    reg0, _, gens0 = m[0]
    err = []
    t = threading.Thread(target=lambda: _catch(err, gens0.connect, 0, "/test/lonely/"), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while gens0.pending is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert t.is_alive(), "the rendezvous should be waiting for rank 1"
    gens0.abort()
    t.join(10)
    assert not t.is_alive() and err, "abort did not end the rendezvous"
    assert gens0.current is None and gens0.pending is None and reg0.world.inner is None
    assert len(gens0.retired) == 1 and gens0.retired[0].aborted
    both(lambda r: m[r][2].connect(1, "/test/gen1-c/"))
    assert both(lambda r: allreduce(m[r][0].world, 2)) == [4.0, 4.0]
    for _, _, g in m:
        g.close()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        errors.append(e)


def test_abort_before_any_generation_shuts_what_was_opened_since(store):
    """A replacement process still restoring (no generation yet) that gets a quiesce: nothing to abort but the
    sockets opened since the lifecycle began, as before the lifecycle had a class."""
    reg = GroupRegistry()
    reg.world = ReconfigurableProcessGroup(0, 1)
    gens = Generations(GlooGeneration, "127.0.0.1", store.port, 0, 1, TIMEOUT, reg)
    client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False, use_libuv=True)
    assert gens.abort() >= 1
    with pytest.raises(Exception):
        client.set("k", "v")


def test_an_abort_leaves_the_scripts_own_sockets_alone(store):
    """The script's sockets opened after the generation (a logger's connection, a data loader's) survive a
    recovery's abort; the generation's own (its store client, its pairs) are shut down. Before, every socket
    opened since the generation began was."""
    import socket
    m = members(GlooGeneration, store)
    both(lambda r: m[r][2].connect(0, "/test/own-a/"))
    listener = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    try:
        # (both members are threads of this process here: the first abort shuts what both made)
        assert sum(g.abort() for _, _, g in m) >= 1     # the generation's store clients and pairs
        mine.sendall(b"still here")
        assert theirs.recv(64) == b"still here"
        with pytest.raises(Exception):
            allreduce(m[0][0].world, 1)                 # the generation's pairs are gone
    finally:
        for s in (mine, theirs, listener):
            s.close()
        for _, _, g in m:
            g.close()


# ------------------------------------------------------------------------------------------------ abortable waits
@pytest.fixture
def unchecked(monkeypatch):
    """Collectives not compared across the group (a test's earlier recovery may have armed the check: its
    all-gather would wait for a member that is not there)."""
    from phoenixrun.runtime.collective_check import CHECKS
    monkeypatch.setattr(CHECKS, "armed", False)


def test_a_wait_no_socket_shutdown_reaches_is_ended_by_the_abort(store, unchecked):
    """The wait on a collective whose peer never joins it ends when the generation fails its in-flight ops - with
    no socket shut down (the case of benchmarks/detection.py's comm-timeout stalls: a survivor in gloo's
    Work::wait with no connection left to shut). Through the future too, as DDP's reducer waits on it; the error is
    one the step recovers from."""
    from phoenixrun.runtime.recovery_client import recoverable_cause
    m = members(GlooGeneration, store)
    both(lambda r: m[r][2].connect(0, "/test/inflight-a/"))
    reg0, _, gens0 = m[0]
    t = torch.tensor([1.0])
    work = reg0.world.allreduce([t])                 # rank 1 never joins it
    chained = work.get_future().then(lambda f: f.value())
    # a C++ consumer of the future (collect_all's combinator, as DDP's reducer): it must see a failure, not a
    # completed future holding an exception object (Future.set_exception's way; DDP then crashed reading it)
    combined = torch.futures.collect_all([work.get_future()])
    time.sleep(0.3)
    assert not work.is_completed() and not chained.done()
    t0 = time.monotonic()
    assert gens0.current.in_flight.fail() == 1
    with pytest.raises(dist.DistBackendError, match="generation 0 was aborted"):
        work.wait()
    for wait in (chained.wait, combined.wait, work.get_future().wait):
        with pytest.raises(Exception) as e:
            wait()
        assert recoverable_cause(e.value) is not None, e.value
    assert time.monotonic() - t0 < 5 and not work.is_success() and work.exception() is not None
    with pytest.raises(dist.DistBackendError, match="generation 0 was aborted"):
        reg0.world.allreduce([t]).wait()             # a later op of the aborted generation fails at once
    for _, _, g in m:
        g.abort()
        g.close()


def test_every_op_completes_or_fails_once_when_the_abort_races_completions(store, unchecked, capfd):
    """Ops completing on gloo's threads while rank 0's abort fails what is still pending: each of rank 0's works,
    waited on directly or through its future, either holds its true result or raises the abort's error - never both
    (a future's second completion would raise on gloo's thread), never neither (a wait that hangs)."""
    m = members(GlooGeneration, store)
    both(lambda r: m[r][2].connect(0, "/test/inflight-b/"))
    n = 200

    def issue(r):
        ts = [torch.tensor([float(i + r)]) for i in range(n)]
        works = [m[r][0].world.allreduce([x]) for x in ts]
        if r == 0:
            for w in works[::2]:
                w.get_future()                       # every other one also through its future (DDP's way)
            m[0][2].current.in_flight.fail()         # mid-stream: some done, some not
        return ts, works
    (ts0, works0), (ts1, works1) = both(issue)
    outcomes = {"done": 0, "failed": 0}
    for i, (x, w) in enumerate(zip(ts0, works0)):
        try:
            w.get_future().wait() if i % 2 == 0 else w.wait()
        except (dist.DistBackendError, RuntimeError) as e:
            assert "generation 0 was aborted" in str(e), e
            outcomes["failed"] += 1
        else:
            assert x.item() == 2 * i + 1, (i, x)
            outcomes["done"] += 1
    for w in works1:                                 # rank 1's ops ran to the end: rank 0's gloo ops did run
        w.wait()
    assert outcomes["done"] + outcomes["failed"] == n and outcomes["failed"] > 0, outcomes
    assert "completed Future as complete again" not in capfd.readouterr().err   # torch logs a callback's error
    for _, _, g in m:
        g.close()


def test_ddp_backward_waiting_on_a_missing_peer_raises_when_the_generation_is_aborted(store, unchecked):
    """DDP's reducer (C++) waits on its bucket's future at the end of backward. The abort must fail that future
    natively: with Future.set_exception, C++ saw a completed future whose value was the exception object, read
    the bucket's tensor out of it and the process died of SIGSEGV (every rank, in benchmarks/detection.py)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phoenixrun.runtime.recovery_client import recoverable_cause
    m = members(GlooGeneration, store)
    both(lambda r: m[r][2].connect(0, "/test/inflight-ddp/"))

    def build(r):
        torch.manual_seed(0)
        return DDP(torch.nn.Linear(8, 8), process_group=m[r][0].world)
    ddp0, _ = both(build)
    failed = []

    def backward():    # rank 0 alone: its bucket's all-reduce waits for rank 1, which never joins it
        try:
            ddp0(torch.ones(2, 8)).sum().backward()
        except Exception as e:  # noqa: BLE001
            failed.append(e)
    t = threading.Thread(target=backward, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not failed, "the backward should wait for its bucket"
    m[0][2].current.in_flight.fail()
    t.join(10)
    assert not t.is_alive() and failed, "the abort did not end DDP's wait"
    assert recoverable_cause(failed[0]) is not None and "generation 0 was aborted" in str(failed[0]), failed[0]
    for _, _, g in m:
        g.abort()
        g.close()


class ScriptedWork:
    """A backend Work that plays one interleaving: its first tick times out just before the op completes (the
    race a real gloo op hit once in 300 waits of 0-45 ms here on 2026-12-07, and six e2e tests of one suite run)."""

    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    def wait(self, timeout=None):
        self.calls.append(timeout)
        if len(self.calls) == 1:
            raise RuntimeError("Operation timed out!")   # the tick's, raised as the op completes
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return True

    def is_completed(self):
        return bool(self.calls)


@pytest.mark.parametrize("outcome", [True, RuntimeError("Connection closed by peer")])
def test_a_tick_that_times_out_as_the_op_completes_yields_the_ops_own_outcome(outcome):
    from phoenixrun.runtime.abortable import AbortableWork, InFlight
    work = AbortableWork(ScriptedWork(outcome), InFlight(3))
    if outcome is True:
        assert work.wait() is True
    else:
        with pytest.raises(RuntimeError, match="Connection closed"):
            work.wait()

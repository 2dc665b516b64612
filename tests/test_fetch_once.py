"""A replacement's fetch (agents/replicator.py::fetch): the parameters two lost ranks recorded identically (the DDP
ranks of one node) travel once; ranks whose parameters differ (pipeline stages) each get their own. The installed
snapshot's second slot is a placeholder until `fill` grows it, and `fill` never replaces a slot handed out for
writing. Real agents' slot memories and peer servers on loopback, no worker processes."""
import os

import pytest

from phoenixrun.agents.agent import Agent
from phoenixrun.agents.peer import PeerServer
from phoenixrun.agents.slots import LocalSlots
from phoenixrun.agents.workers import WorkerSpec
from phoenixrun.config import AgentConfig
from phoenixrun.protocol import PeerOp
from phoenixrun.protocol.replies import JobTerms
from phoenixrun.protocol.restore import RankSource
from phoenixrun.slot_format import SlotHeader
from tests.test_restore_integrity import seal as seal_step

STEP = 5


def seal(slots: LocalSlots, rank: int, private: bytes, shared: bytes) -> SlotHeader:
    """S_STEP of `rank` written, sealed and committed as its worker and agent would; its sealed header."""
    replicated, _ = seal_step(slots, rank, private, shared, STEP)
    return SlotHeader.unpack(replicated)


@pytest.fixture
def source_and_spare():
    """The agent holding ranks 0 and 1 (a drained node's, serving them as it would) and the spare fetching them;
    the source's GET_SHARED requests are counted."""
    job = JobTerms(run_id="test", store_port=1, nnodes=2, nproc_per_node=2, tp=1, pp=1, max_restarts=0)
    agents = []
    for slot in (0, 1):
        a = Agent(AgentConfig(endpoint="127.0.0.1:1", secret="s3cret", spec=WorkerSpec("unused.py"),
                              nproc_per_node=2))
        a.node.slot, a.node.job, a.node.role = slot, job, "active"
        agents.append(a)
    source, spare = agents
    served: list[int] = []
    handlers = source.replicator.peer_handlers()
    get_shared = handlers[PeerOp.GET_SHARED]

    def counted(h, payload):
        served.append(h["rank"])
        return get_shared(h, payload)
    handlers[PeerOp.GET_SHARED] = counted
    server = PeerServer("127.0.0.1", "s3cret", handlers, sinks=source.replicator.peer_sinks())
    yield source, spare, server.addr, served
    server.close()
    for a in agents:
        a.slots.clear()


def _plan(addr: str) -> dict[int, RankSource]:
    return {r: RankSource.from_wire({"private": [addr], "shared": [[addr, r]]}) for r in (0, 1)}


def _shared_of(slots: LocalSlots, rank: int) -> bytes:
    mm = slots.view(rank, slots.slot_of(rank, STEP))
    h = SlotHeader.unpack(mm)
    return bytes(mm[h.shared_off:h.shared_off + h.shared_len])


def test_identical_parameters_travel_once(source_and_spare):
    source, spare, addr, served = source_and_spare
    params = os.urandom(4096)
    for r in (0, 1):
        seal(source.slots, r, bytes([r]) * 300, params)       # DDP: each its own optimizer state, same parameters
    timings = spare.replicator.fetch(_plan(addr), STEP)
    assert len(served) == 1
    assert spare.slots.available() == {0: [STEP], 1: [STEP]}
    assert _shared_of(spare.slots, 0) == _shared_of(spare.slots, 1) == params
    assert timings.install_s is not None and timings.fetch_s >= timings.params_fetch_s + timings.install_s


def test_different_parameters_each_travel(source_and_spare):
    source, spare, addr, served = source_and_spare
    stages = [os.urandom(4096), os.urandom(4096)]              # same size, other bytes: two pipeline stages
    for r in (0, 1):
        seal(source.slots, r, bytes([r]) * 300, stages[r])
    spare.replicator.fetch(_plan(addr), STEP)
    assert sorted(served) == [0, 1]
    assert [_shared_of(spare.slots, r) for r in (0, 1)] == stages


def test_the_second_slot_is_grown_after_the_fetch_not_during_it(source_and_spare):
    source, spare, addr, _ = source_and_spare
    h = seal(source.slots, 0, b"p" * 300, os.urandom(64 * 1024))
    seal(source.slots, 1, b"q" * 300, os.urandom(64 * 1024))
    spare.replicator.fetch(_plan(addr), STEP)
    committed = spare.slots.slot_of(0, STEP)
    other = 1 - committed
    assert spare.slots.path(0, committed)[1] >= h.total_len
    assert spare.slots.path(0, other)[1] < h.total_len        # a placeholder until filled
    spare.replicator.fill([0, 1])
    for r in (0, 1):
        assert spare.slots.path(r, other)[1] == spare.slots.path(r, committed)[1]
    idx = spare.slots.begin_write(0, h.total_len)              # the first snapshot after the restore: no growth
    assert idx == other and spare.slots.path(0, idx)[1] >= h.total_len


def test_fill_leaves_a_slot_handed_out_for_writing_alone(source_and_spare):
    source, spare, addr, _ = source_and_spare
    h = seal(source.slots, 0, b"p" * 300, os.urandom(64 * 1024))
    seal(source.slots, 1, b"q" * 300, os.urandom(64 * 1024))
    spare.replicator.fetch(_plan(addr), STEP)
    idx = spare.slots.begin_write(0, h.total_len)             # the writer came first: it grew the slot itself
    granted = spare.slots.path(0, idx)
    spare.replicator.fill([0])
    assert spare.slots.path(0, idx) == granted                  # the path the writer holds is still the slot
    assert _shared_of(spare.slots, 0) == _shared_of(source.slots, 0)


def test_a_writer_arriving_while_fill_grows_keeps_its_slot(source_and_spare, monkeypatch):
    """The interleaving `fill` guards against: its growth is under way (outside the lock) when the worker's first
    write is handed the slot; the fill's file is dropped, the writer's stays."""
    import phoenixrun.agents.slots as slots_mod
    source, spare, addr, _ = source_and_spare
    h = seal(source.slots, 0, b"p" * 300, os.urandom(64 * 1024))
    seal(source.slots, 1, b"q" * 300, os.urandom(64 * 1024))
    spare.replicator.fetch(_plan(addr), STEP)
    real, granted = slots_mod._prefault, []

    def writer_meanwhile(mm):
        real(mm)
        if not granted:            # the fill's growth: the writer comes now (its own growth pre-faults too)
            granted.append(None)
            idx = spare.slots.begin_write(0, h.total_len)
            granted[0] = (idx, spare.slots.path(0, idx))
    monkeypatch.setattr(slots_mod, "_prefault", writer_meanwhile)
    spare.replicator.fill([0])
    idx, path = granted[0]
    assert spare.slots.path(0, idx) == path

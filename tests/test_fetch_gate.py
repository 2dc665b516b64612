"""A replacement's workers set up while their agent fetches their state: their `slots` request waits for the fetch
(agents/fetch_gate.py) and is answered with the slots once the state is in, or `unavailable` when it will not come."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from phoenixrun.agents.fetch_gate import FetchGate, unavailable
from phoenixrun.protocol import worker_messages as wm
from phoenixrun.protocol.worker_orders import Paths
from phoenixrun.protocol.restore import RankSource
from phoenixrun.runtime.agent_link import AgentLink, StateUnavailable
from phoenixrun.slot_format import SlotHeader
from tests.test_agent_parts import two_agents  # noqa: F401 - the fixture
from tests.test_restore_integrity import STEP, seal


def _collect() -> tuple[list[tuple[str, Paths]], Any]:
    got: list[tuple[str, Paths]] = []
    return got, lambda name: (lambda reply: got.append((name, reply)))


def test_a_request_for_a_rank_not_being_fetched_is_answered_at_once():
    gate = FetchGate()
    got, answer = _collect()
    assert not gate.defer(0, answer("a"))                # no fetch under way
    gate.close([1, 2])
    assert not gate.defer(0, answer("a"))                # not one of the fetched ranks
    assert got == [] and gate.waiting() == 0


def test_waiting_requests_get_their_ranks_paths_when_the_fetch_ends():
    gate = FetchGate()
    got, answer = _collect()
    token = gate.close([1, 2])
    assert gate.defer(1, answer("w1")) and gate.defer(2, answer("w2")) and gate.waiting() == 2
    assert got == []                                     # nothing answered while the fetch runs
    assert gate.open(token, paths=lambda r: Paths(paths=[f"r{r}-s0", f"r{r}-s1"]))
    assert got == [("w1", Paths(paths=["r1-s0", "r1-s1"])), ("w2", Paths(paths=["r2-s0", "r2-s1"]))]
    assert not gate.defer(1, answer("late"))            # over: a later request is answered at once


@pytest.mark.parametrize("end", ["failed", "planned_again", "quiesced"])
def test_waiting_requests_are_told_unavailable_when_the_state_will_not_come(end):
    gate = FetchGate()
    got, answer = _collect()
    token = gate.close([3])
    gate.defer(3, answer("w"))
    if end == "failed":
        assert gate.open(token, paths=lambda r: Paths(paths=[]), error="peer gone")
        assert got == [("w", unavailable("peer gone"))]
    elif end == "planned_again":                         # a new restore order: its own fetch, its own token
        newer = gate.close([3])
        assert got == [("w", unavailable("the restore was planned again"))]
        assert gate.defer(3, answer("w2"))
        assert not gate.open(token, paths=lambda r: Paths(paths=["stale"]))   # the abandoned fetch ends: no effect
        assert got[1:] == [] and gate.waiting() == 1
        assert gate.open(newer, paths=lambda r: Paths(paths=["new"])) and got[1:] == [("w2", Paths(paths=["new"]))]
    else:
        gate.abandon("quiesced")
        assert got == [("w", unavailable("quiesced"))] and not gate.open(token)
    assert all(reply.unavailable for _, reply in got if reply.error)


def _wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _ask_for_slots(link: AgentLink) -> queue.Queue:
    """The worker's request for its slots, from a thread (it blocks while the agent fetches); its reply or error."""
    out: queue.Queue = queue.Queue()

    def ask() -> None:
        try:
            out.put(link.request(wm.Slots(), timeout=60))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.put(e)
    threading.Thread(target=ask, daemon=True).start()
    return out


def test_a_worker_asking_for_its_slots_during_the_fetch_gets_them_once_installed(two_agents):  # noqa: F811
    """Node 0's agent stands for a replacement: its worker connects and asks for its slots while rank 0's state is
    being fetched from node 1 (its replica and a DP peer's parameters); the reply comes once they are installed,
    and the worker's restore reads them from those paths."""
    (a, b), servers = two_agents
    replica, shared = seal(b.slots, 0, b"\x01" * 64, bytes(range(256)))   # node 1 as the DP peer of rank 0
    b.replicas.put(0, STEP, bytearray(replica))                          # and as its replica holder
    link = AgentLink(a.sock_path)
    try:
        link.send(wm.Hello(local_rank=0, pid=1, api=True))
        link.orders.get(timeout=30)                                      # its assignment
        token = a.slots.fetching.close([0])
        reply = _ask_for_slots(link)
        _wait_until(lambda: a.slots.fetching.waiting() == 1, "the request to wait")
        assert reply.empty()
        a.replicator.fetch({0: RankSource.from_wire({"private": [servers[1].addr],
                                                     "shared": [[servers[1].addr, 0]]})}, STEP)
        assert a.slots.fetching.open(token, paths=lambda r: Paths(paths=a.slots.paths(r)))
        got = reply.get(timeout=30)
        assert got.paths == a.slots.paths(0)
        with open(got.paths[a.slots.slot_of(0, STEP)], "rb") as f:
            data = f.read()
        h = SlotHeader.unpack(data)
        assert data[:h.replicated_len] == replica and data[h.shared_off:h.shared_off + h.shared_len] == shared
        assert link.request(wm.Slots(), timeout=30).paths == got.paths    # no fetch: at once
    finally:
        link.close()


def test_a_worker_waiting_for_a_fetch_that_fails_is_told_its_state_is_unavailable(two_agents):  # noqa: F811
    (a, _), _ = two_agents
    link = AgentLink(a.sock_path)
    try:
        link.send(wm.Hello(local_rank=0, pid=1, api=True))
        link.orders.get(timeout=30)
        for end in ("failed", "quiesced"):
            token = a.slots.fetching.close([0])
            reply = _ask_for_slots(link)
            _wait_until(lambda: a.slots.fetching.waiting() == 1, "the request to wait")
            if end == "failed":
                a.slots.fetching.open(token, error="its state could not be fetched: peer gone")
            else:
                a.slots.fetching.abandon("a new recovery quiesces this node")
            err = reply.get(timeout=30)
            assert isinstance(err, StateUnavailable), err
            assert ("peer gone" if end == "failed" else "quiesces") in str(err)
    finally:
        link.close()

"""The fan-out tree (control/relay_tree.py): who relays to whom, and re-parenting when relays die."""
from __future__ import annotations

import math

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.control.relay_tree import (Member, Tree, changed_relays, plan, relay_count, reparent, route, spread,
                                          update)


def members(n: int, hosts: int = 0, domains: int = 1) -> list[Member]:
    hosts = hosts or n
    return [Member(f"r{(i % hosts) % domains}", f"h{i % hosts:03d}", f"n{i:04d}") for i in range(n)]


def check(tree: Tree, live: set[str]) -> None:
    """Every live node reached exactly once, depth <= 2 (a relay's parent is the master)."""
    assert set(tree.parent) == live
    for node, p in tree.parent.items():
        assert p != node
        if p is not None:
            assert p in live
            assert tree.parent[p] is None, f"{node}'s relay {p} is itself relayed"
    reached = list(tree.direct()) + [c for r in tree.relays for c in tree.children(r)]
    assert sorted(reached) == sorted(live)


@pytest.mark.parametrize("n, k", [(1, 1), (2, 2), (4, 2), (5, 3), (16, 4), (17, 5), (1024, 32), (4096, 64),
                                  (32768, 182)])
def test_relay_count_is_ceil_sqrt(n, k):
    assert relay_count(n) == k == math.ceil(math.sqrt(n))


@pytest.mark.parametrize("n, threshold, relays, direct, max_children", [
    (3, 4, 0, 3, 0),          # below the threshold: everyone polls the master
    (4, 4, 2, 2, 1),
    (4, 0, 0, 4, 0),          # threshold 0: relaying off
    (100, 64, 10, 10, 9),
    (1000, 64, 32, 32, 31),
    (4096, 64, 64, 64, 63),
])
def test_plan_table(n, threshold, relays, direct, max_children):
    t = plan(members(n), threshold)
    check(t, {m.node_id for m in members(n)})
    assert len(t.relays) == relays
    assert len(t.direct()) == direct
    assert max(t.loads().values(), default=0) == max_children


def test_plan_is_deterministic_and_order_free():
    ms = members(300, hosts=75, domains=5)
    assert plan(ms, 16) == plan(list(reversed(ms)), 16)


def test_relays_spread_over_domains_then_hosts():
    ms = members(64, hosts=16, domains=4)       # 4 racks x 4 hosts x 4 nodes
    t = plan(ms, 4)                             # 8 relays
    by_id = {m.node_id: m for m in ms}
    relays = [by_id[r] for r in t.relays]
    assert len(relays) == 8
    assert sorted({m.domain for m in relays}) == ["r0", "r1", "r2", "r3"]
    assert len({m.host for m in relays}) == 8   # no host carries two relays while others carry none


def test_spread_takes_each_domain_before_any_twice():
    ms = [Member("a", "h1", "x1"), Member("a", "h1", "x2"), Member("a", "h2", "x3"), Member("b", "h3", "x4")]
    assert [m.node_id for m in spread(ms, 3)] == ["x1", "x4", "x3"]


def test_dead_relay_children_go_to_the_least_loaded_and_nobody_else_moves():
    t = plan(members(100), 16)
    dead = t.relays[3]
    orphans = t.children(dead)
    after = reparent(t, {dead})
    check(after, set(t.parent) - {dead})
    for node, p in after.parent.items():
        if node not in orphans:
            assert p == t.parent[node]
    assert all(after.parent[o] not in (None, dead) for o in orphans)
    loads = after.loads()
    assert max(loads.values()) - min(loads.values()) <= 1


def test_all_relays_dead_everyone_polls_the_master():
    t = plan(members(9), 4)
    after = reparent(t, set(t.relays))
    assert after.relays == () and len(after.direct()) == 9 - len(t.relays)


def test_route_wakes_the_node_and_its_relay():
    t = plan(members(16), 4)
    child = next(n for n, p in t.parent.items() if p is not None)
    assert route(t, [child]) == {child, t.parent[child]}
    assert route(t, [t.relays[0]]) == {t.relays[0]}


def test_update_crossing_the_threshold_either_way():
    small, big = members(3), members(5)
    assert update(plan(small, 4), big, 4) == plan(big, 4)
    assert update(plan(big, 4), small, 4).relays == ()


def test_update_gives_newcomers_to_relays_and_keeps_the_rest():
    ms = members(100)
    t = plan(ms[:90], 16)
    after = update(t, ms, 16)
    check(after, {m.node_id for m in ms})
    assert all(after.parent[n] == p for n, p in t.parent.items())


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 400), hosts=st.integers(1, 50), domains=st.integers(1, 8), threshold=st.integers(0, 64),
       kills=st.lists(st.integers(0, 10**6), max_size=30), newcomers=st.integers(0, 40))
def test_every_live_node_reached_once_at_depth_two_through_deaths_and_joins(n, hosts, domains, threshold, kills,
                                                                            newcomers):
    ms = members(n + newcomers, hosts=hosts, domains=domains)
    live = {m.node_id: m for m in ms[:n]}
    t = plan(live.values(), threshold)
    check(t, set(live))
    if t.relays:
        assert len(t.direct()) == relay_count(n)
        loads = t.loads()
        assert max(loads.values()) - min(loads.values()) <= 1
    for i, k in enumerate(kills):
        ids = sorted(live)
        if not ids:
            break
        # relays die more often than their share: every other kill takes a relay if there is one
        victim = t.relays[k % len(t.relays)] if i % 2 == 0 and t.relays else ids[k % len(ids)]
        del live[victim]
        t = reparent(t, {victim})
        check(t, set(live))
    for m in ms[n:]:
        live[m.node_id] = m
    t = update(t, live.values(), threshold)
    check(t, set(live))


def test_changed_relays_are_those_whose_children_changed():
    t = plan(members(100), 16)
    dead = t.relays[3]
    after = reparent(t, {dead})
    moved_to = {after.parent[c] for c in t.children(dead)}
    assert changed_relays(t, after) == sorted(moved_to)
    assert changed_relays(t, t) == []
    assert changed_relays(Tree({"a": None, "b": None}), plan(members(4), 4)) == list(plan(members(4), 4).relays)


# ------------------------------------------------------------------ how often the tree and ring follow the membership
from phoenixrun.control.pacing import paced  # noqa: E402


@pytest.mark.parametrize("cost, floor, next_in", [
    (0.001, 0.25, 0.25),     # cheap: the floor
    (0.025, 0.25, 0.25),     # exactly a tenth of the floor
    (0.1, 0.25, 1.0),        # 0.1 s a walk (16K nodes): one a second, a tenth of the master
    (2.0, 0.25, 5.0),        # timed across a long wait for the lock: capped
    (0.0, 0.25, 0.25),
])
def test_an_expensive_walk_waits_ten_times_its_cost(cost, floor, next_in):
    assert paced(cost, floor) == pytest.approx(next_in)


def test_a_walk_that_took_long_is_not_run_again_until_it_is_due():
    from phoenixrun.control.pacing import Pacer
    ran: list[float] = []
    pacer = Pacer(0.25)

    def slow() -> None:             # 50 ms of work: the next walk 0.5 s later, not at the 0.25 s floor
        ran.append(time.perf_counter())
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            pass
    pacer.run(slow, now=100.0)
    pacer.run(slow, now=100.3)      # due at the floor, not after this walk's cost
    assert len(ran) == 1
    pacer.run(slow, now=100.0 + 5.01)
    assert len(ran) == 2

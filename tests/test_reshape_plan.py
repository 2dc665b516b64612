"""control/reshape.py: the shrink and grow plans (pure tables)."""
import json

import pytest

from phoenixrun.control.reshape import Refusal, plan_grow, plan_shrink
from phoenixrun.protocol.reshard import Image, NodeReshard
from phoenixrun.topology import Layout, place_replicas

L3 = Layout(3, 2)            # ranks 0-1 slot 0, 2-3 slot 1, 4-5 slot 2
P3 = place_replicas(L3, 1)


def inventories(layout, steps, skip=()):
    """Every rank has `steps` in its own slots; every holder has `steps` of the ranks it holds."""
    snaps = {s: {r: list(steps) for r in layout.ranks_of_slot(s)} for s in range(layout.nnodes) if s not in skip}
    reps: dict = {}
    for r, holders in place_replicas(layout, 1).items():
        for h in holders:
            if h not in skip:
                reps.setdefault(h, {})[r] = list(steps)
    return snaps, reps


def test_shrink_renumbers_the_survivors_and_reads_the_lost_shards_from_their_holders():
    snaps, reps = inventories(L3, [7, 8], skip={1})
    plan = plan_shrink(L3, {1}, snaps, reps, P3)
    assert plan.kind == "shrink" and plan.new == Layout(2, 2) and plan.restore_step == 8
    assert plan.slot_map == {0: 0, 2: 1}
    assert plan.predecessor == {0: 0, 1: 1, 2: 4, 3: 5}
    read = {i.old_rank: (s, i.own) for s, imgs in plan.images.items() for i in imgs}
    assert sorted(read) == list(range(6))                     # every old rank read exactly once
    assert all(own for r, (s, own) in read.items() if r not in (2, 3))
    for r in (2, 3):                                           # the lost ranks: at a surviving holder
        s, own = read[r]
        assert not own and [k for k, v in plan.slot_map.items() if v == s][0] in P3[r]
    w = plan.reshard_for(1)
    assert w.old_world == 6 and w.step == 8 and set(w.predecessor) == {2, 3}
    assert NodeReshard.from_wire(json.loads(json.dumps(w.to_wire()))) == w      # what the agent decodes


@pytest.mark.parametrize("own, replica, step", [
    ([7, 8], [7, 8], 8),
    ([8, 9], [7, 8], 8),      # a survivor already committed 9; the lost rank's replica stops at 8
    ([9], [8], None),         # nothing common
])
def test_shrink_takes_the_newest_step_every_rank_has(own, replica, step):
    snaps = {0: {0: own}, 2: {2: own}}
    reps = {0: {1: replica}, 2: {1: replica}}
    plan = plan_shrink(Layout(3, 1), {1}, snaps, reps, {0: [1], 1: [2], 2: [0]})
    if step is None:
        assert isinstance(plan, Refusal) and "no snapshot step" in plan.reason
    else:
        assert plan.restore_step == step


@pytest.mark.parametrize("layout, lost, placement, why", [
    (Layout(3, 2, tp=2), {1}, P3, "--tp 2"),
    (Layout(2, 2, pp=2), {1}, {}, "--pp 2"),
    (Layout(2, 1), {0, 1}, {}, "every node"),
    (Layout(3, 1), {1, 2}, {0: [1], 1: [2], 2: [0]}, "rank 1's optimizer shard has no replica"),
])
def test_shrink_refusals(layout, lost, placement, why):
    snaps = {s: {r: [3] for r in layout.ranks_of_slot(s)} for s in range(layout.nnodes) if s not in lost}
    plan = plan_shrink(layout, lost, snaps, {s: {r: [3] for r in range(layout.world_size)} for s in snaps}, placement)
    assert isinstance(plan, Refusal) and why in plan.reason


def test_grow_appends_a_slot_and_keeps_every_rank():
    L2 = Layout(2, 2)
    snaps = {s: {r: [11, 12] for r in L2.ranks_of_slot(s)} for s in range(2)}
    snaps[1][3] = [12, 13]
    plan = plan_grow(L2, 1, snaps, max_nnodes=3)
    assert plan.kind == "grow" and plan.new == Layout(3, 2) and plan.restore_step == 12
    assert plan.new_slots == (2,) and plan.slot_map == {0: 0, 1: 1}
    assert plan.predecessor == {r: r for r in range(4)}
    assert plan.images[1] == (Image(2, True, 0), Image(3, True, 1)) and 2 not in plan.images
    assert plan.reshard_for(2).images == () and plan.reshard_for(2).predecessor == {}


@pytest.mark.parametrize("layout, fresh, snaps, why", [
    (Layout(3, 1), 1, {0: {0: [1]}, 1: {1: [1]}, 2: {2: [1]}}, "already has its 3 nodes"),
    (Layout(2, 1), 1, {0: {0: [1]}, 1: {1: [2]}}, "no snapshot step"),
    (Layout(2, 2, tp=2), 1, {}, "--tp 2"),
])
def test_grow_refusals(layout, fresh, snaps, why):
    plan = plan_grow(layout, fresh, snaps, max_nnodes=3)
    assert isinstance(plan, Refusal) and why in plan.reason


@pytest.mark.parametrize("state, text", [
    ({"nnodes": 3, "active_nnodes": 3, "world_size": 6}, None),
    ({"nnodes": 3, "world_size": 6}, None),                     # a master from before shrinks
    ({"nnodes": 3, "active_nnodes": 2, "world_size": 4}, "shrunk: 2 of 3 nodes, world size 4"),
])
def test_status_names_the_shrunk_world(state, text):
    from phoenixrun.status import shrunk_text
    got = shrunk_text(state)
    assert got == text if text is None else got.startswith(text)
